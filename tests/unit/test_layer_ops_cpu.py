"""The native CPU norm, activation, rotary and few-row product kernels, and the layers
that use them.

Norm and activation are checked against float64, and in bfloat16 against the torch
operators they stand for; the rotary kernel must equal the torch rotation bit for bit
(itself bit for bit transformers', test_llama_models.py), in both dtypes; the product of
a few rows must agree with ``F.linear`` to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from framework.config import ServerArgs
from framework.cpuinfo import cpuinfo_fields
from framework.layers import linear_kernel
from framework.layers.activation import GatedActivation
from framework.layers.linear import RowParallelLinear
from framework.layers.linear_kernel import BFLOAT16_NATIVE_ROWS, NATIVE_ROWS, linear
from framework.layers.norm import RMSNorm
from framework.layers.rotary import RopeConfig, RotaryEmbedding
from framework.model_executor.model_runner import ModelRunner
from tests.model_fixtures import make_tiny_checkpoint
from tests.unit.test_attention_cpu import kernels

TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}
#: Whether the kernels hold linear_rows' bfloat16 dot-product walk (AVX512-BF16).
HAS_BF16_DOT = "avx512_bf16" in cpuinfo_fields("flags").get("flags", "").split()


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).float()


def rows(count: int, features: int, seed: int) -> torch.Tensor:
    return torch.randn(count, features, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(("count", "features"), [(0, 256), (1, 64), (17, 256), (300, 100)])
def test_rms_norm_and_its_residual_form_match_float64(count: int, features: int) -> None:
    ops = kernels()
    x, residual = rows(count, features, 0), rows(count, features, 1)
    weight = rows(1, features, 2)[0]
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), norm_reference(x, weight, 1e-5),
                               **TOLERANCE)
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)  # one float addition, exactly torch's
    torch.testing.assert_close(normed, norm_reference(x + residual, weight, 1e-6), **TOLERANCE)


@pytest.mark.parametrize(("count", "width"), [(0, 16), (1, 64), (33, 768), (5, 100)])
def test_silu_and_mul_matches_float64(count: int, width: int) -> None:
    gate_up = rows(count, 2 * width, 3)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = (gate * torch.sigmoid(gate) * up).float()
    torch.testing.assert_close(kernels().silu_and_mul(gate_up), expected, **TOLERANCE)


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    ops = kernels()
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="in the input's dtype"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(torch.ones(4, 2).T, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight of 4 features"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        ops.add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="even number"):
        ops.silu_and_mul(torch.ones(2, 5))


def test_bound_layers_use_the_kernels_and_agree_with_their_torch_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ops = kernels()
    norm, act = RMSNorm(64, eps=1e-5), GatedActivation("silu")
    torch.nn.init.normal_(norm.weight)
    x, residual, gate_up = rows(9, 64, 4), rows(9, 64, 5), rows(9, 128, 6)
    expected_norm, expected_sum = norm(x, residual)
    expected_act = act(gate_up)
    norm.cpu_ops = act.cpu_ops = ops
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    normed, summed = norm(x, residual)
    torch.testing.assert_close(normed, expected_norm, **TOLERANCE)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(norm(x), norm.forward(x), **TOLERANCE)
    torch.testing.assert_close(act(gate_up), expected_act, **TOLERANCE)
    assert calls == ["add_rms_norm", "rms_norm", "rms_norm", "silu_and_mul"]
    # What the kernels do not take goes to the torch operators.
    calls.clear()
    assert norm(x.T.contiguous().T).shape == (9, 64)  # strided rows
    assert norm(x[None]).shape == (1, 9, 64)  # three dimensions
    gelu = GatedActivation("gelu")
    gelu.cpu_ops = ops
    assert gelu(gate_up).shape == (9, 64)
    assert calls == []


def test_the_runner_binds_the_kernels_for_float32_and_bfloat16_on_a_cpu_only(
        tmp_path: Path) -> None:
    kernels()
    path = make_tiny_checkpoint(tmp_path, "qwen3")  # with per-head q/k norms
    args = {"model_path": str(path), "device": "cpu", "max_total_tokens": 256}
    kinds = (RMSNorm, GatedActivation, RotaryEmbedding, RowParallelLinear)
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(ServerArgs(**args, dtype=dtype), str(path))
        assert runner.native_layer_ops
        bound = [m for m in runner.model.modules() if isinstance(m, kinds)]
        assert {type(m) for m in bound} == set(kinds)
        assert all(m.cpu_ops is not None for m in runner.model.modules()
                   if hasattr(m, "cpu_ops"))
    half = ModelRunner(ServerArgs(**args, dtype="float16"), str(path))
    assert not half.native_layer_ops
    assert all(m.cpu_ops is None for m in half.model.modules() if hasattr(m, "cpu_ops"))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (2, 1, 128), (3, 3, 6)])
def test_rotary_is_bit_for_bit_the_torch_rotation(heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    """On q and k as the model passes them: column slices of one qkv tensor."""
    ops = kernels()
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0))
    qkv = rows(37, (heads + 2 * kv_heads) * head_dim, 7)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(8))
    expected_q, expected_k = rope(positions, q, k)  # the torch form, checked against HF's
    rope.cpu_ops = ops
    rotated_q, rotated_k = rope(positions, q, k)
    assert rotated_q.is_contiguous() and rotated_k.is_contiguous()
    assert torch.equal(rotated_q, expected_q)
    assert torch.equal(rotated_k, expected_k)


def test_rotary_refuses_what_it_cannot_read() -> None:
    ops = kernels()
    cos = sin = torch.ones(3, 2)
    with pytest.raises(RuntimeError, match="whole heads"):
        ops.rotary(torch.ones(3, 10), cos, sin, 4)
    with pytest.raises(RuntimeError, match="contiguous features"):
        ops.rotary(torch.ones(8, 3).T, cos, sin, 4)
    with pytest.raises(RuntimeError, match=r"\[rows, head_dim / 2\]"):
        ops.rotary(torch.ones(3, 8), torch.ones(3, 3), sin, 4)


@pytest.mark.parametrize("width", [1, 7, 8, 9, 4096, 4099])
def test_argmax_rows_is_torch_s_choice_with_ties_infinities_and_nans(width: int) -> None:
    ops = kernels()
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(12, width, generator=generator)
    # Ties: the first of equal maxima wins, wherever they fall (also in the 8-wide tail).
    logits[1] = 0.5
    logits[2, -1] = logits[2, 0] = 99.0
    logits[3] = float("-inf")
    logits[4, width // 2] = float("inf")
    logits[5, -1] = float("nan")  # a NaN is the max, as in torch
    logits[6, width // 3] = float("nan")
    logits[6, -1] = float("nan")
    logits[7, 0] = float("nan")
    expected = logits.max(dim=-1).indices
    assert torch.equal(ops.argmax_rows(logits), expected)


def test_the_sampler_takes_the_native_argmax_for_greedy_rows() -> None:
    from framework.layers.sampler import Sampler, SamplingBatchInfo
    from framework.sampling_params import SamplingParams

    ops = kernels()
    calls: list[tuple[int, ...]] = []
    sampler = Sampler(argmax_rows=lambda x: (calls.append(tuple(x.shape)), ops.argmax_rows(x))[1])
    logits = rows(5, 300, 9)
    info = SamplingBatchInfo.from_requests([SamplingParams(temperature=0.0)] * 5, [[]] * 5,
                                           [[1]] * 5, set(), 300, torch.device("cpu"))
    out = sampler(logits, info, return_logprob=False)
    assert calls == [(5, 300)]
    assert torch.equal(out.next_token_ids, logits.max(dim=-1).indices)


# --------------------------------------------------------------------------- bfloat16


def bf16_rows(count: int, features: int, seed: int) -> torch.Tensor:
    return rows(count, features, seed).to(torch.bfloat16)


@pytest.mark.parametrize(("count", "features"), [(1, 64), (17, 128), (300, 100)])
def test_bfloat16_norm_and_activation_round_as_the_torch_operators(count: int,
                                                                   features: int) -> None:
    """Computed in float32 and rounded where torch's bfloat16 operators round: the mean of
    squares runs in another order, which may move a result by one bfloat16 step."""
    ops = kernels()
    norm = RMSNorm(features, eps=1e-5).to(torch.bfloat16)
    norm.weight.copy_(bf16_rows(1, features, 2)[0])
    x, residual = bf16_rows(count, features, 0), bf16_rows(count, features, 1)
    step = {"atol": 0.0, "rtol": 2 ** -7}  # one bfloat16 step
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), **step)
    expected, expected_sum = norm(x, residual)
    normed, summed = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(summed, expected_sum)  # one rounded addition, exactly torch's
    torch.testing.assert_close(normed, expected, **step)
    gate_up = bf16_rows(count, 2 * features, 3)
    activated, expected = ops.silu_and_mul(gate_up), GatedActivation("silu")(gate_up)
    # silu rounds to bfloat16 before the product: where its float32 value lies within the
    # last bits of a midpoint between two bfloat16 values, another exp (the kernel's vector
    # one against torch's) may round it the other way, one step of silu and so up to two
    # of the product. Such elements are rare.
    torch.testing.assert_close(activated, expected, atol=0.0, rtol=2 ** -6)
    assert (activated != expected).float().mean() < 0.01


def test_bfloat16_rotary_is_bit_for_bit_the_torch_rotation() -> None:
    ops = kernels()
    rope = RotaryEmbedding(64, RopeConfig(theta=10000.0))
    qkv = bf16_rows(37, 8 * 64, 7)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    positions = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(8))
    expected_q, expected_k = rope(positions, q, k)
    rope.cpu_ops = ops
    rotated_q, rotated_k = rope(positions, q, k)
    assert rotated_q.dtype == torch.bfloat16
    assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("count", "features", "outputs"),
                         [(1, 256, 768), (2, 128, 4099), (3, 64, 5), (4, 24, 130),
                          (7, 128, 48), (13, 24, 37), (11, 96, 37), (5, 160, 67),
                          (6, 48, 130), (16, 32, 19)])
def test_linear_rows_agrees_with_f_linear(dtype: torch.dtype, count: int, features: int,
                                          outputs: int) -> None:
    """Float32 sums in another order; in bfloat16 the same sums rounded once, as torch's.
    Rows go in walks of up to eight (AVX-512, features a multiple of 32) or four (else),
    with last walks of every size here; output features in blocks, with some left over;
    features a multiple of 32, of 16 only (48) and of neither (24)."""
    ops = kernels()
    x = rows(count, features, 10).to(dtype)
    weight, bias = (rows(outputs, features, 11) / 16).to(dtype), rows(1, outputs, 12)[0].to(dtype)
    exact = F.linear(x.double(), weight.double(), bias.double())
    for got in (ops.linear_rows(x, weight, bias), ops.linear_rows(x, weight, None) + bias):
        assert got.dtype == dtype and got.shape == (count, outputs)
    got = ops.linear_rows(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact.float(), atol=1e-5, rtol=1e-5)
    else:
        # The float32 result rounded to bfloat16: within half a bfloat16 step of the exact.
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=2 ** -8)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-6, rtol=2 ** -7)
    # Rows with room between them (a view of every other row) read the same.
    spread = torch.zeros(2 * count, features, dtype=dtype)
    spread[::2] = x
    assert torch.equal(ops.linear_rows(spread[::2], weight, bias), got)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="the CPU has no AVX512-BF16: linear_rows is "
                    "built without its dot-product walk")
@pytest.mark.parametrize("count", [1, 3, 6, 8, 11, 16])
def test_bfloat16_dot_walk_agrees_with_f_linear_and_sums_each_output_alike(count: int) -> None:
    """AVX512-BF16's walk: within half a bfloat16 step of the exact product, each output
    summed in one order whatever the rows beside it (a verify step's logits are a plain
    step's to the bit)."""
    ops = kernels()
    x = rows(count, 128, 13).bfloat16()
    weight, bias = (rows(4099, 128, 14) / 16).bfloat16(), rows(1, 4099, 15)[0].bfloat16()
    got = ops.linear_rows(x, weight, bias, True)
    exact = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=2 ** -8)
    for m in range(count):
        assert torch.equal(ops.linear_rows(x[m:m + 1], weight, bias, True), got[m:m + 1])


