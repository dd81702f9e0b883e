"""MoE experts held quantized (``framework/layers/moe/quantized_experts.py``).

A ``FusedMoE`` whose experts load a checkpoint format's tensors (written by
``framework quantize``'s writer, read back by the checkpoint loader's builder) must give
the float64 reference loop's output on the dequantized experts, on every
quantized-linear kernel; the two tensor-parallel ranks' partial sums must add up to it,
each rank holding its half; an expert-parallel rank keeps only its experts. A layer
whose experts did not all load quantized is refused; online quantization
(``--quantization int8|fp8``) quantizes the experts and frees their float weights, and a
weight update gives them float weights again.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.layers.moe import FusedMoE
from framework.layers.moe.experts import DOWN, GATE, UP
from framework.layers.moe.torch_moe import torch_fused_experts
from framework.layers.quantization.checkpoint import (
    CheckpointQuantization,
    attach_checkpoint_weights,
)
from framework.layers.quantization.checkpoint_writer import WriteFormat, is_expert, is_target
from framework.layers.quantization.linear_method import (
    ONLINE_FORMATS,
    float_weights_for_reload,
    quantize_linear_layers,
    quantized_bytes,
)
from framework.layers.quantization.weights import QuantizedWeight

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 4, 64, 32, 2
#: Each format's writer options: groups and blocks of 16, so that a rank's half of the
#: intermediate size (16) splits on their boundaries.
FORMATS = {
    "int8": WriteFormat("int8"),
    "fp8": WriteFormat("fp8"),
    "fp8_block": WriteFormat("fp8", block=16),
    "gptq": WriteFormat("gptq", group_size=16),
    "gptq_act_order": WriteFormat("gptq", group_size=16, act_order=True),
    "awq": WriteFormat("awq", group_size=16),
}
SHAPES = {GATE: (INTERMEDIATE, HIDDEN), UP: (INTERMEDIATE, HIDDEN), DOWN: (HIDDEN, INTERMEDIATE)}


def float_experts(seed: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    """Every expert's float projections, as a checkpoint stores them."""
    generator = torch.Generator().manual_seed(seed)
    return {(expert, part): torch.randn(shape, generator=generator) / 8
            for expert in range(EXPERTS) for part, shape in SHAPES.items()}


def quantized_experts(fmt: WriteFormat) -> dict[tuple[int, str], QuantizedWeight]:
    """Every expert's projections written in ``fmt`` and read back as the loader reads
    them (act-order GPTQ: each expert's gate and up share one row order, as the writer
    gives them)."""
    reader = CheckpointQuantization.from_config(fmt.quantization_config())
    weights = {}
    for (expert, part), tensor in float_experts().items():
        perm = None
        if fmt.act_order:
            gate_up = float_experts()[expert, GATE].square().sum(0) \
                + float_experts()[expert, UP].square().sum(0)
            perm = (gate_up if part != DOWN else tensor.square().sum(0)).argsort(
                descending=True, stable=True)
        written = fmt.quantize(f"experts.{expert}.{part}_proj.weight", tensor, perm)
        weights[expert, part] = reader.build(
            {name.rpartition(".")[2]: value for name, value in written.items()})
    return weights


def model_of(layer: FusedMoE) -> nn.Module:
    """A model of one MoE layer, as ``attach_checkpoint_weights`` walks one."""
    model = nn.Module()
    model.experts = layer
    return model


def loaded(weights: dict[tuple[int, str], torch.Tensor | QuantizedWeight],
           backend: str = "torch", **parallel: int) -> FusedMoE:
    """A layer that loaded ``weights`` through its weight loader, quantized ones attached
    to the ``backend`` kernel."""
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, **parallel)
    for (expert, part), weight in weights.items():
        param = layer.w2 if part == DOWN else layer.w13
        layer.weight_loader(param, weight, (expert, part))
    attach_checkpoint_weights(model_of(layer), backend)
    return layer


