"""The native CPU attention kernel and its backend.

The kernel is checked against attention computed in float64 from the
unpaged keys and values, on head layouts and lengths the models use
(head_dim 64 and 128, grouped-query heads, a few to a few hundred tokens),
with each request's tokens scattered over the pool as the allocator leaves
them, for decode (one new token), prefill (every token new) and extend over
a cached prefix in one batch, plainly and with a layer's sliding window and
soft cap. The backend's own cases (mixed steps, requests
coming and going) run in test_attention_torch.py, which runs every case on
both backends.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.forward_batch import ForwardMode
from framework.layers.attention import cpu_native, native_build
from framework.layers.attention.cpu_native import CpuNativeAttnBackend
from framework.layers.attention.native_build import load_cpu_kernels
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from framework.model_executor.model_runner import resolve_attention_backend
from tests.unit.test_attention_torch import (
    HEAD_DIM,
    assert_matches_reference,
    backend_args,
    reference_attention,
    run_case,
)

#: Set (to 1) where a compiler is known to be there, as in CI: a missing one then fails.
REQUIRE_KERNELS_ENV = "FRAMEWORK_REQUIRE_NATIVE_KERNELS"


def kernels() -> Any:  # the kernels by name (load_cpu_kernels)
    if native_build.find_compiler() is None:
        reason = "no C++ compiler ($CXX or c++) to build the kernels with"
        if os.environ.get(REQUIRE_KERNELS_ENV) == "1":
            pytest.fail(f"{reason}, and {REQUIRE_KERNELS_ENV}=1 requires them")
        pytest.skip(reason)
    ops = load_cpu_kernels()
    assert ops is not None, "the native kernels did not build (see the warning logged)"
    return ops


def scattered_case(heads: int, kv_heads: int, dim: int, lens: list[int], news: list[int],
                   seed: int) -> tuple[torch.Tensor, ...]:
    """The kernel's arguments (but the scale), each token at a random slot of the pool.

    ``lens``: each request's tokens; ``news``: how many of them, the last ones, are new.
    """
    generator = torch.Generator().manual_seed(seed)
    total = sum(lens)
    k_buffer = torch.randn(total + 1, kv_heads, dim, generator=generator)
    v_buffer = torch.randn(total + 1, kv_heads, dim, generator=generator)
    slots = torch.randperm(total, generator=generator) + 1
    req_to_token = torch.zeros(len(lens) + 1, max(lens) + 3, dtype=torch.int64)
    start = 0
    for row, n in enumerate(lens, start=1):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    rows = torch.arange(1, len(lens) + 1)
    q = torch.randn(sum(news), heads, dim, generator=generator)
    return q, k_buffer, v_buffer, req_to_token, rows, torch.tensor(lens), torch.tensor(news)


def float64_request(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float, window: int = 0, cap: float = 0.0) -> torch.Tensor:
    """One request's attention in float64: its new tokens' queries [new, heads, dim] over
    all of its keys and values [n, kv_heads, dim], the queries being the last ``new`` tokens.

    Causal, and within the last ``window`` positions when given (0: none); each score
    ``s`` becomes ``cap * tanh(s / cap)`` when ``cap`` is given (0: none).
    """
    n, new = keys.shape[0], queries.shape[0]
    group = queries.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # [n, heads, dim]
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,nhd->hin", queries.double(), keys) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    position = torch.arange(n - new, n)[:, None]  # each new token's own position
    key = torch.arange(n)[None, :]
    hidden = key > position
    if window:
        hidden |= key <= position - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hin,nhd->ihd", scores.softmax(-1), values)


def float64_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                      req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                      news: torch.Tensor, scale: float, window: int = 0,
                      cap: float = 0.0) -> torch.Tensor:
    """Every new token's attention (``float64_request``) from the unpaged pool rows."""
    out = []
    first = 0
    for row, n, new in zip(rows.tolist(), lens.tolist(), news.tolist()):
        slots = req_to_token[row, :n]
        out.append(float64_request(q[first:first + new], k_buffer[slots], v_buffer[slots],
                                   scale, window, cap))
        first += new
    return torch.cat(out)


