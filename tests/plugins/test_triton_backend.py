"""The ``triton`` attention backend: through the interface, the registry and the Engine.

Without a GPU the kernels run in Triton's CPU interpreter (this folder's
conftest sets ``TRITON_INTERPRET=1`` before they are imported).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from framework_triton_attention.backend import (
    MAX_KV_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    TritonAttnBackend,
    choose_num_kv_splits,
    splits_within_window,
)
from framework_triton_attention.common import is_interpreter

from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.attention.base import AttentionBackendArgs
from framework.layers.attention.radix_attention import RadixAttention, bind_attention_backend
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from framework.registry import ATTENTION_BACKENDS
from tests.plugins.attention_cases import (
    TOLERANCE,
    PagedCase,
    make_case,
    reference,
    relative_error,
)
from tests.plugins.greedy_rule import assert_same_greedy, two_greedy_rounds

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cpu" if is_interpreter() else "cuda")
CONTEXT_LEN = 128
LAYER_ID = 1


def backend_args(case: PagedCase, dtype: torch.dtype, device: torch.device = DEVICE
                 ) -> tuple[AttentionBackendArgs, ReqToTokenPool, MHATokenToKVPool]:
    """Pools holding the case's layout (in layer 1) and the args ModelRunner would build."""
    num_heads, head_dim = case.q.shape[1], case.q.shape[2]
    num_kv_heads = case.k.shape[1]
    req_pool = ReqToTokenPool(size=len(case.slots) + 2, max_context_len=CONTEXT_LEN,
                              device=device)
    kv_pool = MHATokenToKVPool(case.k_buffer.shape[0] - 1, dtype, num_kv_heads, head_dim, 2,
                               device)
    kv_pool.k_buffers[LAYER_ID].copy_(case.k_buffer)
    kv_pool.v_buffers[LAYER_ID].copy_(case.v_buffer)
    args = AttentionBackendArgs(num_heads, num_kv_heads, head_dim, req_pool, kv_pool,
                                max_batch_size=req_pool.size, context_len=CONTEXT_LEN,
                                dtype=dtype, device=device)
    return args, req_pool, kv_pool


def run_layer(case: PagedCase, mode: ForwardMode, dtype: torch.dtype,
              save_kv_cache: bool = True, **variants: Any
              ) -> tuple[torch.Tensor, MHATokenToKVPool]:
    """One attention layer on the case through the backend, as a model step runs it.

    ``variants``: the layer's ``sliding_window`` / ``logit_cap``.
    """
    args, req_pool, kv_pool = backend_args(case, dtype)
    rows = req_pool.alloc(len(case.slots))
    assert rows is not None
    rows.reverse()  # request rows in another order than the batch's
    seq_lens = [p + n for p, n in zip(case.prefix_lens, case.new_lens)]
    for row, slots in zip(rows, case.slots):
        req_pool.req_to_token[row, :slots.shape[0]] = slots.to(DEVICE)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(sum(case.new_lens), dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(case.prefix_lens, seq_lens)]
                            ).to(DEVICE),
        req_pool_indices=torch.tensor(rows, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        out_cache_loc=case.new_slots.to(DEVICE),
    )
    if mode.is_extend():
        batch.extend_prefix_lens = torch.tensor(case.prefix_lens, device=DEVICE)
        batch.extend_seq_lens = torch.tensor(case.new_lens, device=DEVICE)
    num_heads, head_dim = case.q.shape[1], case.q.shape[2]
    layer = RadixAttention(num_heads, head_dim, case.scale, case.k.shape[1], LAYER_ID,
                           **variants)
    backend = ATTENTION_BACKENDS.get("triton")(args)
    assert isinstance(backend, TritonAttnBackend)
    assert bind_attention_backend(layer, backend) == 1
    backend.init_forward_metadata(batch)
    out = layer(case.q.reshape(case.q.shape[0], -1), case.k.reshape(case.k.shape[0], -1),
                case.v.reshape(case.v.shape[0], -1), batch, save_kv_cache=save_kv_cache)
    assert out.shape == (sum(case.new_lens), num_heads * head_dim)
    return out.view_as(case.q), kv_pool


# Each layout in one dtype, both dtypes met: the kernels' own tests cover the products.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dtype"),
                         [(4, 4, torch.float32), (8, 2, torch.float16), (8, 1, torch.float32)])
def test_extend_step_matches_reference_and_fills_the_pool(num_heads: int, num_kv_heads: int,
                                                          dtype: torch.dtype) -> None:
    case = make_case([0, 19, 3, 40], [7, 1, 12, 5], num_heads, num_kv_heads, 16, dtype,
                     DEVICE, num_heads + num_kv_heads)
    out, kv_pool = run_layer(case, ForwardMode.EXTEND, dtype)
    assert relative_error(out, reference(case)) <= TOLERANCE[dtype]
    k_buffer, v_buffer = kv_pool.get_kv_buffer(LAYER_ID)
    assert torch.equal(k_buffer[case.new_slots.to(DEVICE)], case.k)
    assert torch.equal(v_buffer[case.new_slots.to(DEVICE)], case.v)
    assert not kv_pool.get_kv_buffer(0)[0].any(), "only the layer's own buffers are written"


def test_prefill_step_without_prefixes_matches_reference() -> None:
    case = make_case([0, 0, 0], [9, 30, 2], 4, 2, 32, torch.float32, DEVICE, 5)
    out, _ = run_layer(case, ForwardMode.EXTEND, torch.float32)
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.float32]


# Each layout once, saving the new tokens' KV (store_kv) or finding them in the pool.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "save_kv_cache"),
                         [(4, 4, True), (8, 2, False), (8, 1, True)])
