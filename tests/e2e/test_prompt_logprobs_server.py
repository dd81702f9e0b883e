"""Prompt logprobs over HTTP: ``echo`` with ``logprobs`` on /v1/completions (the request
loglikelihood evaluations send, ``max_tokens: 0`` included) through the official ``openai``
client, and ``logprob_start_len`` on /generate, against transformers' log-softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from tests.server_harness import (
    ServerProcess,
    SharedPool,
    http_client,
    stream_events,
    wait_until_idle,
)

ATOL = 1e-4
MODEL = "tiny"
PROMPT = "the quick brown fox jumps over the lazy dog and then the cat"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", seed=13)


@pytest.fixture(scope="module")
def server(checkpoint: Path, shared: SharedPool) -> Iterator[ServerProcess]:
    # Small chunks: the prompt's logprobs are gathered over several prefill steps.
    with shared.server(checkpoint, "--chunked-prefill-size", "4", "--served-model-name",
                       MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=60)


@pytest.fixture(scope="module")
def oa(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def prompt_ids(client: httpx.Client) -> list[int]:
    return client.post("/tokenize", json={"text": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompt_ids: list[int]) -> torch.Tensor:
    """Row ``p - 1``: transformers' float64 log-softmax giving prompt position ``p``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_echoed_prompt(logprobs: Any, prompt_ids: list[int], reference: torch.Tensor,
                        tokenizer_decode: Any) -> None:
    """The first ``len(prompt_ids)`` entries of a legacy ``logprobs`` object (with top 2)."""
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == [tokenizer_decode(t) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    for p in range(1, n):
        row = reference[p - 1]
        assert logprobs.token_logprobs[p] == pytest.approx(float(row[prompt_ids[p]]), abs=ATOL)
        # Keyed by token text, as OpenAI's format is: two ids that decode alike share a key.
        # The top 2, and the prompt's own token whether or not it is among them.
        top = logprobs.top_logprobs[p]
        want = [*row.topk(2).values.tolist(), float(row[prompt_ids[p]])]
        assert top and all(min(abs(v - w) for w in want) < ATOL for v in top.values()), p
        assert tokenizer_decode(prompt_ids[p]) in top and len(top) <= 3, p


@pytest.fixture(scope="module")
def decode(client: httpx.Client) -> Any:
    return lambda token: client.post("/detokenize", json={"tokens": [token]}).json()["text"]


def test_echo_with_max_tokens_zero_scores_the_prompt(
        oa: openai.OpenAI, client: httpx.Client, prompt_ids: list[int],
        reference: torch.Tensor, decode: Any) -> None:
    done = oa.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                 max_tokens=0, temperature=0)
    choice = done.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_echoed_prompt(choice.logprobs, prompt_ids, reference, decode)
    assert done.usage.prompt_tokens == len(prompt_ids) and done.usage.completion_tokens == 0
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


def test_echo_with_output_tokens_scores_both(
        oa: openai.OpenAI, prompt_ids: list[int], reference: torch.Tensor, decode: Any) -> None:
    done = oa.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=2,
                                 max_tokens=3, temperature=0)
    choice = done.choices[0]
    n = len(prompt_ids)
    check_echoed_prompt(choice.logprobs, prompt_ids, reference, decode)
    # The output's tokens follow, each with its logprob; the offsets run on past the prompt.
    assert len(choice.logprobs.tokens) == n + 3
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[n:])
    echoed = choice.text[: len(choice.text) - len("".join(choice.logprobs.tokens[n:]))]
    assert choice.logprobs.text_offset[n] == len(echoed)


def test_streamed_echo_carries_the_prompt_logprobs_first(
        client: httpx.Client, prompt_ids: list[int], reference: torch.Tensor,
        decode: Any) -> None:
    events = stream_events(client, "/v1/completions", {
        "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 0,
        "stream": True})
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    first = choices[0]
    assert first["text"] == PROMPT
    check_echoed_prompt(SimpleNamespace(**first["logprobs"]), prompt_ids, reference, decode)
    assert "".join(c["text"] for c in choices).startswith(PROMPT)
    assert choices[-1]["finish_reason"] == "length"


def test_generate_returns_the_prompt_from_logprob_start_len(
        client: httpx.Client, prompt_ids: list[int], reference: torch.Tensor) -> None:
    out = client.post("/generate", json={
        "input_ids": prompt_ids, "return_logprob": True, "logprob_start_len": 2,
        "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 1}}).json()
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt_ids[2:]
    for (value, token, _), p in zip(entries, range(2, len(prompt_ids))):
        assert value == pytest.approx(float(reference[p - 1][token]), abs=ATOL)
        assert meta["input_top_logprobs"][p - 2][0][1] == int(reference[p - 1].argmax())
    assert len(meta["output_token_logprobs"]) == 1


@pytest.mark.parametrize("extra, named", [
    ({"return_logprob": True, "logprob_start_len": 10_000}, "logprob_start_len"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"logprob_start_len": 0}, "return_logprob"),
])
def test_bad_logprob_start_len_is_a_400(client: httpx.Client, extra: dict[str, Any],
                                        named: str) -> None:
    response = client.post("/generate", json={"text": PROMPT, **extra})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]