LENGTHS = [1, 2, 5, 17, 64, 131, 300, 7]
WORKLOADS = {
    "decode": [1] * len(LENGTHS),
    "prefill": LENGTHS,
    "extend": [1, 2, 3, 17, 9, 130, 1, 4],  # after a cached prefix, or all new
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 64), (8, 2, 128), (6, 1, 8), (32, 8, 128), (2, 2, 20)])
def test_kernel_matches_a_float64_reference(heads: int, kv_heads: int, dim: int,
                                            workload: str) -> None:
    case = scattered_case(heads, kv_heads, dim, LENGTHS, WORKLOADS[workload], seed=heads * dim)
    scale = dim**-0.5
    out = kernels().paged_attention(*case, scale)
    assert out.shape == case[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), float64_attention(*case, scale), atol=2e-6,
                               rtol=1e-5)


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 32), (8, 2, 128), (2, 2, 20)])
def test_bfloat16_pool_is_read_as_float32_and_the_output_rounded(
        heads: int, kv_heads: int, dim: int, workload: str) -> None:
    """A bfloat16 pool and queries: the float64 attention of those very values, rounded."""
    q, k_buffer, v_buffer, *indices = scattered_case(heads, kv_heads, dim, LENGTHS,
                                                     WORKLOADS[workload], seed=dim)
    q, k_buffer, v_buffer = (t.to(torch.bfloat16) for t in (q, k_buffer, v_buffer))
    scale = dim**-0.5
    out = kernels().paged_attention(q, k_buffer, v_buffer, *indices, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    exact = float64_attention(q, k_buffer, v_buffer, *indices, scale)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=2 ** -8)


