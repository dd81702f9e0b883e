"""Quantized-linear kernels (reference and CPU) against a float64 product of the weight.

Every kernel and path (torch's packed int8/int4 kernels, widening by blocks, and the native
kernels) must give ``x @ dequantize(w).T + bias`` to float32 accuracy for 1 to 4, 7, 64
and 65 rows, act-order GPTQ included; a repacked weight must still dequantize to
the same matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from framework.layers.quantization import (
    AwqWeight,
    Fp8Weight,
    GptqWeight,
    Int8Weight,
    QuantizedWeight,
    cpu_kernels,
    quantize_awq,
    quantize_gptq,
)
from framework.layers.quantization.cpu_kernels import CpuFp8Weight, CpuInt4Weight, CpuQuantLinear
from framework.layers.quantization.torch_kernels import TorchQuantLinear
from framework.registry import QUANT_LINEAR_BACKENDS
from tests.unit.test_attention_cpu import kernels as native_kernels

OUT, IN = 32, 128


def float_weight(out_features: int = OUT) -> torch.Tensor:
    """A fixed random float weight ``[out_features, IN]``."""
    return torch.randn(out_features, IN, generator=torch.Generator().manual_seed(0))


WEIGHTS: dict[str, Callable[[], QuantizedWeight]] = {
    "gptq": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(), 32), 32),
    "gptq-act-order": lambda: GptqWeight.from_checkpoint(
        quantize_gptq(float_weight(), 32, act_order=True), 32),
    "gptq-one-group": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(), -1), -1),
    # 8 outputs: too few for torch's int4 layout, so its path widens nibbles instead.
    "gptq-8-out": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(8), 32), 32),
    "awq": lambda: AwqWeight.from_checkpoint(quantize_awq(float_weight(), 64), 64),
    "fp8-per-channel": lambda: Fp8Weight.from_float(float_weight()),
    "fp8-per-tensor": lambda: Fp8Weight.from_checkpoint({
        "weight": (float_weight() * 50).to(torch.float8_e4m3fn),
        "weight_scale": torch.tensor(0.02)}),
    "int8": lambda: Int8Weight.from_float(float_weight()),
    # 30 outputs: the native kernels' last features outside their blocks of 2 and 4.
    "int8-30-out": lambda: Int8Weight.from_float(float_weight(30)),
}
KERNELS: dict[str, Callable[[], object]] = {
    "torch": TorchQuantLinear,
    "cpu-packed": lambda: CpuQuantLinear(packed_ops=True, native=False),
    "cpu-widen": lambda: CpuQuantLinear(packed_ops=False, native=False),
    "cpu-native": lambda: CpuQuantLinear(packed_ops=False),
}
#: Row counts: each of the native kernels' blocks of 1 to 4 rows, several blocks, and past
#: their limit (NATIVE_ROWS).
ROWS = (1, 2, 3, 4, 7, 64, 65)


def reference(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` in float64."""
    return x.double() @ weight.dequantize().double().t() + bias.double()


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize("weight_name", sorted(WEIGHTS))
def test_kernel_matches_float64_reference(kernel_name: str, weight_name: str) -> None:
    weight = WEIGHTS[weight_name]()
    if kernel_name == "cpu-native":
        native_kernels()  # built (or the test says why not)
    kernel = KERNELS[kernel_name]()
    prepared = kernel.prepare(weight)
    bias = torch.randn(weight.out_features, generator=torch.Generator().manual_seed(1))
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        y = kernel.apply(prepared, x, bias)
        assert y.shape == (rows, weight.out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), reference(weight, x, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_name", ["gptq-act-order", "awq", "fp8-per-tensor", "int8"])
def test_few_rows_run_the_native_kernels(monkeypatch: pytest.MonkeyPatch,
                                         weight_name: str) -> None:
    # The other paths refused: up to NATIVE_ROWS rows must not need them.
    native_kernels()
    kernel = CpuQuantLinear(packed_ops=False)
    monkeypatch.setattr(kernel, "_apply_torch", lambda *_: pytest.fail("not native"))
    weight = WEIGHTS[weight_name]()
    prepared = kernel.prepare(weight)
    bias = torch.zeros(weight.out_features)
    for rows in range(1, cpu_kernels.NATIVE_ROWS + 1):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(kernel.apply(prepared, x).double(), reference(weight, x, bias),
                                   rtol=1e-5, atol=1e-4)


def test_native_kernels_take_every_fp8_code() -> None:
    # All 254 finite E4M3 encodings, normal and subnormal (and two zeros), each times an
    # input of one: K = 16, one step of the kernel.
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)]
    rows = torch.tensor([*finite, 0, 0], dtype=torch.uint8).view(16, 16)
    weight = Fp8Weight.from_checkpoint({"weight": rows.view(torch.float8_e4m3fn),
                                        "weight_scale": torch.tensor(1.0)})
    prepared = CpuQuantLinear(packed_ops=False).prepare(weight)
    ops = native_kernels()
    for column in range(16):
        x = torch.zeros(1, 16)
        x[0, column] = 1.0
        y = ops.fp8_rows(x, prepared.tensors["bits"], prepared.tensors["scale"])
        assert torch.equal(y[0], weight.dequantize()[:, column])


