"""The MoE kernels (``MOE_BACKENDS``) against a float64 loop over tokens and their choices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.layers.activation import GatedActivation
from framework.layers.linear_kernel import onednn_available, pack_weight
from framework.layers.moe import FusedMoE, cpu_moe
from framework.layers.moe.experts import pack_expert_weights
from framework.layers.moe.router import select_experts
from framework.registry import MOE_BACKENDS
from tests.unit.test_attention_cpu import kernels

KERNELS = ("torch", "cpu")
#: Whether the activation has the native CPU kernels bound (``act.cpu_ops``), as a model
#: on a CPU has them; the cpu kernel then walks small blocks with ``linear_rows``.
NATIVE_MODES = (False, True)


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, first_expert: int, act: str = "silu") -> torch.Tensor:
    """Token by token, choice by choice, in float64; experts not held add nothing."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    gate_act = F.silu if act == "silu" else F.gelu
    out = torch.zeros_like(x)
    intermediate = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            local = int(ids[t, k]) - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate_up = w13[local] @ x[t]
            hidden = gate_act(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += float(weights[t, k]) * (w2[local] @ hidden)
    return out


def make_case(tokens: int, experts: int, top_k: int, *, hidden: int = 32,
              intermediate: int = 48, held: tuple[int, int] | None = None,
              renormalize: bool = True, dtype: torch.dtype = torch.float32,
              seed: int = 0) -> dict[str, object]:
    """Random activations, the held experts' weights and a routing of ``tokens`` tokens.

    ``held``: the experts ``[start, end)`` this rank holds (default: all of them).
    """
    generator = torch.Generator().manual_seed(seed)
    start, end = held or (0, experts)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(end - start, 2 * intermediate, hidden, generator=generator) * 0.2
    w2 = torch.randn(end - start, hidden, intermediate, generator=generator) * 0.2
    logits = torch.randn(tokens, experts, generator=generator) * 2
    weights, ids = select_experts(logits, top_k, renormalize)
    return {"x": x.to(dtype), "w13": w13.to(dtype), "w2": w2.to(dtype), "weights": weights,
            "ids": ids, "first_expert": start}


def run(kernel: str, case: dict[str, object], native: bool,
        act: str = "silu") -> torch.Tensor:
    activation = GatedActivation(act)
    activation.cpu_ops = kernels() if native else None
    with torch.inference_mode():
        return MOE_BACKENDS.get(kernel)(case["x"], case["w13"], case["w2"], case["weights"],
                                        case["ids"], activation, case["first_expert"])


def expected(case: dict[str, object], act: str = "silu") -> torch.Tensor:
    return reference(case["x"], case["w13"], case["w2"], case["weights"], case["ids"],
                     case["first_expert"], act)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("native", NATIVE_MODES)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"), [
    (0, 4, 2, True),  # no tokens at all
    (1, 4, 1, False),  # one decode row
    (3, 8, 2, True),  # blocks of a row or two
    (24, 8, 2, True),  # blocks around the native kernel's rows, chunked
    (40, 4, 4, False),  # every expert chosen by every token, unnormalised
    (200, 8, 2, True),  # prefill-sized blocks
])
def test_float32_matches_the_float64_loop(kernel: str, native: bool, tokens: int,
                                          experts: int, top_k: int, renormalize: bool) -> None:
    case = make_case(tokens, experts, top_k, renormalize=renormalize)
    out = run(kernel, case, native)
    assert out.dtype == torch.float32 and out.shape == case["x"].shape
    torch.testing.assert_close(out.double(), expected(case), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("native", NATIVE_MODES)
@pytest.mark.parametrize("tokens", [2, 12, 100])  # native rows, chunks of them, a GEMM
def test_bfloat16_is_within_its_rounding_of_the_float64_loop(kernel: str, native: bool,
                                                             tokens: int) -> None:
    case = make_case(tokens, 8, 2, dtype=torch.bfloat16, seed=1)
    out = run(kernel, case, native)
    assert out.dtype == torch.bfloat16
    truth = expected(case)
    # bfloat16 keeps 8 bits of mantissa: each output within a few of its units of the scale.
    scale = truth.abs().max()
    assert (out.double() - truth).abs().max() <= 0.02 * scale


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("native", NATIVE_MODES)
def test_experts_without_tokens_are_skipped(kernel: str, native: bool) -> None:
    case = make_case(10, 8, 2)
    case["ids"] = case["ids"] % 3  # experts 3..7 get nothing
    case["ids"][:, 1] = (case["ids"][:, 0] + 1) % 3  # two distinct experts per token
    torch.testing.assert_close(run(kernel, case, native).double(), expected(case),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("native", NATIVE_MODES)
@pytest.mark.parametrize("tokens", [2, 30])
def test_choices_of_experts_another_rank_holds_add_nothing(kernel: str, native: bool,
                                                           tokens: int) -> None:
    """This rank holds experts 2..4 of 8; tokens choose among all 8."""
    case = make_case(tokens, 8, 4, held=(2, 5), seed=2)
    assert ((case["ids"] < 2) | (case["ids"] >= 5)).any()
    out = run(kernel, case, native)
    torch.testing.assert_close(out.double(), expected(case), atol=2e-4, rtol=2e-4)
    # A token none of whose choices is held gets zeros.
    case["ids"][0] = torch.tensor([0, 1, 5, 6])
    assert not run(kernel, case, native)[0].any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("native", NATIVE_MODES)
def test_other_gated_activations(kernel: str, native: bool) -> None:
    case = make_case(9, 4, 2, seed=3)
    torch.testing.assert_close(run(kernel, case, native, act="gelu").double(),
                               expected(case, act="gelu"), atol=2e-4, rtol=2e-4)


def test_cpu_kernel_walks_small_blocks_natively_and_multiplies_large_ones() -> None:
    """Experts with up to ``NATIVE_BLOCK_ROWS`` rows take ``linear_rows`` (``NATIVE_ROWS``
    at a time), larger blocks one GEMM each."""
    from types import SimpleNamespace

    native = kernels()
    calls: list[int] = []

    def linear_rows(x: torch.Tensor, w: torch.Tensor, b: None) -> torch.Tensor:
        calls.append(len(x))
        return native.linear_rows(x, w, b)

    ops = SimpleNamespace(linear_rows=linear_rows, silu_and_mul=native.silu_and_mul)
    act = GatedActivation("silu")
    act.cpu_ops = ops
    limit = cpu_moe.NATIVE_BLOCK_ROWS[torch.float32]
    case = make_case(limit + 1, 2, 1)
    case["ids"][:] = 0
    case["ids"][:limit] = 1  # expert 1: the largest native block; expert 0: a single row
    with torch.inference_mode():
        cpu_moe.cpu_fused_experts(case["x"], case["w13"], case["w2"], case["weights"],
                                  case["ids"], act)
    per_projection = [4] * (limit // 4) + [limit % 4] * (limit % 4 > 0)
    assert calls == [1, 1] + [rows for chunk in per_projection for rows in (chunk, chunk)]
    calls.clear()
    case["ids"][:] = 0  # one block past the limit: a GEMM
    with torch.inference_mode():
        cpu_moe.cpu_fused_experts(case["x"], case["w13"], case["w2"], case["weights"],
                                  case["ids"], act)
    assert calls == []


def test_cpu_kernel_multiplies_large_bfloat16_blocks_in_float32_without_native_bfloat16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bfloat16 GEMMs are slow, a block past the native rows runs in float32."""
    monkeypatch.setattr(cpu_moe, "_BF16_GEMM", False)
    seen: list[torch.dtype] = []
    linear = F.linear
    monkeypatch.setattr(cpu_moe.F, "linear",
                        lambda x, w, *rest: (seen.append(x.dtype), linear(x, w, *rest))[1])
    case = make_case(cpu_moe.NATIVE_BLOCK_ROWS[torch.bfloat16] + 1, 1, 1,
                     dtype=torch.bfloat16)
    out = run("cpu", case, native=True)
    assert seen == [torch.float32, torch.float32] and out.dtype == torch.bfloat16
    seen.clear()
    monkeypatch.setattr(cpu_moe, "_BF16_GEMM", True)
    run("cpu", case, native=True)
    assert seen == [torch.bfloat16, torch.bfloat16]


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN to pack for")
@pytest.mark.parametrize("tokens", [12, 60, 200])  # packed blocks, a mix, GEMM blocks
def test_cpu_kernel_on_packed_expert_weights_matches_the_float64_loop(
        tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(tokens, 4, 2)
    packed = ([pack_weight(w) for w in case["w13"]], [pack_weight(w) for w in case["w2"]])
    used: list[int] = []
    real = cpu_moe.linear

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        used.append(len(x))
        return real(x, *args)

    monkeypatch.setattr(cpu_moe, "linear", counting)
    with torch.inference_mode():
        out = cpu_moe.cpu_fused_experts(case["x"], case["w13"], case["w2"], case["weights"],
                                        case["ids"], GatedActivation("silu"), 0, packed=packed)
    torch.testing.assert_close(out.double(), expected(case), atol=2e-4, rtol=2e-4)
    # Only (and, at 12 tokens, every one of) the blocks below PACKED_BLOCK_ROWS went
    # through the packed weights.
    assert all(rows < cpu_moe.PACKED_BLOCK_ROWS for rows in used)
    assert bool(used) == (tokens < 200)


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN to pack for")
def test_fused_moe_packs_every_expert_s_weights_for_the_onednn_backend() -> None:
    layer = FusedMoE(4, 16, 24)
    for param in (layer.w13, layer.w2):
        torch.nn.init.normal_(param)
    pack_expert_weights([layer])
    assert layer.packed is not None
    assert [len(ws) for ws in layer.packed] == [4, 4]
