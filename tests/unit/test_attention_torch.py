"""The torch attention backends against a float64 softmax(QK^T)V reference.

Each case lays requests out in the paged pool the way the scheduler does
(shuffled KV slots, a cached prefix written beforehand, new tokens packed
back to back) and compares every output row with attention computed from the
unpaged tensors in float64, for plain layers and for layers with a sliding
window, a soft cap, or both. The backend is built once from an
``AttentionBackendArgs`` holding the pools and bound to the layer; batches
carry indices only. Every case runs on both the torch backend (SDPA) and the
CPU backend (its native kernel over the pool).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import framework.forward_batch
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.attention import kept_kv
from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs
from framework.layers.attention.cpu_native import CpuNativeAttnBackend
from framework.layers.attention.kept_kv import length_groups
from framework.layers.attention.radix_attention import RadixAttention, bind_attention_backend
from framework.layers.attention.torch_native import TorchNativeAttnBackend
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from tests.model_fixtures import single_threaded_torch

CPU = torch.device("cpu")
HEAD_DIM = 8
POOL_TOKENS = 256
CONTEXT_LEN = 64
BACKENDS = [TorchNativeAttnBackend, CpuNativeAttnBackend]



@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


def backend_args(
    req_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_heads: int, **changes: object
) -> AttentionBackendArgs:
    """The args ModelRunner would build for these pools (``changes`` override fields)."""
    args = AttentionBackendArgs(
        num_heads=num_heads,
        num_kv_heads=kv_pool.num_kv_heads,
        head_dim=kv_pool.head_dim,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        max_batch_size=req_pool.size,
        context_len=req_pool.max_context_len,
        dtype=kv_pool.dtype,
        device=CPU,
    )
    return dataclasses.replace(args, **changes) if changes else args


def small_pools(num_kv_heads: int = 1) -> tuple[ReqToTokenPool, MHATokenToKVPool]:
    return (
        ReqToTokenPool(size=2, max_context_len=CONTEXT_LEN, device=CPU),
        MHATokenToKVPool(16, torch.float32, num_kv_heads, HEAD_DIM, 2, CPU),
    )

#: A layer's (sliding_window, logit_cap).
Variant = tuple[int | None, float | None]
#: Windows shorter than the test sequences (8 to 20 tokens), a cap that bends typical
#: scores (about N(0, 1) here), and both.
VARIANTS: list[Variant] = [(4, None), (None, 0.7), (3, 0.7), (5, 0.7)]


def make_layer(num_heads: int, num_kv_heads: int, layer_id: int,
               variant: Variant | None = None) -> RadixAttention:
    """An attention layer of ``HEAD_DIM``, with the ``variant``'s window and cap."""
    window, cap = variant or (None, None)
    return RadixAttention(num_heads, HEAD_DIM, HEAD_DIM**-0.5, num_kv_heads, layer_id,
                          sliding_window=window, logit_cap=cap)


@dataclass
class RequestData:
    """One request's unpaged tensors: all of its keys/values and its new queries."""

    row: int
    prefix_len: int
    keys: torch.Tensor  # [seq_len, kv_heads, dim]
    values: torch.Tensor  # [seq_len, kv_heads, dim]
    queries: torch.Tensor  # [num_new, heads, dim]
    slots: torch.Tensor | None = None  # [seq_len]: the KV slot of each token

    @property
    def seq_len(self) -> int:
        return self.keys.shape[0]


