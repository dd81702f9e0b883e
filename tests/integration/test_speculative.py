"""Speculative decoding (``--speculative-algorithm ngram``) through the Engine.

Greedy outputs and their logprobs match transformers for every decoder architecture, with
drafts actually accepted; a verifier that accepts every draft changes the outputs; a stop
token inside an accepted run ends the request there with no KV left behind; sampled
requests speculate too; and on prompts that contain the plain run's own output, a
request gains at least 1.5 tokens per verify step.

With a draft model (``--speculative-algorithm draft``), a one-layer Llama as the draft gives
transformers' greedy tokens and logprobs for every decoder architecture; the served model as
its own draft has every draft accepted (so the draft's KV cache holds what the target's
does, slot for slot, including the last draft's that a fully accepted step leaves to the
next forward); sampled requests speculate and free their slots; and a draft that cannot
draft for the model is refused.
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
# Prompts that repeat themselves, so that drafts from the prompt are accepted.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [100, 3, 200, 4, 100, 3, 200],
]
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SPECULATIVE = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
QUIET = {"launch_mode": "thread", "log_level": "warning"}
K = 3  # draft tokens of the draft-model runs


def _draft_args(draft: Path) -> dict[str, Any]:
    return {"speculative_algorithm": "draft", "speculative_draft_model_path": str(draft),
            "speculative_num_draft_tokens": K}


@functools.cache
def _reference(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    model = reference_model(model_dir)
    return [transformers_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _run(model_dir: Path, params: dict[str, Any], prompts: list[list[int]] = PROMPTS,
         **engine_args: Any) -> tuple[list[Any], dict[str, Any]]:
    with Engine(model_path=str(model_dir), **QUIET, **engine_args) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params,
                                  return_logprob=True)
        info = engine.get_server_info()
    assert info["kv_cache_idle_and_free"] is True
    return outputs, info


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", seed=1)


@pytest.mark.parametrize("arch", DECODERS)
def test_greedy_matches_transformers_with_drafts_accepted(
        arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    model_dir = tiny_checkpoint(arch, seed=2)
    outputs, info = _run(model_dir, GREEDY, **SPECULATIVE)
    for prompt, out, (ref_ids, ref_logprobs) in zip(PROMPTS, outputs, _reference(model_dir),
                                                    strict=True):
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt
    assert info["verify_steps"] > 0
    assert info["spec_accepted_tokens"] > 0, "no draft was ever accepted: nothing was tested"
    # Each request's own counts, in its meta_info.
    metas = [out["meta_info"] for out in outputs]
    assert sum(m.get("spec_accepted_tokens", 0) for m in metas) == info["spec_accepted_tokens"]
    assert sum(m.get("spec_verify_ct", 0) for m in metas) == info["spec_verifications"]


def test_accepting_every_draft_changes_the_outputs(llama: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity test can tell a verifier that does not check the drafts."""
    from framework.speculative import verifier

    plain, _ = _run(llama, GREEDY)

    def accept_all(drafted: list[int], targets: list[int]) -> list[int]:
        return [*drafted, targets[-1]]

    monkeypatch.setattr(verifier, "accept_greedy", accept_all)
    broken, _ = _run(llama, GREEDY, **SPECULATIVE)
    assert [o["output_ids"] for o in broken] != [o["output_ids"] for o in plain]


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(llama: Path) -> None:
    plain, _ = _run(llama, GREEDY)
    # Stop at the 10th plain token: a token that speculation likely reaches mid-run.
    stops = [out["output_ids"][9] for out in plain]
    for prompt, out, stop in zip(PROMPTS, plain, stops, strict=True):
        params = {**GREEDY, "stop_token_ids": [stop], "ignore_eos": False}
        (spec,), _ = _run(llama, params, prompts=[prompt], **SPECULATIVE)
        first = out["output_ids"].index(stop)
        assert spec["output_ids"] == out["output_ids"][:first + 1]
        assert spec["meta_info"]["finish_reason"]["type"] == "stop"


CODE = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
        "import os\nimport sys\n\ndef main():"]


@pytest.fixture(scope="module")
def code_again() -> list[str]:
    """Code prompts for the embedded default model, each followed by its plain greedy
    continuation and then by itself again: the second continuation can be drafted from
    the first."""
    with Engine(**QUIET) as engine:
        plain = engine.generate(CODE, {**GREEDY, "max_new_tokens": 32})
    return [p + out["text"] + "\n\n" + p for p, out in zip(CODE, plain, strict=True)]


