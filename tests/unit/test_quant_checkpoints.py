"""Pre-quantized checkpoints: a rank's part of each format, stacking, and detection.

``narrow_out`` / ``narrow_in`` / ``concat_out`` of every format must dequantize to exactly
the slices (and the stack) of the dequantized whole, since a tensor-parallel rank loads
its part and a stacked layer (q/k/v, gate/up) its projections through them; a boundary
inside a packed int32 or a group must be refused. The format comes from ``config.json``'s
``quantization_config``, and a ``--quantization`` that says otherwise is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from framework.cli import main
from framework.cli_quantize import check_arguments, quantize_checkpoint
from framework.layers.quantization import (
    AwqWeight,
    Fp8BlockWeight,
    Fp8Weight,
    GptqWeight,
    Int8Weight,
    quantize_awq,
    quantize_fp8,
    quantize_fp8_block,
    quantize_gptq,
    quantize_int8,
)
from framework.layers.quantization.calibration import CalibrationSettings
from framework.layers.quantization.checkpoint import (
    CheckpointQuantization,
    checkpoint_quantization,
    stack_parts,
)
from framework.layers.quantization.checkpoint_writer import WriteFormat
from framework.layers.quantization.weights import QuantizedWeight

OUT, IN = 48, 64


def _gptq(group: int, act_order: bool = False) -> Callable[[torch.Tensor], QuantizedWeight]:
    return lambda w: GptqWeight.from_checkpoint(quantize_gptq(w, group, act_order), group)


def _int8_checkpoint(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """int8's checkpoint names (``weight``, ``weight_scale`` ``[out, 1]``)."""
    tensors = quantize_int8(w)
    return {"weight": tensors["qweight"], "weight_scale": tensors["scale"][:, None]}


#: A weight of each format (and GPTQ grouping) from a float matrix.
MAKERS: dict[str, Callable[[torch.Tensor], QuantizedWeight]] = {
    "gptq": _gptq(16),
    "gptq_act_order": _gptq(16, act_order=True),
    "gptq_one_group": _gptq(-1),
    "awq": lambda w: AwqWeight.from_checkpoint(quantize_awq(w, 16), 16),
    "awq_one_group": lambda w: AwqWeight.from_checkpoint(quantize_awq(w, -1), -1),
    "fp8": lambda w: Fp8Weight.from_checkpoint(quantize_fp8(w)),
    "fp8_per_tensor": lambda w: Fp8Weight.from_checkpoint(
        {"weight": (w / 0.01).to(torch.float8_e4m3fn), "weight_scale": torch.tensor(0.01)}),
    "int8": lambda w: Int8Weight.from_checkpoint(_int8_checkpoint(w)),
    "fp8_block": lambda w: Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w, 16), (16, 16)),
}


def _weight(name: str, seed: int = 0, out: int = OUT) -> QuantizedWeight:
    torch.manual_seed(seed)
    return MAKERS[name](torch.randn(out, IN))


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize(("start", "length"), [(0, 16), (16, 32), (32, 16)])
def test_narrow_out_is_the_dequantized_rows(name: str, start: int, length: int) -> None:
    weight = _weight(name)
    part = weight.narrow_out(start, length)
    assert part.shape == (length, IN)
    assert torch.equal(part.dequantize(), weight.dequantize()[start:start + length])


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize(("start", "length"), [(0, 32), (32, 32), (16, 16)])
def test_narrow_in_is_the_dequantized_columns(name: str, start: int, length: int) -> None:
    weight = _weight(name)
    part = weight.narrow_in(start, length)
    assert part.shape == (OUT, length)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, start:start + length])