def reference_attention(request: RequestData, scaling: float, window: int | None = None,
                        cap: float | None = None) -> torch.Tensor:
    """Causal float64 attention of the new queries over all keys: [num_new, heads, dim].

    ``window`` W: a query at position p sees only keys at ``p - W < j <= p``. ``cap`` c:
    each score s becomes ``c * tanh(s / c)`` before the softmax.
    """
    q = request.queries.double()
    heads, kv_heads = q.shape[1], request.keys.shape[1]
    k = request.keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = request.values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    query_pos = torch.arange(q.shape[0])[:, None] + request.prefix_len
    key_pos = torch.arange(request.seq_len)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def run_case(
    mode: ForwardMode,
    prefix_lens: list[int],
    new_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    *,
    save_kv_cache: bool = True,
    seed: int = 0,
    group_slack: int | None = None,
    backend_cls: type[AttentionBackend] = TorchNativeAttnBackend,
    query_rows: torch.Tensor | None = None,
    variant: Variant | None = None,
    decode_tail: int = 0,
    kv_cache_dtype: str = "auto",
) -> tuple[list[RequestData], torch.Tensor, MHATokenToKVPool, torch.Tensor]:
    """Lay the requests out in shuffled pool slots and run one layer of the backend.

    ``group_slack`` (the backend's, when given): small values split the batch into
    several length groups. ``query_rows``: the layer answers only those new tokens' queries.
    ``variant``: the layer's sliding window and soft cap. ``decode_tail``: the last
    requests (one new token each) decode in the step (a mixed step). ``kv_cache_dtype``:
    the pool's (``--kv-cache-dtype``).
    """
    generator = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(
        size=len(prefix_lens) + 2, max_context_len=CONTEXT_LEN, device=CPU
    )
    kv_pool = MHATokenToKVPool(POOL_TOKENS, torch.float32, num_kv_heads, HEAD_DIM, 2, CPU,
                               kv_cache_dtype)
    free_slots = (torch.randperm(POOL_TOKENS, generator=generator) + 1).tolist()
    rows = req_pool.alloc(len(prefix_lens))
    assert rows is not None
    layer = make_layer(num_heads, num_kv_heads, 1, variant)
    requests, new_slots = [], []
    for row, prefix_len, num_new in zip(rows, prefix_lens, new_lens, strict=True):
        seq_len = prefix_len + num_new
        shape = (seq_len, num_kv_heads, HEAD_DIM)
        request = RequestData(
            row,
            prefix_len,
            torch.randn(shape, generator=generator),
            torch.randn(shape, generator=generator),
            torch.randn((num_new, num_heads, HEAD_DIM), generator=generator),
        )
        slots = request.slots = torch.tensor([free_slots.pop() for _ in range(seq_len)])
        req_pool.req_to_token[row, :seq_len] = slots
        # The prefix is already cached; new tokens are written by the backend
        # unless save_kv_cache is off, in which case they must be there already.
        cached = seq_len if not save_kv_cache else prefix_len
        kv_pool.set_kv_buffer(1, slots[:cached], request.keys[:cached], request.values[:cached])
        requests.append(request)
        new_slots.append(slots[prefix_len:])
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(requests),
        input_ids=torch.zeros(sum(new_lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(r.prefix_len, r.seq_len) for r in requests]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([r.seq_len for r in requests]),
        out_cache_loc=torch.cat(new_slots),
        decode_tail=decode_tail,
    )
    if mode.is_extend():
        batch.extend_prefix_lens = torch.tensor(prefix_lens)
        batch.extend_seq_lens = torch.tensor(new_lens)
    backend = backend_cls(backend_args(req_pool, kv_pool, num_heads))
    if group_slack is not None:
        backend.group_slack = group_slack
    assert bind_attention_backend(layer, backend) == 1
    backend.init_forward_metadata(batch)
    q = torch.cat([r.queries for r in requests]).reshape(-1, num_heads * HEAD_DIM)
    k = torch.cat([r.keys[r.prefix_len :] for r in requests]).reshape(-1, num_kv_heads * HEAD_DIM)
    v = torch.cat([r.values[r.prefix_len :] for r in requests]).reshape(k.shape)
    output = layer(q, k, v, batch, save_kv_cache=save_kv_cache, rows=query_rows)
    return requests, output, kv_pool, torch.cat(new_slots)


def assert_matches_reference(
    requests: list[RequestData], output: torch.Tensor, num_heads: int,
    variant: Variant | None = None,
) -> None:
    assert output.dtype == torch.float32
    rows = output.view(-1, num_heads, HEAD_DIM)
    window, cap = variant or (None, None)
    start = 0
    for request in requests:
        num_new = request.queries.shape[0]
        expected = reference_attention(request, HEAD_DIM**-0.5, window, cap)
        torch.testing.assert_close(
            rows[start : start + num_new].double(), expected, atol=1e-5, rtol=1e-5
        )
        start += num_new
    assert start == output.shape[0]


