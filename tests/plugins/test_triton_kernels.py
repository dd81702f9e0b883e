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
from framework_triton_attention.common import (
    LOG2E,
    cap_arg,
    check_head_dim,
    is_interpreter,
    window_arg,
)
from framework_triton_attention.decode import decode_attention
from framework_triton_attention.extend import extend_attention, extend_config
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


def run_decode(case: PagedCase, num_splits: int, sliding_window: int | None = None,
               logit_cap: float | None = None) -> torch.Tensor:
    """The decode kernels on a case whose new tokens (one per request) are in the pool."""
    seq_lens = [p + n for p, n in zip(case.prefix_lens, case.new_lens)]
    batch, num_heads, head_dim = case.q.shape
    out = nan_like(case.q)
    partial_out = torch.full((batch, num_heads, MAX_KV_SPLITS, head_dim), float("nan"),
                             device=DEVICE)
    partial_lse = torch.full((batch, num_heads, MAX_KV_SPLITS), float("nan"), device=DEVICE)
    decode_attention(case.q, case.k_buffer, case.v_buffer, out, case.indptr(seq_lens),
                     case.indices(seq_lens), partial_out, partial_lse, num_splits, case.scale,
                     sliding_window=sliding_window, logit_cap=logit_cap)
    return out


# (query heads, KV heads, head dim, split count). The interpreter runs every program in
# Python, so rather than every combination each layout meets both head dims, two split
# counts and (through the rotation of ``DTYPES``) two dtypes, and each split count two
# layouts. MAX_KV_SPLITS over a one-token request leaves most splits empty.
DECODE_CASES = [
    (2, 2, 16, MAX_KV_SPLITS),
    (2, 2, 64, 3),
    (8, 2, 64, 1),
    (8, 2, 16, 3),
    (8, 1, 16, 3),
    (8, 1, 64, MAX_KV_SPLITS),
]


def rotating_dtype(index: int) -> torch.dtype:
    """The dtype of the ``index``-th case of a list: every dtype in turn."""
    return DTYPES[index % len(DTYPES)]


@pytest.mark.parametrize("index", range(len(DECODE_CASES)))
def test_decode_matches_reference(index: int) -> None:
    num_heads, num_kv_heads, head_dim, num_splits = DECODE_CASES[index]
    dtype = rotating_dtype(index)
    seed = num_heads * 7 + num_kv_heads + head_dim
    prefix_lens = random_lens(seed, 3, 90, low=0)
    prefix_lens[0] = 0  # a request of one token: most of its splits are empty
    case = make_case(prefix_lens, [1] * 3, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
                     seed, write_new=True)
    error = relative_error(run_decode(case, num_splits), reference(case))
    assert error <= TOLERANCE[dtype], (DECODE_CASES[index], dtype, error)


@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_decode_head_dims(head_dim: int) -> None:
    case = make_case([37, 5], [1, 1], 4, 1, head_dim, torch.float32, DEVICE, head_dim,
                     write_new=True)
    assert relative_error(run_decode(case, 2), reference(case)) <= TOLERANCE[torch.float32]


def run_extend(case: PagedCase, has_prefix: bool = True, sliding_window: int | None = None,
               logit_cap: float | None = None) -> torch.Tensor:
    out = nan_like(case.q)
    extend_attention(case.q, case.k, case.v, out, case.k_buffer, case.v_buffer,
                     case.indptr(case.new_lens), case.indptr(case.prefix_lens),
                     case.indices(case.prefix_lens), max(case.new_lens), case.scale,
                     has_prefix=has_prefix, sliding_window=sliding_window,
                     logit_cap=logit_cap)
    return out


# (query heads, KV heads, head dim): each layout with both head dims, in turn over the
# dtypes; float32 at 16 and 64 takes extend_config's 32- and 16-wide tiles, float16 its
# 64-wide ones.
EXTEND_CASES = [(2, 2, 16), (2, 2, 64), (8, 2, 64), (8, 2, 16), (8, 1, 16), (8, 1, 64)]


@pytest.mark.parametrize("index", range(len(EXTEND_CASES)))
def test_extend_over_cached_prefix_matches_reference(index: int) -> None:
    num_heads, num_kv_heads, head_dim = EXTEND_CASES[index]
    dtype = rotating_dtype(index)
    seed = num_heads * 5 + num_kv_heads + head_dim
    prefix_lens = random_lens(seed, 4, 60, low=1)
    prefix_lens[1] = 0  # a request without a prefix in a batch with prefixes
    # A prefix of a key tile and part of the next, whatever the dtype's tile width.
    prefix_lens[0] = extend_config(head_dim, dtype)[1] + 5
    new_lens = random_lens(seed + 1, 4, 30)
    case = make_case(prefix_lens, new_lens, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
                     seed)
    error = relative_error(run_extend(case), reference(case))
    assert error <= TOLERANCE[dtype], (EXTEND_CASES[index], dtype, error)


