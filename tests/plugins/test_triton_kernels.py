"""The Triton kernels against a float64 reference, on random paged layouts.

Without a GPU they run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
by this folder's conftest before the kernels are imported), so shapes stay
small. Every output and scratch buffer is filled with NaN before a run, and
every pool slot no request owns holds NaN, so a row the kernel forgets or a
slot it should not read shows up as a NaN error. Lengths are random and not
multiples of the kernels' tiles, so masked tails are exercised.
"""

from __future__ import annotations

import random

import pytest
import torch
from framework_triton_attention.backend import MAX_KV_SPLITS
from framework_triton_attention.common import check_head_dim, is_interpreter
from framework_triton_attention.decode import decode_attention
from framework_triton_attention.extend import extend_attention
from framework_triton_attention.kv_store import store_kv

from tests.plugins.attention_cases import (
    TOLERANCE,
    PagedCase,
    make_case,
    reference,
    relative_error,
)

DEVICE = torch.device("cpu" if is_interpreter() else "cuda")
# (query heads, KV heads): grouped-query ratios 1, 4 and 8.
HEAD_LAYOUTS = [(2, 2), (8, 2), (8, 1)]
# bfloat16 only where the kernels compile: the interpreter has no bfloat16 arithmetic.
DTYPES = [torch.float32, torch.float16] + ([] if is_interpreter() else [torch.bfloat16])


def random_lens(seed: int, batch: int, longest: int, low: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, longest) for _ in range(batch)]


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def run_decode(case: PagedCase, num_splits: int) -> torch.Tensor:
    """The decode kernels on a case whose new tokens (one per request) are in the pool."""
    seq_lens = [p + n for p, n in zip(case.prefix_lens, case.new_lens)]
    batch, num_heads, head_dim = case.q.shape
    out = nan_like(case.q)
    partial_out = torch.full((batch, num_heads, MAX_KV_SPLITS, head_dim), float("nan"),
                             device=DEVICE)
    partial_lse = torch.full((batch, num_heads, MAX_KV_SPLITS), float("nan"), device=DEVICE)
    decode_attention(case.q, case.k_buffer, case.v_buffer, out, case.indptr(seq_lens),
                     case.indices(seq_lens), partial_out, partial_lse, num_splits, case.scale)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_matches_reference(heads: tuple[int, int], head_dim: int,
                                  dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    seed = num_heads * 7 + num_kv_heads + head_dim
    prefix_lens = random_lens(seed, 5, 90, low=0)
    prefix_lens[0] = 0  # a request of one token: most of its splits are empty
    case = make_case(prefix_lens, [1] * 5, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
                     seed, write_new=True)
    ref = reference(case)
    for num_splits in (1, 3, MAX_KV_SPLITS):
        error = relative_error(run_decode(case, num_splits), ref)
        assert error <= TOLERANCE[dtype], (num_splits, error)


@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_decode_head_dims(head_dim: int) -> None:
    case = make_case([37, 5], [1, 1], 4, 1, head_dim, torch.float32, DEVICE, head_dim,
                     write_new=True)
    assert relative_error(run_decode(case, 2), reference(case)) <= TOLERANCE[torch.float32]


def run_extend(case: PagedCase, has_prefix: bool = True) -> torch.Tensor:
    out = nan_like(case.q)
    extend_attention(case.q, case.k, case.v, out, case.k_buffer, case.v_buffer,
                     case.indptr(case.new_lens), case.indptr(case.prefix_lens),
                     case.indices(case.prefix_lens), max(case.new_lens), case.scale,
                     has_prefix=has_prefix)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_extend_over_cached_prefix_matches_reference(heads: tuple[int, int], head_dim: int,
                                                     dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    seed = num_heads * 5 + num_kv_heads + head_dim
    prefix_lens = random_lens(seed, 4, 70, low=1)
    prefix_lens[1] = 0  # a request without a prefix in a batch with prefixes
    new_lens = random_lens(seed + 1, 4, 40)
    case = make_case(prefix_lens, new_lens, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
                     seed)
    assert relative_error(run_extend(case), reference(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_prefill_without_prefix_matches_reference(heads: tuple[int, int],
                                                  dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    new_lens = random_lens(num_heads + num_kv_heads, 3, 80)
    case = make_case([0] * 3, new_lens, num_heads, num_kv_heads, 32, dtype, DEVICE,
                     num_heads)
    ref = reference(case)
    for has_prefix in (False, True):  # the prefill specialization and the general kernel
        assert relative_error(run_extend(case, has_prefix), ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [128, 256])
def test_extend_head_dims(head_dim: int) -> None:
    case = make_case([20, 0], [9, 17], 4, 2, head_dim, torch.float32, DEVICE, head_dim)
    assert relative_error(run_extend(case), reference(case)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_new_slots(dtype: torch.dtype) -> None:
    case = make_case([3, 0, 11], [5, 2, 1], 4, 2, 16, dtype, DEVICE, 3)
    expected_k, expected_v = case.k_buffer.clone(), case.v_buffer.clone()
    loc = case.new_slots.to(DEVICE)
    expected_k[loc] = case.k
    expected_v[loc] = case.v
    store_kv(case.k, case.v, loc, case.k_buffer, case.v_buffer)
    # equal_nan: slots nobody owns must keep their NaN.
    assert torch.allclose(case.k_buffer, expected_k, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(case.v_buffer, expected_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("head_dim", [8, 48, 512])
def test_unsupported_head_dims_are_refused(head_dim: int) -> None:
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        check_head_dim(head_dim)