def assert_new_keys_and_values_written(requests: list[RequestData], kv_pool: MHATokenToKVPool,
                                       new_slots: torch.Tensor) -> None:
    """Layer 1's buffers hold every request's new keys and values at their slots."""
    k_buffer, v_buffer = kv_pool.get_kv_buffer(1)
    torch.testing.assert_close(k_buffer[new_slots],
                               torch.cat([r.keys[r.prefix_len :] for r in requests]))
    torch.testing.assert_close(v_buffer[new_slots],
                               torch.cat([r.values[r.prefix_len :] for r in requests]))


HEAD_LAYOUTS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA


def test_length_groups_keep_padding_within_the_slack() -> None:
    lengths = [100, 3, 98, 40, 61, 7, 1000, 790, 760]
    groups = length_groups(lengths, slack=8)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert groups == [[6, 7, 8], [0, 2], [4], [3], [1, 5]]  # longest first, ids ascending
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert longest - min(lengths[i] for i in group) <= max(8, longest // 4)
    assert length_groups(lengths, slack=10_000) == [list(range(len(lengths)))]
    assert length_groups([], slack=8) == []


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 12)), min_size=1, max_size=6),
    group_slack=st.integers(1, 16),
    decode=st.booleans(),
    backend_cls=st.sampled_from(BACKENDS),
)
def test_any_grouping_of_any_batch_matches_the_reference(
        lengths: list[tuple[int, int]], group_slack: int, decode: bool,
        backend_cls: type[AttentionBackend]) -> None:
    prefix_lens = [prefix for prefix, _ in lengths]
    new_lens = [1] * len(lengths) if decode else [new for _, new in lengths]
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    requests, output, _, _ = run_case(mode, prefix_lens, new_lens, 4, 2,
                                      group_slack=group_slack, backend_cls=backend_cls)
    assert_matches_reference(requests, output, 4)


# None: one group for the whole batch; 1: a group per distinct length.
GROUP_SLACKS = [None, 1]


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_extend_over_cached_prefixes_with_mixed_lengths(
        num_heads: int, num_kv_heads: int, group_slack: int | None,
        backend_cls: type[AttentionBackend]) -> None:
    prefix_lens = [0, 5, 0, 17, 3]
    new_lens = [7, 1, 12, 4, 9]
    requests, output, _, _ = run_case(
        ForwardMode.EXTEND, prefix_lens, new_lens, num_heads, num_kv_heads,
        group_slack=group_slack, backend_cls=backend_cls,
    )
    assert output.shape == (sum(new_lens), num_heads * HEAD_DIM)
    assert_matches_reference(requests, output, num_heads)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_decode_with_mixed_lengths(num_heads: int, num_kv_heads: int,
                                   group_slack: int | None,
                                   backend_cls: type[AttentionBackend]) -> None:
    prefix_lens = [0, 1, 9, 30, 4]
    requests, output, _, _ = run_case(
        ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens), num_heads, num_kv_heads, seed=1,
        group_slack=group_slack, backend_cls=backend_cls,
    )
    assert_matches_reference(requests, output, num_heads)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_attention_for_some_rows_alone_matches_the_reference(
        mode: ForwardMode, num_heads: int, num_kv_heads: int,
        backend_cls: type[AttentionBackend]) -> None:
    prefix_lens = [0, 5, 0, 17, 3]
    new_lens = [7, 1, 12, 4, 9] if mode.is_extend() else [1] * 5
    ends = torch.tensor(new_lens).cumsum(0)
    # Each request's last token (what a last layer asks for), then some rows inside
    # prompts, out of order and one twice.
    rows = torch.cat([ends - 1, torch.tensor([0, 9, 2, 9])[: 4 if mode.is_extend() else 0]])
    requests, output, kv_pool, new_slots = run_case(
        mode, prefix_lens, new_lens, num_heads, num_kv_heads, seed=4, backend_cls=backend_cls,
        query_rows=rows)
    assert output.shape == (rows.shape[0], num_heads * HEAD_DIM)
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in requests])[rows]
    torch.testing.assert_close(output.view(-1, num_heads, HEAD_DIM).double(), expected,
                               atol=1e-5, rtol=1e-5)
    # Every new token's keys and values are cached, not only the answered rows'.
    assert_new_keys_and_values_written(requests, kv_pool, new_slots)