def test_linear_rows_refuses_what_it_cannot_read() -> None:
    ops = kernels()
    weight = torch.ones(8, 16)
    with pytest.raises(RuntimeError, match=r"\[rows, K\]"):
        ops.linear_rows(torch.ones(0, 16), weight, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.linear_rows(torch.ones(1, 16, dtype=torch.float64), weight.double(), None)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.linear_rows(torch.ones(1, 16), weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_rows(torch.ones(1, 16), weight, torch.ones(7))
    with pytest.raises(RuntimeError, match="bf16_dot"):  # float32, or a CPU without the walk
        ops.linear_rows(torch.ones(1, 32), torch.ones(8, 32), None, True)


@pytest.mark.parametrize("bfloat16_instructions", [True, False])
def test_linear_takes_the_kernel_for_a_few_rows_only(monkeypatch: pytest.MonkeyPatch,
                                                     bfloat16_instructions: bool) -> None:
    """Float32: up to ``NATIVE_ROWS``. Bfloat16: up to ``BFLOAT16_NATIVE_ROWS`` on a CPU
    with bfloat16 instructions, any number of rows on one without."""
    ops = kernels()
    calls: list[tuple[torch.dtype, int]] = []
    kernel = ops.linear_rows
    monkeypatch.setattr(ops, "linear_rows", lambda x, *a: (calls.append((x.dtype, x.shape[0])),
                                                           kernel(x, *a))[1])
    monkeypatch.setattr(linear_kernel, "BFLOAT16_GEMM_IS_NATIVE", bfloat16_instructions)
    weight = rows(32, 64, 13)
    counts = (1, NATIVE_ROWS, NATIVE_ROWS + 1, BFLOAT16_NATIVE_ROWS, BFLOAT16_NATIVE_ROWS + 1)
    for count in counts:
        x = rows(count, 64, 14)
        torch.testing.assert_close(linear(x, weight, None, None, ops), F.linear(x, weight),
                                   atol=1e-4, rtol=1e-5)
        linear(x.bfloat16(), weight.bfloat16(), None, None, ops)
    assert linear(rows(2, 64, 15), weight, None, None).shape == (2, 32)  # not bound
    bfloat16 = counts[:-1] if bfloat16_instructions else counts
    expected = [(torch.float32, 1), (torch.float32, NATIVE_ROWS),
                *((torch.bfloat16, count) for count in bfloat16)]
    assert sorted(calls, key=str) == sorted(expected, key=str)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features", [128, 48])
def test_linear_rows_gives_each_row_what_it_gets_alone(dtype: torch.dtype,
                                                       features: int) -> None:
    """Bit for bit, whatever rows come with it: a verify step's products (several rows a
    request) equal a plain step's (one), so greedy speculation keeps the plain tokens."""
    ops = kernels()
    x, weight = rows(13, features, 17).to(dtype), (rows(37, features, 18) / 8).to(dtype)
    alone = torch.cat([ops.linear_rows(x[i:i + 1], weight, None) for i in range(13)])
    for count in (2, 3, 5, 6, 8, 13):
        assert torch.equal(ops.linear_rows(x[:count], weight, None), alone[:count]), count