def _run_default(prompts: list[str], params: dict[str, Any],
                 **engine_args: Any) -> tuple[list[Any], dict[str, Any]]:
    with Engine(**QUIET, **engine_args) as engine:
        outputs = engine.generate(prompts, params)
        info = engine.get_server_info()
    assert info["kv_cache_idle_and_free"] is True
    return outputs, info


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_prompts_holding_the_plain_output_gain_over_one_and_a_half_tokens_a_step(
        code_again: list[str], algorithm: str) -> None:
    """``ngram``, and ``draft`` with the default model's shipped draft (``default-draft``)."""
    params = {**GREEDY, "max_new_tokens": 32}
    plain, _ = _run_default(code_again, params)
    args = SPECULATIVE if algorithm == "ngram" else _draft_args(Path("default-draft"))
    spec, info = _run_default(code_again, params, **args)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_accept_length"] >= 1.5, info["spec_accept_length"]


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_sampled_requests_speculate_and_free_their_slots(code_again: list[str],
                                                         algorithm: str) -> None:
    params = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True}
    # The draft: the default model itself, whose distributions are peaked enough for sampled
    # tokens to agree with greedy drafts (a random tiny model's are not).
    args = SPECULATIVE if algorithm == "ngram" else _draft_args(Path(default_model_path()))
    outputs, info = _run_default(code_again, params, **args)
    assert all(len(out["output_ids"]) == 32 for out in outputs)
    assert info["spec_accepted_tokens"] > 0


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(llama: Path) -> None:
    plain, _ = _run(llama, GREEDY)
    with Engine(model_path=str(llama), log_level="warning", tp_size=2,
                **SPECULATIVE) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        info = engine.get_server_info()
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    assert info["spec_accepted_tokens"] > 0 and info["kv_cache_idle_and_free"] is True


# --------------------------------------------------------------------------- draft model

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


def test_the_model_as_its_own_draft_has_every_draft_accepted(llama: Path) -> None:
    plain, _ = _run(llama, GREEDY)
    outputs, info = _run(llama, GREEDY, **_draft_args(llama))
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    # 15 tokens after the prefill's: four verify steps a request, the last one drafting
    # two (the token budget's room), all accepted.
    assert info["spec_verifications"] == 4 * len(PROMPTS)
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"] == 11 * len(PROMPTS)


def test_a_draft_without_a_decode_plan_drafts_through_its_modules(
        tiny_checkpoint: Callable[..., Path]) -> None:
    """Qwen3 (q/k norms) has no ``DraftDecodePlan``: as its own draft, every draft is still
    accepted, drafted by its modules."""
    model = tiny_checkpoint("qwen3", seed=2)
    plain, _ = _run(model, GREEDY)
    outputs, info = _run(model, GREEDY, **_draft_args(model))
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"] > 0


def test_plain_steps_above_the_batch_size_limit_leave_their_tokens_to_the_draft(
        llama: Path) -> None:
    """While three requests run, steps decode without drafts and the draft model does not
    run; once the first request ends, the draft's first forward feeds the tokens it missed:
    with the model as its own draft, every draft is still accepted."""
    params = [{**GREEDY, "max_new_tokens": 4}, GREEDY, GREEDY]
    plain, _ = _run(llama, params)
    outputs, info = _run(llama, params, **_draft_args(llama),
                         speculative_disable_by_batch_size=2)
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    assert info["decode_steps"] >= 3 and info["spec_verifications"] > 0
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"]


def test_retracted_requests_draft_again_from_their_new_prefill(llama: Path) -> None:
    """A pool too small for every request retracts some; each comes back through a prefill
    that both models run, and with the model as its own draft every draft is accepted."""
    params = {**GREEDY, "max_new_tokens": 24}
    plain, _ = _run(llama, params)
    outputs, info = _run(llama, params, **_draft_args(llama), max_total_tokens=64)
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain]
    assert info["retracted_requests"] > 0
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused(
        llama: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    draft = tiny_checkpoint("llama", seed=1, vocab_size=300)
    with pytest.raises(Exception, match="vocabulary of 300 tokens"):
        Engine(model_path=str(llama), **QUIET, **_draft_args(draft))


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