def test_attention_for_some_rows_always_saves_the_keys_and_values() -> None:
    with pytest.raises(ValueError, match="always saves"):
        run_case(ForwardMode.EXTEND, [3], [2], 4, 2, save_kv_cache=False,
                 query_rows=torch.tensor([1]))


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_backend_writes_new_keys_and_values_at_out_cache_loc(
        backend_cls: type[AttentionBackend]) -> None:
    requests, _, kv_pool, new_slots = run_case(ForwardMode.EXTEND, [2, 0], [3, 4], 4, 2, seed=2,
                                               backend_cls=backend_cls)
    assert_new_keys_and_values_written(requests, kv_pool, new_slots)
    assert not kv_pool.get_kv_buffer(0)[0].any(), "only the layer's own buffers are written"


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_without_saving_the_backend_reads_keys_already_in_the_pool(
        backend_cls: type[AttentionBackend]) -> None:
    requests, output, _, _ = run_case(
        ForwardMode.EXTEND, [3, 0], [5, 2], 4, 2, save_kv_cache=False, seed=3,
        backend_cls=backend_cls,
    )
    assert_matches_reference(requests, output, 4)


def test_extend_lengths_that_do_not_add_up_are_rejected() -> None:
    backend = TorchNativeAttnBackend(backend_args(*small_pools(), num_heads=2))
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=torch.arange(3),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([4]),
        out_cache_loc=torch.tensor([1, 2, 3]),
        extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([3]),
    )
    with pytest.raises(ValueError, match="seq_len"):
        backend.init_forward_metadata(batch)


def test_backend_keeps_the_args_it_was_built_with() -> None:
    req_pool, kv_pool = small_pools(num_kv_heads=2)
    args = backend_args(req_pool, kv_pool, num_heads=4, max_batch_size=3, context_len=32)
    backend = TorchNativeAttnBackend(args)
    assert backend.args is args
    assert backend.req_to_token_pool is req_pool and backend.token_to_kv_pool is kv_pool
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim) == (4, 2, HEAD_DIM)
    assert (backend.max_batch_size, backend.context_len) == (3, 32)
    assert backend.dtype == torch.float32 and backend.device == CPU


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 3}, "multiple of num_kv_heads"),
        ({"num_kv_heads": 0}, "must be > 0"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"context_len": CONTEXT_LEN + 1}, "req_to_token rows"),
        ({"head_dim": HEAD_DIM * 2}, "KV pool"),
    ],
)
def test_args_that_do_not_fit_the_pools_are_rejected(
    changes: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        backend_args(*small_pools(num_kv_heads=2), **{"num_heads": 4, **changes})


def test_a_batch_larger_than_max_batch_size_is_refused() -> None:
    backend = TorchNativeAttnBackend(backend_args(*small_pools(), num_heads=2, max_batch_size=1))
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        positions=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([1, 1]),
        out_cache_loc=torch.tensor([1, 2]),
    )
    with pytest.raises(ValueError, match="max_batch_size"):
        backend.init_forward_metadata(batch)


def test_a_layer_without_a_backend_says_how_to_bind_one() -> None:
    layer = RadixAttention(2, HEAD_DIM, HEAD_DIM**-0.5, 1, layer_id=0)
    q = torch.zeros(1, 2 * HEAD_DIM)
    k = v = torch.zeros(1, HEAD_DIM)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        input_ids=torch.zeros(1, dtype=torch.int64),
        positions=torch.zeros(1, dtype=torch.int64),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([1]),
        out_cache_loc=torch.tensor([1]),
    )
    with pytest.raises(RuntimeError, match="bind_attention_backend"):
        layer(q, k, v, batch)