@pytest.mark.parametrize("index", range(len(HEAD_LAYOUTS)))
def test_prefill_without_prefix_matches_reference(index: int) -> None:
    num_heads, num_kv_heads = HEAD_LAYOUTS[index]
    dtype = rotating_dtype(index + 1)  # so that the two 8-head layouts meet both dtypes
    new_lens = random_lens(num_heads + num_kv_heads, 3, 60)
    case = make_case([0] * 3, new_lens, num_heads, num_kv_heads, 32, dtype, DEVICE,
                     num_heads)
    ref = reference(case)
    for has_prefix in (False, True):  # the prefill specialization and the general kernel
        assert relative_error(run_extend(case, has_prefix), ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [128, 256])
def test_extend_head_dims(head_dim: int) -> None:
    case = make_case([20, 0], [9, 17], 4, 2, head_dim, torch.float32, DEVICE, head_dim)
    assert relative_error(run_extend(case), reference(case)) <= TOLERANCE[torch.float32]


def poison_before(case: PagedCase, firsts: list[int]) -> None:
    """NaN into the pool at each request's positions before ``firsts[b]``: reading one shows."""
    for slots, first in zip(case.slots, firsts):
        dead = slots[:max(first, 0)].to(DEVICE)
        case.k_buffer[dead] = float("nan")
        case.v_buffer[dead] = float("nan")


def assert_variant_matches(out: torch.Tensor, case: PagedCase, dtype: torch.dtype,
                           sliding_window: int | None, logit_cap: float | None) -> None:
    """``out`` is the reference with the window and cap, and far from the one without."""
    assert relative_error(out, reference(case, sliding_window, logit_cap)) <= TOLERANCE[dtype]
    # Without this the test would pass on kernels that ignore the variant.
    assert relative_error(out, reference(case)) > 0.05


# (sliding window, logit cap): a window of the token alone, a window shorter than most
# requests (across the prefix / new-token boundary and key tiles), both. The cap alone is
# test_large_scores_under_a_cap_stay_finite's.
@pytest.mark.parametrize(("window", "cap"), [(1, None), (7, None), (9, 0.7)])
def test_extend_window_and_cap_over_prefix_match_reference(window: int | None,
                                                           cap: float | None) -> None:
    # A request without a prefix, long prefixes, and one-token requests over a prefix (the
    # decode tokens of a mixed step).
    case = make_case([0, 45, 30, 9], [40, 1, 12, 1], 4, 2, 16, torch.float32, DEVICE, 11)
    assert_variant_matches(run_extend(case, sliding_window=window, logit_cap=cap), case,
                           torch.float32, window, cap)


def test_prefill_window_and_cap_match_reference() -> None:
    # Both variants at once: the prefill path has no branch of its own for either.
    window, cap = 5, 0.7
    case = make_case([0, 0], [45, 13], 4, 1, 32, torch.float16, DEVICE, 12)
    for has_prefix in (False, True):
        out = run_extend(case, has_prefix, sliding_window=window, logit_cap=cap)
        assert_variant_matches(out, case, torch.float16, window, cap)


def test_extend_window_skips_the_tiles_before_it() -> None:
    window = 5
    case = make_case([100, 64], [3, 30], 2, 2, 16, torch.float32, DEVICE, 13)
    block_n = extend_config(16, torch.float32)[1]
    # Keys a whole tile before the earliest window of each request are never read.
    poison_before(case, [p - window - block_n for p in case.prefix_lens])
    assert_variant_matches(run_extend(case, sliding_window=window), case, torch.float32,
                           window, None)


DECODE_VARIANTS = [(1, None), (None, 0.7), (20, 0.7)]


# Each (sliding window, logit cap) in one dtype, the dtypes in turn: the variants' code
# is the same in every dtype.
@pytest.mark.parametrize("index", range(len(DECODE_VARIANTS)))
def test_decode_window_and_cap_match_reference(index: int) -> None:
    window, cap = DECODE_VARIANTS[index]
    dtype = rotating_dtype(index)
    prefix_lens = [0, 70, 12]  # a single token, requests longer and shorter than windows
    case = make_case(prefix_lens, [1] * 3, 4, 1, 16, dtype, DEVICE, 14, write_new=True)
    if window is not None:
        # Decode splits the window's keys alone: every key before it may be garbage.
        poison_before(case, [p + 1 - window for p in prefix_lens])
    for num_splits in (1, 3, MAX_KV_SPLITS):
        out = run_decode(case, num_splits, sliding_window=window, logit_cap=cap)
        assert_variant_matches(out, case, dtype, window, cap)


# The interpreter's numpy warns where exp overflows; that overflow is what is tested.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_large_scores_under_a_cap_stay_finite() -> None:
    case = make_case([50], [6], 2, 2, 16, torch.float32, DEVICE, 15)
    case.q *= 200.0  # scores far past where exp overflows float32
    assert_variant_matches(run_extend(case, logit_cap=2.0), case, torch.float32, None, 2.0)


def test_variant_constexprs_mean_none_by_zero_and_refuse_the_rest() -> None:
    assert (window_arg(None), cap_arg(None)) == (0, 0.0)
    assert (window_arg(4096), cap_arg(30.0)) == (4096, 30.0 * LOG2E)  # base-2 scores
    with pytest.raises(ValueError, match="sliding_window must be > 0"):
        window_arg(0)
    with pytest.raises(ValueError, match="logit_cap must be > 0"):
        cap_arg(-1.0)


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