@pytest.mark.parametrize("name", [n for n in MAKERS if n != "gptq_act_order"])
def test_concat_out_stacks_the_dequantized_weights(name: str) -> None:
    """Stacked projections of one input (q/k/v): three weights of their own."""
    parts = [_weight(name, seed, out) for seed, out in ((1, 32), (2, 16), (3, 16))]
    stacked = type(parts[0]).concat_out(parts)
    assert stacked.shape == (64, IN)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_concat_out_of_act_order_parts_needs_one_g_idx() -> None:
    """Act-order projections stack when they share their row order, as a checkpoint's
    q/k/v do; different orders cannot be one weight."""
    torch.manual_seed(0)
    w = torch.randn(2 * OUT, IN)
    perm = torch.randperm(IN)
    q, k = (GptqWeight.from_checkpoint(quantize_gptq(half, 16, True, perm), 16)
            for half in w.chunk(2))
    stacked = GptqWeight.concat_out([q, k])
    assert torch.equal(stacked.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    other = _weight("gptq_act_order", seed=4)
    with pytest.raises(ValueError, match="g_idx differ"):
        GptqWeight.concat_out([q, other])


@pytest.mark.parametrize(("name", "method", "start", "length", "message"), [
    ("gptq", "narrow_out", 4, 16, "splits a 8-wide unit"),  # qzeros pack eight outputs
    ("gptq", "narrow_in", 4, 16, "splits a 8-wide unit"),  # qweight packs eight inputs
    ("gptq", "narrow_in", 8, 16, "splits a 16-wide unit"),  # a group of 16
    ("awq", "narrow_out", 12, 16, "splits a 8-wide unit"),
    ("awq", "narrow_in", 8, 8, "splits a 16-wide unit"),
    ("int8", "narrow_out", 40, 16, "outside 0:48"),
    ("fp8_block", "narrow_in", 16, 8, "cut a block of 16"),
])
def test_a_boundary_inside_a_packed_int32_or_a_group_is_refused(
        name: str, method: str, start: int, length: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        getattr(_weight(name), method)(start, length)


def test_block_fp8_parts_off_block_boundaries_keep_a_scale_per_row() -> None:
    """Blocks cut short by the weight's edges; output rows split or stacked off block
    boundaries (a rank's share of a small projection, q/k/v smaller than a block) fall back
    to a scale per row; input columns split only on block boundaries."""
    torch.manual_seed(5)
    w = torch.randn(40, 56)
    weight = Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w, 16), (16, 16))
    assert weight.tensors["weight_scale_inv"].shape == (3, 4)
    whole = weight.dequantize()
    assert torch.equal(weight.narrow_out(32, 8).dequantize(), whole[32:])
    assert torch.equal(weight.narrow_in(48, 8).dequantize(), whole[:, 48:])
    part = weight.narrow_out(8, 20)  # inside the first and second blocks
    assert part.block == (1, 16) and torch.equal(part.dequantize(), whole[8:28])
    full = Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w[:16], 16), (16, 16))
    for parts in ([full, weight], [weight, full], [full, part]):
        stacked = Fp8BlockWeight.concat_out(parts)
        assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert Fp8BlockWeight.concat_out([full, weight]).block == (16, 16)  # blocks kept
    other = Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w, 8), (8, 8))
    with pytest.raises(ValueError, match="their column blocks differ"):
        Fp8BlockWeight.concat_out([weight, other])


def test_stack_parts_refuses_missing_rows() -> None:
    """A stacked layer whose projections are not all quantized cannot make its weight."""
    q = _weight("int8", out=32)
    assert stack_parts({0: q}, (32, IN), "qkv").shape == (32, IN)
    with pytest.raises(ValueError, match="do not make its"):
        stack_parts({0: q}, (64, IN), "qkv")


def _model_dir(tmp_path: Path, quantization_config: dict | None) -> Path:
    config: dict = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "requested", "expected"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, None,
     CheckpointQuantization("gptq", 128)),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}, "awq",
     CheckpointQuantization("awq", 64)),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None,
     CheckpointQuantization("fp8")),
    ({"quant_method": "int8"}, "int8", CheckpointQuantization("int8")),
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "fp8",
     CheckpointQuantization("fp8", block=(128, 64))),
    (None, "int8", None),  # a float checkpoint, quantized online
    (None, None, None),
])
def test_format_is_detected_from_config_json(tmp_path: Path, config: dict | None,
                                             requested: str | None,
                                             expected: CheckpointQuantization | None) -> None:
    assert checkpoint_quantization(_model_dir(tmp_path, config), requested) == expected