def test_binding_walks_the_model_and_checks_each_layer_fits() -> None:
    backend = TorchNativeAttnBackend(backend_args(*small_pools(), num_heads=2))
    model = torch.nn.Sequential(
        RadixAttention(2, HEAD_DIM, 1.0, 1, layer_id=0),
        torch.nn.Sequential(torch.nn.Linear(2, 2), RadixAttention(2, HEAD_DIM, 1.0, 1, layer_id=1)),
    )
    assert bind_attention_backend(model, backend) == 2
    assert all(m.attn_backend is backend for m in model.modules() if isinstance(m, RadixAttention))
    assert bind_attention_backend(torch.nn.Linear(2, 2), backend) == 0
    with pytest.raises(ValueError, match="heads"):
        bind_attention_backend(RadixAttention(4, HEAD_DIM, 1.0, 1, layer_id=0), backend)
    with pytest.raises(ValueError, match="layer id 2"):
        bind_attention_backend(RadixAttention(2, HEAD_DIM, 1.0, 1, layer_id=2), backend)


# Packages above the vocabulary that forward_batch.py must not import from.
UPPER_PACKAGES = (
    "framework.layers",
    "framework.mem_cache",
    "framework.models",
    "framework.model_executor",
    "framework.runtime",
)


def test_forward_batch_imports_nothing_from_layers_or_the_kv_cache() -> None:
    """forward_batch is vocabulary at the bottom: importing upward would make a cycle."""
    source = Path(framework.forward_batch.__file__).read_text()
    imported: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    assert imported, "the AST walk found no imports at all"
    upward = [name for name in imported if name.startswith(UPPER_PACKAGES)]
    assert upward == [], f"forward_batch.py imports {upward}"
    field_names = {field.name for field in dataclasses.fields(ForwardBatch)}
    assert field_names.isdisjoint({"req_to_token_pool", "token_to_kv_pool", "attn_backend"})


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_consecutive_decode_steps_keep_matching_the_reference(
        num_heads: int, num_kv_heads: int, group_slack: int | None,
        backend_cls: type[AttentionBackend]) -> None:
    """Decode steps of an unchanged batch append to kept keys; a changed batch gathers anew."""
    _decode_steps(num_heads, num_kv_heads, group_slack, backend_cls)


def _decode_steps(num_heads: int, num_kv_heads: int, group_slack: int | None,
                  backend_cls: type[AttentionBackend], variant: Variant | None = None) -> None:
    """Seven decode steps of three requests with cached prefixes, one leaving after step 3."""
    generator = torch.Generator().manual_seed(7)
    req_pool = ReqToTokenPool(size=4, max_context_len=CONTEXT_LEN, device=CPU)
    kv_pool = MHATokenToKVPool(POOL_TOKENS, torch.float32, num_kv_heads, HEAD_DIM, 2, CPU)
    backend = backend_cls(backend_args(req_pool, kv_pool, num_heads))
    if group_slack is not None:
        backend.group_slack = group_slack
    layer = make_layer(num_heads, num_kv_heads, 0, variant)
    bind_attention_backend(layer, backend)
    free_slots = (torch.randperm(POOL_TOKENS, generator=generator) + 1).tolist()
    rows = req_pool.alloc(3)
    assert rows is not None
    kv_shape = (num_kv_heads, HEAD_DIM)
    history: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for row, prefix_len in zip(rows, [5, 1, 9], strict=True):  # a cached prefix each
        keys = [torch.randn(kv_shape, generator=generator) for _ in range(prefix_len)]
        values = [torch.randn(kv_shape, generator=generator) for _ in range(prefix_len)]
        slots = torch.tensor([free_slots.pop() for _ in range(prefix_len)])
        req_pool.req_to_token[row, :prefix_len] = slots
        kv_pool.set_kv_buffer(0, slots, torch.stack(keys), torch.stack(values))
        history[row] = (keys, values)
    for step in range(7):
        batch_rows = rows if step < 4 else rows[::2]  # a request leaves after step 3
        queries, new_keys, new_values, new_slots = [], [], [], []
        for row in batch_rows:
            keys, values = history[row]
            keys.append(torch.randn(kv_shape, generator=generator))
            values.append(torch.randn(kv_shape, generator=generator))
            slot = free_slots.pop()
            req_pool.req_to_token[row, len(keys) - 1] = slot
            new_slots.append(slot)
            new_keys.append(keys[-1])
            new_values.append(values[-1])
            queries.append(torch.randn((1, num_heads, HEAD_DIM), generator=generator))
        seq_lens = [len(history[row][0]) for row in batch_rows]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(batch_rows),
            input_ids=torch.zeros(len(batch_rows), dtype=torch.int64),
            positions=torch.tensor(seq_lens) - 1, req_pool_indices=torch.tensor(batch_rows),
            seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.tensor(new_slots),
        )
        backend.init_forward_metadata(batch)
        output = layer(torch.cat(queries).reshape(len(batch_rows), -1),
                       torch.stack(new_keys).reshape(len(batch_rows), -1),
                       torch.stack(new_values).reshape(len(batch_rows), -1), batch)
        requests = [RequestData(row, len(history[row][0]) - 1, torch.stack(history[row][0]),
                                torch.stack(history[row][1]), q)
                    for row, q in zip(batch_rows, queries, strict=True)]
        assert_matches_reference(requests, output, num_heads, variant)