def test_decode_step_matches_reference(num_heads: int, num_kv_heads: int,
                                       save_kv_cache: bool) -> None:
    # Without saving, the new tokens must already be in the pool.
    case = make_case([0, 70, 9, 33, 120], [1] * 5, num_heads, num_kv_heads, 16,
                     torch.float32, DEVICE, num_heads * num_kv_heads,
                     write_new=not save_kv_cache)
    out, _ = run_layer(case, ForwardMode.DECODE, torch.float32, save_kv_cache)
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.float32]


def test_mixed_step_honours_the_layers_window_and_cap() -> None:
    # Prefills with and without a prefix next to one-token requests over long prefixes.
    case = make_case([0, 50, 6, 33], [20, 1, 9, 1], 4, 2, 16, torch.float32, DEVICE, 21)
    out, _ = run_layer(case, ForwardMode.EXTEND, torch.float32, sliding_window=8,
                       logit_cap=0.8)
    assert relative_error(out, reference(case, 8, 0.8)) <= TOLERANCE[torch.float32]
    assert relative_error(out, reference(case)) > 0.05, "the layer's variants were ignored"


def test_decode_step_honours_the_layers_window_and_cap() -> None:
    case = make_case([0, 70, 9, 40], [1] * 4, 4, 2, 16, torch.float32, DEVICE, 22)
    out, _ = run_layer(case, ForwardMode.DECODE, torch.float32, sliding_window=12,
                       logit_cap=0.8)
    assert relative_error(out, reference(case, 12, 0.8)) <= TOLERANCE[torch.float32]
    assert relative_error(out, reference(case)) > 0.05, "the layer's variants were ignored"


def test_a_window_bounds_the_split_count() -> None:
    assert splits_within_window(MAX_KV_SPLITS, None) == MAX_KV_SPLITS
    assert splits_within_window(MAX_KV_SPLITS, 4 * MIN_TOKENS_PER_SPLIT) == 4
    assert splits_within_window(MAX_KV_SPLITS, 4 * MIN_TOKENS_PER_SPLIT + 1) == 5
    assert splits_within_window(MAX_KV_SPLITS, 1) == 1
    assert splits_within_window(3, 100 * MIN_TOKENS_PER_SPLIT) == 3


def test_split_count_fills_the_device_within_bounds() -> None:
    assert choose_num_kv_splits(1, 8, 10, 132) == 1  # too short to split
    assert choose_num_kv_splits(256, 8, 32_768, 132) == 1  # the batch alone fills it
    assert choose_num_kv_splits(1, 8, 32_768, 132) == MAX_KV_SPLITS
    splits = choose_num_kv_splits(2, 8, 10 * MIN_TOKENS_PER_SPLIT, 132)
    assert 2 * 8 * splits >= 132 and splits <= 10


def test_extend_lengths_that_do_not_add_up_are_rejected() -> None:
    case = make_case([2], [3], 2, 2, 16, torch.float32, DEVICE, 0)
    args, _, _ = backend_args(case, torch.float32)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1,
        input_ids=torch.zeros(3, dtype=torch.int64), positions=torch.arange(3),
        req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([6]),
        out_cache_loc=torch.tensor([1, 2, 3]),
        extend_prefix_lens=torch.tensor([2]), extend_seq_lens=torch.tensor([3]),
    )
    with pytest.raises(ValueError, match=r"prefix \(2\) \+ new \(3\) tokens != seq_len \(6\)"):
        TritonAttnBackend(args).init_forward_metadata(batch)


def test_cpu_without_the_interpreter_is_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([2], [1], 2, 2, 16, torch.float32, torch.device("cpu"), 0)
    args, _, _ = backend_args(case, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device") as info:
        TritonAttnBackend(args)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not is_interpreter(), reason="only the interpreter lacks bfloat16")
def test_bfloat16_is_refused_under_the_interpreter() -> None:
    case = make_case([2], [1], 2, 2, 16, torch.float32, DEVICE, 0)
    args, _, _ = backend_args(case, torch.bfloat16)
    with pytest.raises(ValueError, match="float32, float16 under TRITON_INTERPRET=1"):
        TritonAttnBackend(args)


def test_framework_plugins_lists_triton_from_the_plugin_package() -> None:
    listing = subprocess.run([sys.executable, "-m", "framework.cli", "plugins"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=120).stdout
    line = next(line for line in listing.splitlines() if line.split()[:1] == ["triton"])
    assert "framework_triton_attention.backend:TritonAttnBackend" in line
    assert "entry point of framework-triton-attention" in line


def test_listing_and_importing_the_plugin_package_import_no_triton() -> None:
    code = ("import sys; import framework, framework.model_executor.model_runner; "
            "from framework.registry import ATTENTION_BACKENDS; "
            "names = ATTENTION_BACKENDS.names(); import framework_triton_attention; "
            "print('triton' in names, 'triton' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True, timeout=120)
    assert result.stdout.split() == ["True", "False"]


PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "def add(a, b):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def generate(model_dir: Path, backend: str) -> list[dict[str, Any]]:
    """Greedy outputs of two rounds: the prompts, then the prompts grown (a cached prefix)."""
    return two_greedy_rounds(model_dir, PROMPTS, GREEDY, attention_backend=backend,
                             device=DEVICE.type)


def test_tiny_model_gives_the_torch_backends_greedy_tokens(
        tiny_checkpoint: Callable[..., Path]) -> None:
    # One architecture: the backend sees only the attention layout (4 query heads, 2 KV
    # heads, head dim 16), which the tiny Llama and Qwen3 share.
    model_dir = tiny_checkpoint("llama", seed=5)
    for got, ref in zip(generate(model_dir, "triton"), generate(model_dir, "torch"),
                        strict=True):
        assert_same_greedy(got, ref)
