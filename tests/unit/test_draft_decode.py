"""The draft model's decode plan against its modules: the same logits bit for bit, the same
keys and values written, and no plan where the modules' forward is another."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from framework.config import ServerArgs
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.linear_kernel import NATIVE_ROWS, native_rows_fit
from framework.model_executor.model_runner import ModelRunner
from framework.speculative.draft_decode import DraftDecodePlan

PROMPTS = [[5, 9, 13, 2, 7, 1, 30], [8, 3, 3, 21, 4, 17, 6, 6, 11, 2, 40, 19]]


def _runner(path: Path, **args: object) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(path), device="cpu", max_total_tokens=256,
                                  **args), str(path))


def _batch(runner: ModelRunner, rows: list[int], starts: list[int], tokens: list[list[int]]
           ) -> ForwardBatch:
    """The modules' forward of ``tokens[i]`` at ``starts[i]...`` of row ``rows[i]``."""
    positions = [s + j for s, fed in zip(starts, tokens, strict=True) for j in range(len(fed))]
    token_rows = [r for r, fed in zip(rows, tokens, strict=True) for _ in fed]
    lengths = [len(fed) for fed in tokens]
    decode = all(n == 1 for n in lengths)
    table = runner.pools.req_to_token_pool.req_to_token
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=len(rows), input_ids=torch.tensor([t for fed in tokens for t in fed]),
        positions=torch.tensor(positions), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([s + n for s, n in zip(starts, lengths, strict=True)]),
        out_cache_loc=table[torch.tensor(token_rows), torch.tensor(positions)],
        extend_prefix_lens=None if decode else torch.tensor(starts),
        extend_seq_lens=None if decode else torch.tensor(lengths))


def _prefilled(runner: ModelRunner) -> list[int]:
    """Two requests' rows, their prompts in the cache and room for 8 more tokens each."""
    pools = runner.pools
    rows = pools.req_to_token_pool.alloc(len(PROMPTS))
    assert rows is not None
    for row, prompt in zip(rows, PROMPTS, strict=True):
        slots = pools.allocator.alloc(len(prompt) + 8)
        assert slots is not None
        pools.req_to_token_pool.req_to_token[row, :len(slots)] = slots
    runner.forward(_batch(runner, rows, [0, 0], PROMPTS))
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fed", [[[3], [12]], [[3, 25], [12]], [[3, 25], [12, 2]]])
def test_the_plan_gives_the_modules_logits_and_writes_their_keys_and_values(
        tiny_checkpoint: Callable[..., Path], dtype: str, fed: list[list[int]]) -> None:
    """A decode step, and steps where requests feed the tokens they owe the draft first."""
    runner = _runner(tiny_checkpoint("llama", seed=3, num_hidden_layers=2), dtype=dtype)
    plan = DraftDecodePlan.build(runner)
    assert plan is not None and plan.fits(sum(len(tokens) for tokens in fed))
    rows = _prefilled(runner)
    starts = [len(prompt) for prompt in PROMPTS]
    expected = runner.forward(_batch(runner, rows, starts, fed)).next_token_logits
    table = runner.pools.req_to_token_pool.req_to_token
    new_slots = torch.cat([table[row, start:start + len(tokens)]
                           for row, start, tokens in zip(rows, starts, fed, strict=True)])
    buffers = [buffer for layer in range(2)
               for buffer in runner.pools.token_to_kv_pool.get_kv_buffer(layer)]
    written = [buffer[new_slots].clone() for buffer in buffers]
    for buffer in buffers:  # the plan must write them again
        buffer[new_slots] = 0
    got = plan.logits(rows, starts, fed)
    assert expected is not None and got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert all(torch.equal(buffer[new_slots], before)
               for buffer, before in zip(buffers, written, strict=True))
    assert plan.greedy(rows, starts, fed) == expected.argmax(dim=-1).tolist()


@pytest.mark.parametrize(("arch", "args"), [("qwen2", {}), ("qwen3", {}),
                                            ("llama", {"kv_cache_dtype": "int8"}),
                                            ("llama", {"dtype": "float16"})])
def test_no_plan_where_the_modules_run_another_forward(
        tiny_checkpoint: Callable[..., Path], arch: str, args: dict[str, object]) -> None:
    """Biases (qwen2), q/k norms (qwen3), a quantized KV cache, no native kernels."""
    assert DraftDecodePlan.build(_runner(tiny_checkpoint(arch, seed=3), **args)) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_takes_the_forwards_whose_products_run_natively(
        tiny_checkpoint: Callable[..., Path], dtype: str) -> None:
    """A forward whose products would leave ``linear_rows`` (float32 beyond its rows) is the
    modules' to run: the plan gives no other product's results."""
    runner = _runner(tiny_checkpoint("llama", seed=3, num_hidden_layers=2), dtype=dtype)
    plan = DraftDecodePlan.build(runner)
    assert plan is not None
    weight = runner.model.lm_head.weight
    for count in (1, NATIVE_ROWS, NATIVE_ROWS + 1, 64):
        assert plan.fits(count) == native_rows_fit(count, weight)
    assert plan.fits(NATIVE_ROWS) and (dtype == "bfloat16" or not plan.fits(NATIVE_ROWS + 1))


def test_a_forward_past_the_request_row_is_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    """Tokens fed past the end of a request's row are refused with a reason, not written
    outside it."""
    runner = _runner(tiny_checkpoint("llama", seed=3, num_hidden_layers=2))
    plan = DraftDecodePlan.build(runner)
    assert plan is not None
    rows = _prefilled(runner)
    context = runner.pools.req_to_token_pool.req_to_token.shape[1]
    with pytest.raises(RuntimeError, match="feeds 2 tokens at"):
        plan.logits(rows[:1], [context - 1], [[3, 4]])