_ROWS = 5  # request-pool rows the coming-and-going test uses
_step = st.one_of(
    st.tuples(st.just("decode"), st.permutations(range(_ROWS)), st.integers(1, _ROWS)),
    st.tuples(st.just("prefill"), st.integers(0, _ROWS - 1), st.integers(1, 9)),
    # A prefill of the first row of the permutation, the next ones decoding in its step.
    st.tuples(st.just("mixed"), st.permutations(range(_ROWS)), st.integers(1, _ROWS)),
)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=14), group_slack=st.sampled_from([1, 3, 64]),
       headroom=st.sampled_from([1, 2, 64]), backend_cls=st.sampled_from(BACKENDS))
# A row decoded at 4 tokens, then taken by a new request of 4 prompt tokens: its next
# decode step is one token longer than what was kept, yet nothing kept is its own.
@example(steps=[("prefill", 0, 3), ("decode", (0,), 1), ("prefill", 0, 4), ("decode", (0,), 1)],
         group_slack=64, headroom=64, backend_cls=TorchNativeAttnBackend)
def test_requests_coming_and_going_keep_matching_the_reference(
        steps: list[tuple[str, object, int]], group_slack: int, headroom: int,
        backend_cls: type[AttentionBackend]) -> None:
    """Random prefills (a pool row taken by a new request), decode batches of any subset
    and mixed steps (a prefill with decode tokens after it).

    Requests join and leave the decode batch, outgrow their group (small headroom) and
    have their pool row reused, and every output row still equals the reference.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kept_kv, "DECODE_HEADROOM", headroom)
        _come_and_go(steps, group_slack, backend_cls)


def _come_and_go(steps: list[tuple[str, object, int]], group_slack: int,
                 backend_cls: type[AttentionBackend],
                 variants: Sequence[Variant | None] = (None,)) -> None:
    """Run the steps through a layer per variant, all on the same batches."""
    generator = torch.Generator().manual_seed(len(steps))
    req_pool = ReqToTokenPool(size=_ROWS, max_context_len=CONTEXT_LEN, device=CPU)
    kv_pool = MHATokenToKVPool(1024, torch.float32, 2, HEAD_DIM, len(variants), CPU)
    backend = backend_cls(backend_args(req_pool, kv_pool, 4))
    backend.group_slack = group_slack
    layers = [make_layer(4, 2, i, variant) for i, variant in enumerate(variants)]
    bind_attention_backend(torch.nn.ModuleList(layers), backend)
    free_slots = (torch.randperm(1024, generator=generator) + 1).tolist()
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}

    def run(mode: ForwardMode, rows: list[int], num_new: list[int], decode_tail: int = 0
            ) -> None:
        queries, new_k, new_v, slots = [], [], [], []
        for row, n in zip(rows, num_new, strict=True):
            for _ in range(n):
                keys[row].append(torch.randn(2, HEAD_DIM, generator=generator))
                values[row].append(torch.randn(2, HEAD_DIM, generator=generator))
                slot = free_slots.pop()
                req_pool.req_to_token[row, len(keys[row]) - 1] = slot
                slots.append(slot)
            new_k += keys[row][-n:]
            new_v += values[row][-n:]
            queries.append(torch.randn((n, 4, HEAD_DIM), generator=generator))
        seq_lens = [len(keys[row]) for row in rows]
        batch = ForwardBatch(
            forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(len(slots)).long(),
            positions=torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, num_new)]),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
            out_cache_loc=torch.tensor(slots), decode_tail=decode_tail)
        if mode.is_extend():
            batch.extend_seq_lens = torch.tensor(num_new)
            batch.extend_prefix_lens = torch.tensor([s - n for s, n in zip(seq_lens, num_new)])
        backend.init_forward_metadata(batch)
        requests = [RequestData(row, len(keys[row]) - n, torch.stack(keys[row]),
                                torch.stack(values[row]), q)
                    for row, n, q in zip(rows, num_new, queries, strict=True)]
        for layer, variant in zip(layers, variants, strict=True):
            output = layer(torch.cat(queries).reshape(len(slots), -1),
                           torch.stack(new_k).reshape(len(slots), -1),
                           torch.stack(new_v).reshape(len(slots), -1), batch)
            assert_matches_reference(requests, output, 4, variant)

    for kind, which, count in steps:
        if kind == "prefill":  # a new request takes the row: its history starts over
            assert isinstance(which, int)
            keys[which], values[which] = [], []
            run(ForwardMode.EXTEND, [which], [count])
            continue
        assert isinstance(which, list | tuple)
        if kind == "mixed":
            first, *rest = which
            decoding = [row for row in rest if row in keys][:count]
            if any(len(keys[row]) >= CONTEXT_LEN for row in decoding):
                continue
            keys[first], values[first] = [], []
            run(ForwardMode.EXTEND, [first, *decoding], [count + 2] + [1] * len(decoding),
                decode_tail=len(decoding))
            continue
        rows = [row for row in which if row in keys][:count]
        if rows and max(len(keys[row]) for row in rows) < CONTEXT_LEN:
            run(ForwardMode.DECODE, rows, [1] * len(rows))


# ------------------------------------------------------------- sliding window, soft cap


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_windowed_and_capped_prefill_without_prefix(
        variant: Variant, group_slack: int | None, backend_cls: type[AttentionBackend]) -> None:
    # With a group per length, the 8-token prompt meets a window of 4, 5 and of its length.
    requests, output, _, _ = run_case(ForwardMode.EXTEND, [0, 0, 0], [8, 20, 13], 4, 2,
                                      group_slack=group_slack, backend_cls=backend_cls,
                                      variant=variant)
    assert_matches_reference(requests, output, 4, variant)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_windowed_and_capped_prefill_over_cached_prefixes(
        variant: Variant, group_slack: int | None, backend_cls: type[AttentionBackend]) -> None:
    # Prefixes longer and shorter than the window, new tokens packed into padded groups.
    requests, output, _, _ = run_case(ForwardMode.EXTEND, [5, 12, 2, 3], [8, 4, 9, 1], 6, 2,
                                      seed=5, group_slack=group_slack, backend_cls=backend_cls,
                                      variant=variant)
    assert_matches_reference(requests, output, 6, variant)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("group_slack", GROUP_SLACKS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_windowed_and_capped_decode_steps_with_kept_keys(
        variant: Variant, group_slack: int | None, backend_cls: type[AttentionBackend]) -> None:
    _decode_steps(4, 2, group_slack, backend_cls, variant)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_windowed_and_capped_mixed_step(variant: Variant,
                                        backend_cls: type[AttentionBackend]) -> None:
    # A fresh prompt, a prompt over a prefix, then two requests decoding in the same step.
    requests, output, _, _ = run_case(ForwardMode.EXTEND, [0, 6, 9, 14], [12, 7, 1, 1], 4, 2,
                                      seed=6, backend_cls=backend_cls, variant=variant,
                                      decode_tail=2)
    assert_matches_reference(requests, output, 4, variant)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_layers_of_different_windows_and_caps_share_each_batch(
        backend_cls: type[AttentionBackend]) -> None:
    """Prefills, decode steps and mixed steps in turn, each through a layer per variant
    (a plain one among them): a layer's masks and kept keys are its own window's."""
    steps: list[tuple[str, object, int]] = [
        ("prefill", 0, 9), ("prefill", 1, 6), ("decode", (0, 1), 2),
        ("mixed", (2, 0, 1), 2), ("decode", (0, 1, 2), 3),
        ("mixed", (3, 2, 0, 1), 3), ("decode", (3, 2, 0, 1), 4), ("decode", (1, 3), 2),
    ]
    _come_and_go(steps, 3, backend_cls, [(3, None), None, *VARIANTS])


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_a_window_changes_only_the_queries_it_cuts_off(
        mode: ForwardMode, backend_cls: type[AttentionBackend]) -> None:
    prefix_lens = [0, 6, 2] if mode.is_extend() else [2, 9, 3]
    new_lens = [12, 5, 1] if mode.is_extend() else [1, 1, 1]
    window = 4

    def output(variant: Variant | None) -> torch.Tensor:
        return run_case(mode, prefix_lens, new_lens, 4, 2, seed=8, backend_cls=backend_cls,
                        variant=variant)[1]

    plain, windowed = output(None), output((window, None))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    whole = positions < window  # these queries see every key within the window
    assert whole.any() and not whole.all()
    torch.testing.assert_close(windowed[whole], plain[whole])
    assert (windowed[~whole] - plain[~whole]).abs().amax(dim=-1).min() > 1e-3
    # A window as long as the longest request cuts nothing.
    longest = max(p + n for p, n in zip(prefix_lens, new_lens))
    torch.testing.assert_close(output((longest, None)), plain)


def test_every_padding_query_of_a_windowed_group_still_sees_a_key() -> None:
    """A fully masked row would make NaN (SDPA, softmax) even where the output is dropped."""
    backends: list[TorchNativeAttnBackend] = []

    class Recorded(TorchNativeAttnBackend):
        def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
            super().init_forward_metadata(forward_batch)
            backends.append(self)

    # One group: a decode-like request at position 9 padded to the other's 8 queries, whose
    # padding positions (10 to 16) lie past a window of 3 from every one of its 10 keys.
    run_case(ForwardMode.EXTEND, [9, 2], [1, 8], 4, 2, backend_cls=Recorded,
             variant=(3, None))
    groups = backends[0]._groups
    assert groups is not None and len(groups) == 1
    mask = groups[0].layer_mask(3)
    assert mask is not None and mask.any(dim=-1).all()


def held_by_pool(kv_pool: MHATokenToKVPool, requests: list[RequestData]
                 ) -> list[RequestData]:
    """``requests`` with the keys and values layer 1 of an 8-bit pool holds for them
    (rounded: each differs from the request's own, so a check on them can tell)."""
    held = []
    for request in requests:
        assert request.slots is not None
        keys, values = kv_pool.read_kv(1, request.slots)
        assert not torch.equal(keys, request.keys)
        held.append(dataclasses.replace(request, keys=keys, values=values))
    return held


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_a_quantized_pool_is_attended_as_it_holds_the_tokens(
        kv_cache_dtype: str, decode: bool, backend_cls: type[AttentionBackend]) -> None:
    """With 8-bit KV codes every query, the new tokens' own included, sees the keys and
    values the pool holds (rounded), exactly."""
    prefix_lens = [0, 5, 9]
    new_lens = [1, 1, 1] if decode else [7, 3, 1]
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    requests, output, kv_pool, _ = run_case(mode, prefix_lens, new_lens, 4, 2,
                                            backend_cls=backend_cls,
                                            kv_cache_dtype=kv_cache_dtype)
    assert kv_pool.get_kv_buffer(1)[0].itemsize == 1
    held = held_by_pool(kv_pool, requests)
    assert_matches_reference(held, output, 4)
