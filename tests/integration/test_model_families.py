"""Gemma 2, Gemma 3, Phi-3 and a windowed Mistral through the Engine, against transformers.

Each tiny fixture has a sliding window (6 or 7 tokens) shorter than the prompts and the
outputs, and the Gemmas their soft-capping and other particulars set off their defaults
(``tests/model_fixtures.py``). Prompts are prefilled in chunks smaller than they are, then
sent again with a new ending, so that their prefixes come from the prefix cache: the
windowed layers must mask the same keys however a request's tokens reached the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from framework import Engine
from framework.layers.attention.radix_attention import RadixAttention
from tests.model_fixtures import transformers_greedy

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten eleven twelve",
    "the cache holds keys and values for every layer of the model, page by page",
    "def add(a, b):",
]
# The same prompts with a new ending: all but their last tokens are cached by then.
AGAIN = [p + " and again" for p in PROMPTS]
NEW_TOKENS = 20
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# short name -> config overrides: the Mistral fixture's default window is wider than the
# tests' contexts, so it is narrowed here.
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": {}, "gemma3": {}, "phi3": {}, "mistral": {"sliding_window": 5},
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Path]:
    """The tiny checkpoint of a family (built once per session)."""
    return lambda arch: tiny_checkpoint(arch, seed=3, **FAMILIES[arch])


@functools.cache
def _reference(model_dir: Path, prompts: tuple[str, ...]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and logprobs (float64) for each prompt."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float64).eval()
    return [transformers_greedy(model, tokenizer.encode(p), NEW_TOKENS) for p in prompts]


def _generate_twice(model_dir: Path, backend: str) -> tuple[list[Any], list[Any]]:
    with Engine(model_path=str(model_dir), attention_backend=backend, chunked_prefill_size=16,
                launch_mode="thread", log_level="warning") as engine:
        first = engine.generate(PROMPTS, GREEDY, return_logprob=True)
        again = engine.generate(AGAIN, GREEDY, return_logprob=True)
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    return first, again


def _assert_matches(outputs: list[Any], model_dir: Path, prompts: list[str]) -> None:
    for prompt, out, (ref_ids, ref_logprobs) in zip(
            prompts, outputs, _reference(model_dir, tuple(prompts)), strict=True):
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_matches_transformers_past_the_window(arch: str, backend: str,
                                                     checkpoint: Callable[[str], Path]) -> None:
    model_dir = checkpoint(arch)
    first, again = _generate_twice(model_dir, backend)
    _assert_matches(first, model_dir, PROMPTS)
    # The second round's prompts reached the cache through the first: each found most of
    # its prompt there.
    assert all(out["meta_info"]["cached_tokens"] > 6 for out in again)
    _assert_matches(again, model_dir, AGAIN)


def test_without_the_window_the_outputs_differ(checkpoint: Callable[[str], Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can tell: every layer attending to the whole context instead
    (the window dropped where the layers are built) moves the outputs off transformers'."""
    model_dir = checkpoint("mistral")
    build = RadixAttention.__init__

    def unwindowed(self: RadixAttention, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **{**kwargs, "sliding_window": None})

    monkeypatch.setattr(RadixAttention, "__init__", unwindowed)
    first, _ = _generate_twice(model_dir, "cpu")
    references = _reference(model_dir, tuple(PROMPTS))
    assert any(out["output_ids"] != ref_ids for out, (ref_ids, _) in zip(first, references))