@pytest.mark.parametrize(("config", "requested", "message"), [
    ({"quant_method": "gptq", "bits": 4}, "int8",
     r"--quantization int8 contradicts the checkpoint's quantization_config.quant_method "
     r"'gptq'"),
    ({"quant_method": "fp8"}, "awq", r"--quantization awq contradicts .* 'fp8'"),
    (None, "gptq", "has no quantization_config"),
    ({"quant_method": "gptq", "bits": 8}, None, "only 4-bit"),
    ({"quant_method": "awq", "version": "gemv"}, None, "GEMM"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, None,
     r"weight_block_size must be two positive integers \[rows, columns\], got \[128\]"),
    ({"quant_method": "bitsandbytes"}, None, "'bitsandbytes' is not supported"),
])
def test_contradictions_and_unsupported_configs_are_errors(
        tmp_path: Path, config: dict | None, requested: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(_model_dir(tmp_path, config), requested)


def test_group_gathers_a_layer_s_tensors_wherever_they_lie() -> None:
    """A layer's tensors split by other tensors (or shards) still make one weight; the
    float tensors pass through."""
    tensors = quantize_gptq(torch.randn(16, 32), 16)
    stream = [("layers.0.q_proj.qweight", tensors["qweight"]), ("norm.weight", torch.ones(4)),
              ("layers.0.q_proj.scales", tensors["scales"]),
              ("layers.0.q_proj.qzeros", tensors["qzeros"]),
              ("layers.0.q_proj.g_idx", tensors["g_idx"]),
              ("layers.0.q_proj.bias", torch.zeros(16))]
    grouped = list(CheckpointQuantization("gptq", 16).group(stream, [n for n, _ in stream]))
    assert [name for name, _ in grouped] == [
        "norm.weight", "layers.0.q_proj.weight", "layers.0.q_proj.bias"]
    weight = grouped[1][1]
    assert isinstance(weight, GptqWeight)
    assert torch.equal(weight.dequantize(),
                       GptqWeight.from_checkpoint(tensors, 16).dequantize())


@pytest.mark.parametrize(("fmt", "message"), [
    (WriteFormat("awq", 128, act_order=True), "--act-order is a gptq option"),
    (WriteFormat("gptq", 0), "group size must be positive or -1"),
    (WriteFormat("nf4"), "format must be one of"),
    (WriteFormat("int8", block=128), "--block-size is an fp8 option, not one of int8"),
    (WriteFormat("fp8", block=0), "block size must be positive, got 0"),
])
def test_quantize_refuses_bad_arguments(tmp_path: Path, fmt: WriteFormat, message: str) -> None:
    src = _model_dir(tmp_path, None)
    with pytest.raises(ValueError, match=message):
        check_arguments(src, tmp_path / "out", fmt)


@pytest.mark.parametrize(("flags", "message"), [
    (["--calibration-data", "{tmp}/missing"], "calibration data {tmp}/missing does not exist"),
    (["--calibration-data", "{tmp}", "--dampening", "1.5"],
     "--dampening must lie in (0, 1), got 1.5"),
    (["--calibration-data", "{tmp}", "--calibration-seq-len", "0"],
     "--calibration-samples and --calibration-seq-len must be positive"),
    (["--calibration-data", "{tmp}", "--rounding-steps", "-1"],
     "--rounding-steps must be 0 or more, got -1"),
    (["--rounding-steps", "10"], "--rounding-steps needs --calibration-data"),
])
def test_quantize_refuses_bad_calibration_in_one_line(
        tmp_path: Path, flags: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    src = _model_dir(tmp_path, None)
    argv = ["quantize", "--model-path", str(src), "--output", str(tmp_path / "out"),
            "--format", "fp8", *(flag.format(tmp=tmp_path) for flag in flags)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"framework: error: {message.format(tmp=tmp_path)}"]
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_a_quantized_source_and_a_used_output(tmp_path: Path) -> None:
    (tmp_path / "q").mkdir()
    quantized = _model_dir(tmp_path / "q", {"quant_method": "awq"})
    with pytest.raises(ValueError, match=r"already quantized \(awq\)"):
        check_arguments(quantized, tmp_path / "out", WriteFormat("int8"))
    (tmp_path / "f").mkdir()
    src = _model_dir(tmp_path / "f", None)
    with pytest.raises(ValueError, match="not an empty directory"):
        check_arguments(src, tmp_path / "q", WriteFormat("int8"))


def test_a_group_size_a_layer_cannot_hold_fails_and_writes_nothing(
        tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The tiny Llama's 64 input features take no group of 128: the error names the
    weight, and no half-written copy is left behind."""
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\..*group size 128 "
                                         r"does not divide 64 input features"):
        quantize_checkpoint(tiny_checkpoint("llama"), tmp_path / "out", "gptq")
    assert not (tmp_path / "out").exists()


def test_a_group_size_a_layer_cannot_hold_fails_before_calibration(
        tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Calibration text too short to calibrate on: the shapes are checked first."""
    (tmp_path / "short.txt").write_text("x = 1")
    calibration = CalibrationSettings((tmp_path / "short.txt",))
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\..*group size 128"):
        quantize_checkpoint(tiny_checkpoint("llama"), tmp_path / "out", "gptq",
                            calibration=calibration)
    assert not (tmp_path / "out").exists()


def test_same_layout_needs_every_tensor_with_its_shape_and_dtype(tmp_path: Path) -> None:
    # A pre-quantized model's weight update reads the new checkpoint's layout only.
    from safetensors.torch import save_file

    from framework.model_executor.weight_loader import check_same_layout

    def checkpoint(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    base = {"a.qweight": torch.zeros(4, 8, dtype=torch.int32), "a.scales": torch.zeros(2, 8)}
    running = checkpoint("running", base)
    check_same_layout(checkpoint("same", {k: v + 1 for k, v in base.items()}), running)
    shape = checkpoint("shape", {**base, "a.scales": torch.zeros(1, 8)})
    with pytest.raises(ValueError, match=r"'a.scales': F32 \[1, 8\] in .*, F32 \[2, 8\] in "):
        check_same_layout(shape, running)
    missing = checkpoint("missing", {"a.qweight": base["a.qweight"]})
    with pytest.raises(ValueError, match=r"'a.scales': absent in"):
        check_same_layout(missing, running)
    dtype = checkpoint("dtype", {**base, "a.scales": torch.zeros(2, 8, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"'a.scales': F16"):
        check_same_layout(dtype, running)