def routed(tokens: int = 9, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Tokens, their routing weights and their top-k experts (every expert chosen)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return x, weights, ids


def reference(weights: dict[tuple[int, str], QuantizedWeight]) -> torch.Tensor:
    """The float64 loop on the dequantized experts, for ``routed()``."""
    w13 = torch.stack([torch.cat([weights[e, GATE].dequantize(), weights[e, UP].dequantize()])
                       for e in range(EXPERTS)]).double()
    w2 = torch.stack([weights[e, DOWN].dequantize() for e in range(EXPERTS)]).double()
    x, routing, ids = routed()
    return torch_fused_experts(x.double(), w13, w2, routing.double(), ids,
                               FusedMoE(1, 1, 1).act)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt_weights(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param, quantized_experts(FORMATS[request.param])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_quantized_experts_match_the_float64_loop_on_their_dequantized_weights(
        fmt_weights: tuple[str, dict], backend: str) -> None:
    name, weights = fmt_weights
    layer = loaded(weights, backend)
    assert layer.quant_experts is not None and layer.quant_experts.count == EXPERTS
    assert layer.w13.numel() == layer.w2.numel() == 0  # the float copies are freed
    with torch.no_grad():
        got = layer(*routed())
    expected = reference(weights)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4, msg=name)
    # The rounding is visible: the float experts give another output.
    floats = loaded(float_experts())
    with torch.no_grad():
        assert (floats(*routed()).double() - expected).abs().max() > 1e-3


def test_two_tensor_parallel_ranks_sum_to_one_rank_s_output(
        fmt_weights: tuple[str, dict]) -> None:
    name, weights = fmt_weights
    ranks = [loaded(weights, tp_rank=rank, tp_size=2) for rank in (0, 1)]
    with torch.no_grad():
        total = sum(rank(*routed()).double() for rank in ranks)
    torch.testing.assert_close(total, reference(weights), rtol=1e-4, atol=1e-4, msg=name)
    whole = quantized_bytes(model_of(loaded(weights)))
    for rank in ranks:
        assert rank.quant_experts is not None
        assert rank.quant_experts.w13[0].shape == (INTERMEDIATE, HIDDEN)  # gate and up halves
        assert rank.quant_experts.w2[0].shape == (HIDDEN, INTERMEDIATE // 2)
        assert quantized_bytes(model_of(rank)) < 0.6 * whole


def test_an_expert_parallel_rank_keeps_only_its_experts() -> None:
    weights = quantized_experts(FORMATS["int8"])
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    for (expert, part), weight in weights.items():
        layer.weight_loader(layer.w2 if part == DOWN else layer.w13, weight, (expert, part))
    assert sorted(layer.quant_parts) == [(e, p) for e in (0, 1) for p in sorted(SHAPES)]
    attach_checkpoint_weights(model_of(layer), "torch")
    assert layer.quant_experts is not None
    # Rank 1 holds experts 2 and 3 whole: its local expert 0 is the checkpoint's expert 2.
    expected = torch.cat([weights[2, GATE].dequantize(), weights[2, UP].dequantize()])
    assert torch.equal(layer.quant_experts.w13[0].dequantize(), expected)
    assert torch.equal(layer.quant_experts.w2[1].dequantize(), weights[3, DOWN].dequantize())


def test_experts_loaded_partly_quantized_are_refused() -> None:
    weights: dict[tuple[int, str], torch.Tensor | QuantizedWeight] = dict(float_experts())
    quantized = quantized_experts(FORMATS["int8"])
    for part in SHAPES:
        weights[0, part] = quantized[0, part]
    with pytest.raises(ValueError, match=r"experts: expert 1's gate, up, down projection"):
        loaded(weights)


@pytest.mark.parametrize("quantization", sorted(ONLINE_FORMATS))
def test_online_quantization_quantizes_the_experts(quantization: str) -> None:
    floats = float_experts()
    block = model_of(loaded(floats))
    layer = block.experts
    float_bytes = layer.w13.nbytes + layer.w2.nbytes
    assert quantize_linear_layers(block, quantization, "cpu") == 1
    assert layer.quant_experts is not None and layer.w13.numel() == 0
    assert quantized_bytes(block) < 0.3 * float_bytes
    from_float = ONLINE_FORMATS[quantization].from_float
    expected = reference({key: from_float(w) for key, w in floats.items()})
    with torch.no_grad():
        torch.testing.assert_close(layer(*routed()).double(), expected, rtol=1e-4, atol=1e-4)
    # A weight update loads float experts again, into weights of their shapes.
    assert float_weights_for_reload(block) == 1
    assert layer.quant_experts is None
    assert layer.w13.shape == (EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    assert layer.w2.shape == (EXPERTS, HIDDEN, INTERMEDIATE)


@pytest.mark.parametrize(("name", "expert"), [
    ("model.layers.0.mlp.experts.3.gate_proj.weight", True),
    ("model.layers.0.mlp.experts.3.down_proj.weight", True),
    ("model.layers.0.block_sparse_moe.experts.7.w1.weight", True),
    ("model.layers.0.block_sparse_moe.experts.7.w2.weight", True),
    ("model.layers.0.mlp.shared_expert.down_proj.weight", False),
    ("model.layers.0.mlp.gate.weight", False),
    ("model.layers.0.mlp.experts.gate_up_proj", False),
])
def test_the_writer_quantizes_each_expert_s_projections(name: str, expert: bool) -> None:
    assert is_expert(name) is expert
    shared = name.endswith("shared_expert.down_proj.weight")
    assert is_target(name, torch.zeros(4, 4)) is (expert or shared)
