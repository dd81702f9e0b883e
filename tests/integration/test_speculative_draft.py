"""Draft-model speculation (``--speculative-algorithm draft``) through the Engine.

Greedy outputs and their logprobs match transformers for every decoder architecture with
a one-layer Llama as the draft; the served model as its own draft has every draft
accepted (so the draft's KV cache holds what the target's does, slot for slot, including
the last draft's that a fully accepted step leaves to the next forward); sampled requests
speculate and free their slots; and a draft that cannot draft for the model is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from framework import Engine
from framework.config import ServerArgs
from framework.default_model import default_model_path
from tests.model_fixtures import TINY_ARCHITECTURES, reference_model, transformers_greedy

DECODERS = [arch for arch in TINY_ARCHITECTURES if arch != "bert"]
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [100, 3, 200, 4, 100, 3, 200],
]
NEW_TOKENS = 16
K = 3
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
QUIET = {"launch_mode": "thread", "log_level": "warning"}


def _draft_args(draft: Path) -> dict[str, Any]:
    return {"speculative_algorithm": "draft", "speculative_draft_model_path": str(draft),
            "speculative_num_draft_tokens": K}


@functools.cache
def _reference(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    model = reference_model(model_dir)
    return [transformers_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _run(model_dir: Path, params: dict[str, Any], **engine_args: Any
         ) -> tuple[list[Any], dict[str, Any]]:
    with Engine(model_path=str(model_dir), **QUIET, **engine_args) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=params,
                                  return_logprob=True)
        info = engine.get_server_info()
    assert info["kv_cache_idle_and_free"] is True
    return outputs, info


@pytest.mark.parametrize("arch", DECODERS)
def test_greedy_matches_transformers_with_a_draft_model(
        arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    target = tiny_checkpoint(arch, seed=2)
    draft = tiny_checkpoint("llama", seed=3, num_hidden_layers=1)
    outputs, info = _run(target, GREEDY, **_draft_args(draft))
    for prompt, out, (ref_ids, ref_logprobs) in zip(PROMPTS, outputs, _reference(target),
                                                    strict=True):
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt
    assert info["verify_steps"] > 0 and info["draft_forwards"] > info["verify_steps"]
    assert info["speculative_draft_model_path"] == str(draft)


def test_the_model_as_its_own_draft_has_every_draft_accepted(
        tiny_checkpoint: Callable[..., Path]) -> None:
    target = tiny_checkpoint("llama", seed=1)
    plain, _ = _run(target, GREEDY)
    outputs, info = _run(target, GREEDY, **_draft_args(target))
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    # 15 tokens after the prefill's: four verify steps a request, the last one drafting
    # two (the token budget's room), all accepted.
    assert info["spec_verifications"] == 4 * len(PROMPTS)
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"] == 11 * len(PROMPTS)


def test_sampled_requests_speculate_and_free_their_slots() -> None:
    # The embedded default model, as its own draft: its distributions are peaked enough for
    # sampled tokens to agree with greedy drafts (a random tiny model's are not).
    target = Path(default_model_path())
    params = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": NEW_TOKENS,
              "ignore_eos": True}
    outputs, info = _run(target, params, **_draft_args(target))
    assert all(len(out["output_ids"]) == NEW_TOKENS for out in outputs)
    assert info["spec_accepted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused(
        tiny_checkpoint: Callable[..., Path]) -> None:
    target = tiny_checkpoint("llama", seed=1)
    draft = tiny_checkpoint("llama", seed=1, vocab_size=300)
    with pytest.raises(Exception, match="vocabulary of 300 tokens"):
        Engine(model_path=str(target), **QUIET, **_draft_args(draft))


@pytest.mark.parametrize(("changes", "message"), [
    ({"speculative_algorithm": "draft"}, "go together"),
    ({"speculative_draft_model_path": "/d"}, "go together"),
    ({"speculative_algorithm": "draft", "speculative_draft_model_path": "/d", "tp_size": 2},
     "runs on one rank"),
])
def test_launch_settings_the_draft_algorithm_cannot_run_with_are_refused(
        changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="/m", **changes)