@pytest.mark.parametrize("packed_ops", [True, False])
@pytest.mark.parametrize("weight_name", sorted(WEIGHTS))
def test_cpu_prepare_keeps_the_matrix(packed_ops: bool, weight_name: str) -> None:
    weight = WEIGHTS[weight_name]()
    prepared = CpuQuantLinear(packed_ops=packed_ops).prepare(weight)
    torch.testing.assert_close(prepared.dequantize(), weight.dequantize(), rtol=1e-6, atol=1e-6)


def test_cpu_paths_keep_quantized_bytes() -> None:
    int4 = CpuQuantLinear(packed_ops=True).prepare(WEIGHTS["gptq"]())
    assert isinstance(int4, CpuInt4Weight) and "packed" in int4.tensors
    nibbles = CpuQuantLinear(packed_ops=False).prepare(WEIGHTS["gptq-act-order"]())
    assert nibbles.tensors["nibbles"].dtype == torch.uint8
    assert nibbles.tensors["nibbles"].shape == (OUT, IN // 2)
    fp8 = WEIGHTS["fp8-per-channel"]()
    prepared = CpuQuantLinear().prepare(fp8)
    assert isinstance(prepared, CpuFp8Weight)
    assert prepared.tensors["bits"].data_ptr() == fp8.tensors["weight"].data_ptr()


def test_cpu_fp8_widening_reads_every_byte() -> None:
    # All 254 finite E4M3 encodings, normal and subnormal, through the float16 bit trick.
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    weight = Fp8Weight.from_checkpoint({"weight": codes.view(torch.float8_e4m3fn)[None],
                                        "weight_scale": torch.tensor(1.0)})
    prepared = CpuQuantLinear().prepare(weight)
    assert torch.equal(prepared.dequantize(), weight.dequantize())


@pytest.mark.parametrize("packed_ops", [True, False])
def test_cpu_widening_by_blocks(monkeypatch: pytest.MonkeyPatch, packed_ops: bool) -> None:
    # Blocks of 3 rows (not dividing 32) cover every output of the widening paths, and
    # every input row when a packed int4 weight is read back.
    monkeypatch.setattr(cpu_kernels, "UPCAST_ELEMENTS", 3 * IN)
    kernel = CpuQuantLinear(packed_ops=packed_ops)
    x, bias = torch.randn(5, IN), torch.randn(OUT)
    for name in ("gptq-act-order", "fp8-per-channel", "int8"):
        weight = WEIGHTS[name]()
        prepared = kernel.prepare(weight)
        y = kernel.apply(prepared, x, bias)
        torch.testing.assert_close(y.double(), reference(weight, x, bias), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(prepared.dequantize(), weight.dequantize(), rtol=1e-6,
                                   atol=1e-6)


def test_output_follows_input_dtype_without_bias() -> None:
    weight = WEIGHTS["int8"]()
    x = torch.randn(3, IN)
    for kernel in (TorchQuantLinear(), CpuQuantLinear()):
        y = kernel.apply(kernel.prepare(weight), x.bfloat16(), None)
        assert y.dtype == torch.bfloat16
        expected = x.bfloat16().double() @ weight.dequantize().double().t()
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=5e-2)


def test_unsupported_weights_are_refused() -> None:
    cpu = CpuQuantLinear()
    prepared = cpu.prepare(WEIGHTS["gptq"]())
    with pytest.raises(ValueError, match="does not support 'cpu_int4'"):
        TorchQuantLinear().prepare(prepared)
    with pytest.raises(ValueError, match="from its prepare"):
        cpu.apply(WEIGHTS["gptq"](), torch.randn(1, IN))
    # GPTQ groups of unequal sizes cannot be sorted into runs for the CPU layout.
    tensors = quantize_gptq(float_weight(), 32)
    tensors["g_idx"] = torch.zeros(IN, dtype=torch.int32)
    tensors["g_idx"][-1] = 3
    with pytest.raises(ValueError, match="g_idx"):
        cpu.prepare(GptqWeight.from_checkpoint(tensors, 32))


def test_registry_names_both_kernels() -> None:
    assert QUANT_LINEAR_BACKENDS.get("torch") is TorchQuantLinear
    assert QUANT_LINEAR_BACKENDS.get("cpu") is CpuQuantLinear
