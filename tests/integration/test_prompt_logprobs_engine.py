"""Prompt logprobs through the Engine equal transformers' log-softmax of the same prompt.

Checked with the prompt prefilled whole and in chunks of 8, and when part of the
prompt is found in the prefix cache.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from framework import Engine
from tests.model_fixtures import TINY_VOCAB_SIZE, make_tiny_checkpoint

ATOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=11)


@pytest.fixture(scope="module")
def reference_model(llama_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64)
    return model.eval()


@pytest.fixture(scope="module", params=[8, 4096], ids=["chunked", "whole"])
def engine(request: pytest.FixtureRequest, llama_dir: Path) -> Iterator[Engine]:
    # Threads of this process: what is computed does not depend on the launch, which the
    # server tests cover as processes.
    with Engine(model_path=str(llama_dir), chunked_prefill_size=request.param,
                launch_mode="thread") as eng:
        yield eng


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)]


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: row ``p - 1`` is the distribution of position ``p``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(meta: dict[str, Any], model: Any, ids: list[int], start: int) -> None:
    """``input_token_logprobs`` / ``input_top_logprobs`` from ``start`` against the reference."""
    ref = reference_logprobs(model, ids)
    entries = meta["input_token_logprobs"]
    tops = meta["input_top_logprobs"]
    assert [t for _, t, _ in entries] == ids[start:]
    assert len(tops) == len(ids) - start
    if start == 0:
        assert entries[0][0] is None and tops[0] is None  # nothing comes before the first token
    for (value, token, _), top, position in zip(entries, tops, range(start, len(ids))):
        if position == 0:
            continue
        row = ref[position - 1]
        assert value == pytest.approx(float(row[token]), abs=ATOL), position
        want_vals, want_ids = row.topk(TOP)
        assert [t for _, t, _ in top] == want_ids.tolist(), position
        assert np.allclose([v for v, _, _ in top], want_vals.numpy(), atol=ATOL, rtol=0)


def test_prompt_logprobs_match_transformers(engine: Engine, reference_model: Any) -> None:
    prompts = [random_prompt(seed, length) for seed, length in ((1, 37), (2, 9), (3, 20))]
    outputs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    for ids, out in zip(prompts, outputs):
        assert out["output_ids"] == []
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        check(out["meta_info"], reference_model, ids, 0)
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_prompt_logprobs_after_a_prefix_cache_hit(engine: Engine, reference_model: Any) -> None:
    shared = random_prompt(4, 24)
    engine.generate(input_ids=[*shared, 7], sampling_params={"max_new_tokens": 1})
    ids = [*shared, *random_prompt(5, 10)]
    params = {"max_new_tokens": 2, "temperature": 0.0}
    hit = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                          top_logprobs_num=TOP, logprob_start_len=12)
    # Position 12 needs the logits at 11: the first 11 tokens come from the cache.
    assert hit["meta_info"]["cached_tokens"] == 11
    check(hit["meta_info"], reference_model, ids, 12)
    again = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                            top_logprobs_num=TOP, logprob_start_len=0)
    assert again["meta_info"]["cached_tokens"] == 0
    check(again["meta_info"], reference_model, ids, 0)
    assert again["output_ids"] == hit["output_ids"]
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_a_start_at_or_past_the_prompt_end_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=[5, 6, 7], return_logprob=True, logprob_start_len=3)
    with pytest.raises(ValueError, match="return_logprob"):
        engine.generate(input_ids=[5, 6, 7], logprob_start_len=0)