#: Windows shorter than the requests (the longest makes the tiled path start a tile's
#: products past its first key tile), with decode tokens and prompts in one mixed step.
WINDOW_LENGTHS = [8, 13, 20, 1, 40]
WINDOW_WORKLOADS = {
    "decode": [1] * len(WINDOW_LENGTHS),
    "prefill": WINDOW_LENGTHS,
    "extend": [3, 5, 12, 1, 33],  # after a cached prefix
    "mixed": [1, 13, 1, 1, 40],
}
#: (window, cap), 0 for none.
VARIANTS = [(3, 0.0), (4, 2.0), (5, 0.0), (0, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "cap"), VARIANTS)
@pytest.mark.parametrize("workload", list(WINDOW_WORKLOADS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 64), (8, 2, 32), (6, 2, 8), (4, 1, 20)])
def test_window_and_cap_match_a_float64_reference(heads: int, kv_heads: int, dim: int,
                                                  workload: str, window: int, cap: float,
                                                  dtype: torch.dtype) -> None:
    q, k_buffer, v_buffer, *indices = scattered_case(
        heads, kv_heads, dim, WINDOW_LENGTHS, WINDOW_WORKLOADS[workload], seed=dim + window)
    q, k_buffer, v_buffer = (t.to(dtype) for t in (q, k_buffer, v_buffer))
    scale = dim**-0.5
    out = kernels().paged_attention(q, k_buffer, v_buffer, *indices, scale, window, cap)
    assert out.shape == q.shape and out.dtype == dtype
    exact = float64_attention(q, k_buffer, v_buffer, *indices, scale, window, cap)
    # bfloat16: the float64 attention of the very values in the pool, rounded
    atol, rtol = (2e-6, 1e-5) if dtype == torch.float32 else (1e-5, 2**-8)
    torch.testing.assert_close(out.double(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dim", [64, 20])  # the tiled path and the one-query path
def test_a_window_and_a_cap_change_the_output_and_a_long_window_does_not(dim: int) -> None:
    ops = kernels()
    case = scattered_case(4, 2, dim, [20, 9], [20, 1], seed=3)
    scale = dim**-0.5
    plain = ops.paged_attention(*case, scale)
    windowed = ops.paged_attention(*case, scale, 4, 0.0)
    change = (windowed - plain).abs().amax(dim=(1, 2))
    # The first four tokens see all they would anyway; every later one, the decode token
    # included, loses keys.
    assert change[:4].max() < 1e-6
    assert (change[4:] > 1e-3).all()
    assert (ops.paged_attention(*case, scale, 0, 2.0) - plain).abs().max() > 1e-3
    assert torch.equal(ops.paged_attention(*case, scale, 20, 0.0), plain)


@pytest.mark.parametrize("workload", ["decode", "extend", "mixed"])
@pytest.mark.parametrize("dim", [64, 20])
def test_keys_before_every_window_leave_no_trace_even_as_nan(workload: str, dim: int) -> None:
    """The pool rows of keys no new token's window reaches hold NaN: they must not count.

    Decode reads none of them; a tile of queries multiplies no weight (zero) with them.
    """
    q, k_buffer, v_buffer, table, rows, lens, news = scattered_case(
        4, 2, dim, WINDOW_LENGTHS, WINDOW_WORKLOADS[workload], seed=11)
    window, scale = 3, dim**-0.5
    exact = float64_attention(q, k_buffer, v_buffer, table, rows, lens, news, scale, window)
    for row, n, new in zip(rows.tolist(), lens.tolist(), news.tolist()):
        unseen = table[row, :max(0, n - new - window + 1)]
        k_buffer[unseen] = float("nan")
        v_buffer[unseen] = float("nan")
    out = kernels().paged_attention(q, k_buffer, v_buffer, table, rows, lens, news, scale,
                                    window, 0.0)
    torch.testing.assert_close(out.double(), exact, atol=2e-6, rtol=1e-5)


def test_a_negative_window_or_cap_is_refused() -> None:
    ops = kernels()
    case = scattered_case(4, 2, 16, [5, 9], [2, 1], seed=1)
    with pytest.raises(RuntimeError, match="window and cap must be >= 0"):
        ops.paged_attention(*case, 1.0, -1, 0.0)
    with pytest.raises(RuntimeError, match="window and cap must be >= 0"):
        ops.paged_attention(*case, 1.0, 0, -2.0)


def test_large_scores_do_not_overflow_the_softmax() -> None:
    q, *rest = scattered_case(4, 2, 64, [40, 3], [40, 1], seed=5)
    q = q * 60  # scores past 100: exp() of them unshifted would overflow float32
    out = kernels().paged_attention(q, *rest, 0.125)
    assert torch.isfinite(out).all()
    # float32 scores of that size carry errors of about 1e-5 into the exponent
    torch.testing.assert_close(out.double(), float64_attention(q, *rest, 0.125), atol=1e-4,
                               rtol=1e-4)


def test_bad_inputs_are_refused_with_a_reason() -> None:
    ops = kernels()
    q, k_buffer, v_buffer, table, rows, lens, news = scattered_case(4, 2, 16, [5, 9], [2, 1],
                                                                     seed=1)
    pool = (k_buffer, v_buffer, table)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.paged_attention(q.double(), *pool, rows, lens, news, 1.0)
    with pytest.raises(RuntimeError, match="KV buffers alike"):
        ops.paged_attention(q.bfloat16(), *pool, rows, lens, news, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(q, *pool, rows, lens, news * 0, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(q, *pool, rows + 5, lens, news, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(q, *pool, rows, lens, lens + 1, 1.0)
    with pytest.raises(RuntimeError, match="query rows"):
        ops.paged_attention(q[:2], *pool, rows, lens, news, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        ops.paged_attention(q[:, :3].contiguous(), *pool, rows, lens, news, 1.0)


def test_the_backend_runs_the_kernel_in_float32_and_bfloat16_on_cpu_and_keeps_no_copies(
        ) -> None:
    kernels()
    req_pool = ReqToTokenPool(size=2, max_context_len=16, device=torch.device("cpu"))
    for dtype, native in ((torch.float32, True), (torch.bfloat16, True),
                          (torch.float16, False)):
        kv_pool = MHATokenToKVPool(16, dtype, 2, 8, 1, torch.device("cpu"))
        backend = CpuNativeAttnBackend(backend_args(req_pool, kv_pool, 4, dtype=dtype))
        assert backend.native is native
    assert CpuNativeAttnBackend.extra_kv_copies == 0.0


class CountingKernels:
    """The kernels, with the query rows of each attention call recorded."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.query_rows: list[int] = []

    def paged_attention(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
        self.query_rows.append(q.shape[0])
        return self.ops.paged_attention(q, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)


@pytest.mark.parametrize(("extra_rows", "kernel_rows"), [(2, 5 + 2), (24, 41)])
def test_a_few_rows_run_alone_and_many_run_as_the_whole_batch(
        monkeypatch: pytest.MonkeyPatch, extra_rows: int, kernel_rows: int) -> None:
    """Each request's last row and a few more: one query each. Prompt logprobs over most
    of the prompts: the whole batch's call (41 new tokens here, one request with more than
    ``DECODE_WALK_TOKENS``), its rows kept."""
    counting = CountingKernels(kernels())
    monkeypatch.setattr(cpu_native, "load_cpu_kernels", lambda: counting)
    prefix_lens, new_lens = [0, 5, 0, 17, 3], [7, 1, 20, 4, 9]
    assert max(new_lens) > cpu_native.DECODE_WALK_TOKENS
    last = torch.tensor(new_lens).cumsum(0) - 1
    inside = torch.tensor([r for r in range(sum(new_lens)) if r not in last.tolist()])
    rows = torch.cat([last, inside[torch.randperm(len(inside))[:extra_rows]]])
    requests, output, _, _ = run_case(ForwardMode.EXTEND, prefix_lens, new_lens, 4, 2,
                                      seed=5, backend_cls=CpuNativeAttnBackend,
                                      query_rows=rows)
    assert counting.query_rows == [kernel_rows]
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in requests])[rows]
    torch.testing.assert_close(output.view(-1, 4, HEAD_DIM).double(), expected,
                               atol=1e-5, rtol=1e-5)


#: The backend's layer: a window shorter than most requests, and a cap.
LAYER_VARIANT = (4, 2.0)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_the_backend_gives_the_kernel_the_layer_s_window_and_cap(mode: ForwardMode) -> None:
    """A decode step, and a mixed step: prompts, prompts after a prefix, decode tokens."""
    prefix_lens = [0, 5, 17, 9, 12] if mode.is_extend() else [9, 2, 5, 17, 12]
    new_lens = [7, 6, 4, 1, 1] if mode.is_extend() else [1] * 5
    requests, output, _, _ = run_case(mode, prefix_lens, new_lens, 4, 2, seed=2,
                                      backend_cls=CpuNativeAttnBackend, variant=LAYER_VARIANT,
                                      decode_tail=2 if mode.is_extend() else 0)
    assert_matches_reference(requests, output, 4, LAYER_VARIANT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_new_tokens_attend_as_the_decode_tokens_they_would_be(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Requests of up to ``DECODE_WALK_TOKENS`` new tokens (a verify step's): each token is
    one query of its own, bit for bit what a decode step at its position gives (the
    kernel's decode walk sums in another order than its extend path)."""
    counting = CountingKernels(kernels())
    monkeypatch.setattr(cpu_native, "load_cpu_kernels", lambda: counting)
    scale, prefixes, news = HEAD_DIM**-0.5, [63, 30, 0], [4, 6, cpu_native.DECODE_WALK_TOKENS]
    q, k_buffer, v_buffer, table, rows, lens, new = scattered_case(4, 2, HEAD_DIM, [
        p + n for p, n in zip(prefixes, news, strict=True)], news, seed=9)
    q, k_buffer, v_buffer = q.to(dtype), k_buffer.to(dtype), v_buffer.to(dtype)
    backend_rows, visible, ones = cpu_native._as_decode_tokens(rows.tolist(), lens.tolist(),
                                                               new.tolist(), q.device)
    assert ones.tolist() == [1] * sum(news)
    assert visible.tolist() == [p + i + 1 for p, n in zip(prefixes, news, strict=True)
                                for i in range(n)]
    batch = counting.paged_attention(q, k_buffer, v_buffer, table, backend_rows, visible,
                                     ones, scale)
    token = 0
    for row, prefix, count in zip(rows.tolist(), prefixes, news, strict=True):
        for i in range(count):
            alone = counting.paged_attention(
                q[token:token + 1].contiguous(), k_buffer, v_buffer, table,
                torch.tensor([row]), torch.tensor([prefix + i + 1]), torch.tensor([1]), scale)
            assert torch.equal(batch[token], alone[0]), (prefix, i)
            token += 1


def test_the_backend_runs_a_verify_step_s_tokens_as_decode_tokens() -> None:
    """A step of a few new tokens a request: the layer's output is, bit for bit, the
    kernel's for each token alone as a decode token."""
    prefix_lens, new_lens = [40, 20, 5], [4, 6, 1]
    requests, output, kv_pool, _ = run_case(ForwardMode.EXTEND, prefix_lens, new_lens, 4, 2,
                                             seed=11, backend_cls=CpuNativeAttnBackend)
    k_buffer, v_buffer = kv_pool.get_kv_buffer(1)
    table = torch.zeros(len(requests), max(r.seq_len for r in requests), dtype=torch.int64)
    for i, request in enumerate(requests):
        assert request.slots is not None
        table[i, :request.seq_len] = request.slots
    rows = output.view(-1, 4, HEAD_DIM)
    token = 0
    for i, request in enumerate(requests):
        for j in range(request.queries.shape[0]):
            alone = kernels().paged_attention(
                request.queries[j:j + 1].contiguous(), k_buffer, v_buffer, table,
                torch.tensor([i]), torch.tensor([request.prefix_len + j + 1]),
                torch.tensor([1]), HEAD_DIM**-0.5)
            assert torch.equal(rows[token], alone[0]), (i, j)
            token += 1


def test_rows_alone_see_the_window_ending_at_their_own_position(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingKernels(kernels())
    monkeypatch.setattr(cpu_native, "load_cpu_kernels", lambda: counting)
    prefix_lens, new_lens = [0, 5, 0, 17, 3], [7, 1, 12, 4, 9]
    rows = torch.tensor([6, 7, 19, 23, 32, 2, 28])  # each request's last row, and two more
    requests, output, _, _ = run_case(ForwardMode.EXTEND, prefix_lens, new_lens, 4, 2,
                                      seed=5, backend_cls=CpuNativeAttnBackend,
                                      query_rows=rows, variant=LAYER_VARIANT)
    assert counting.query_rows == [len(rows)]  # one query a row, not the whole batch
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5, *LAYER_VARIANT)
                          for r in requests])[rows]
    torch.testing.assert_close(output.view(-1, 4, HEAD_DIM).double(), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_without_the_kernels_the_torch_backend_does_the_work(
        monkeypatch: pytest.MonkeyPatch, mode: ForwardMode) -> None:
    monkeypatch.setattr(cpu_native, "load_cpu_kernels", lambda: None)
    new_lens = [1, 1, 1] if mode.is_decode() else [3, 1, 5]
    requests, output, _, _ = run_case(mode, [0, 6, 20], new_lens, 4, 2,
                                      backend_cls=CpuNativeAttnBackend)
    assert_matches_reference(requests, output, 4)


def test_a_failed_build_says_why_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        native_build.build("false")  # a "compiler" that always fails
    # No library, no object file: only the (empty) file builds take turns on.
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]


def test_builds_at_the_same_time_compile_once(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    compiles: list[Path] = []
    locks: list[int] = []
    second_waits = threading.Event()
    real_flock = fcntl.flock

    def flock(file: Any, operation: int) -> None:
        locks.append(operation)
        if len(locks) == 2:
            second_waits.set()  # the second build is about to wait for the first's lock
        real_flock(file, operation)

    def slow_build(compiler: str, target: Path) -> None:
        compiles.append(target)
        second_waits.wait(10)  # the other build asks while this one compiles
        target.write_bytes(b"library")

    monkeypatch.setattr(native_build, "_build_into", slow_build)
    monkeypatch.setattr(native_build.fcntl, "flock", flock)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each open file locks apart
        builds = [pool.submit(native_build.build, "c++") for _ in range(2)]
        paths = {build.result(30) for build in builds}
    assert paths == {native_build.library_path("c++")}
    assert len(compiles) == 1


def test_a_build_is_kept_per_machine_and_reused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    kernels()  # built into the default cache
    compiler = native_build.find_compiler()
    assert compiler is not None
    built = native_build.library_path(compiler)
    assert built.exists()
    stamp = built.stat().st_mtime_ns
    assert native_build.build(compiler) == built
    assert built.stat().st_mtime_ns == stamp, "a cached build is not compiled again"
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    assert native_build.library_path("c++").parent == tmp_path


def test_loading_the_kernels_leaves_the_process_s_float_mode_alone() -> None:
    # Linked with -ffast-math, the library would bring crtfastmath.o, whose constructor sets
    # flush-to-zero and denormals-are-zero for the whole process: a denormal would then
    # read as 0 in every later torch (and numpy) computation. The mode cannot be undone in
    # a process, so a fresh one loads the kernels.
    code = ("import torch\n"
            "from framework.layers.attention.native_build import load_cpu_kernels\n"
            "assert load_cpu_kernels() is not None\n"
            "tiny = torch.tensor([1e-40])\n"
            "print((tiny * 1.0).item() > 0, (tiny + 0.0).item() > 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


def test_auto_picks_the_cpu_backend_for_float32_and_bfloat16_on_a_cpu_and_torch_elsewhere(
        ) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attention_backend("auto", cpu, torch.float32) == "cpu"
    assert resolve_attention_backend("auto", cpu, torch.bfloat16) == "cpu"
    assert resolve_attention_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_attention_backend("auto", cuda, torch.float32) == "torch"
    assert resolve_attention_backend("torch", cpu, torch.float32) == "torch"
    assert resolve_attention_backend("triton", cuda, torch.float16) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_each_new_token_s_row_at_its_slot(dtype: torch.dtype) -> None:
    ops = kernels()
    k_buffer, v_buffer = torch.zeros(10, 2, 4, dtype=dtype), torch.zeros(10, 2, 4, dtype=dtype)
    qkv = torch.randn(3, 24).to(dtype)  # keys and values as column slices of one projection
    k, v = qkv[:, 8:16], qkv[:, 16:]
    loc = torch.tensor([7, 0, 3])
    ops.write_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer[loc], k.reshape(3, 2, 4))
    assert torch.equal(v_buffer[loc], v.reshape(3, 2, 4))
    untouched = [i for i in range(10) if i not in (7, 0, 3)]
    assert not k_buffer[untouched].any() and not v_buffer[untouched].any()
    with pytest.raises(RuntimeError, match="alike"):
        ops.write_kv(k_buffer, v_buffer, loc, k.double(), v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.write_kv(k_buffer, v_buffer, torch.tensor([10, 1, 2]), k, v)
    with pytest.raises(RuntimeError, match=r"\[3, 8\]"):
        ops.write_kv(k_buffer, v_buffer, loc, k[:, :4], v)
