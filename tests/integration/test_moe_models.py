"""Qwen2-MoE, Qwen3-MoE and Mixtral through the Engine: greedy tokens and logprobs equal
transformers' (float64), with prompts prefilled in chunks smaller than they are and then
sent again with a new ending, their prefixes coming from the prefix cache (the tiny
fixtures are in ``tests/model_fixtures.py``; Mixtral's sliding window is shorter than the
prompts)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers

from framework import Engine
from tests.model_fixtures import reference_model, transformers_greedy

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten eleven twelve",
    "def add(a, b):",
]
# The same prompts with a new ending: all but their last tokens are cached by then.
AGAIN = [p + " and again" for p in PROMPTS]
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@functools.cache
def _reference(model_dir: Path, prompt: str) -> tuple[list[int], list[float]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return transformers_greedy(reference_model(model_dir), tokenizer.encode(prompt), NEW_TOKENS)


def _assert_matches(outputs: list[Any], model_dir: Path, prompts: list[str]) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        ref_ids, ref_logprobs = _reference(model_dir, prompt)
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_greedy_matches_transformers_with_chunks_and_the_prefix_cache(
        arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    model_dir = tiny_checkpoint(arch, seed=3)
    with Engine(model_path=str(model_dir), chunked_prefill_size=16, launch_mode="thread",
                log_level="warning") as engine:
        first = engine.generate(PROMPTS, GREEDY, return_logprob=True)
        again = engine.generate(AGAIN, GREEDY, return_logprob=True)
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    _assert_matches(first, model_dir, PROMPTS)
    assert all(out["meta_info"]["cached_tokens"] > 6 for out in again)
    _assert_matches(again, model_dir, AGAIN)
