"""A server with ``--speculative-algorithm ngram``: greedy tokens and logprobs equal
transformers' through the real ``openai`` client, ``n`` and stop strings behave as without
speculation, and ``/get_server_info`` and ``/metrics`` report the accepted length; a server
with ``--speculative-algorithm draft`` gives transformers' greedy tokens too."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.model_fixtures import reference_model, transformers_greedy
from tests.server_harness import ServerProcess, SharedPool, wait_until_idle

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6], [40, 41, 42, 43, 40, 41]]
NEW_TOKENS = 16
FLAGS = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4",
         "--enable-metrics")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3", seed=5)


@pytest.fixture
def server(checkpoint: Path, shared: SharedPool) -> ServerProcess:
    with shared.server(checkpoint, *FLAGS) as server:
        yield server


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_greedy_completions_match_transformers(server: ServerProcess, checkpoint: Path) -> None:
    model = reference_model(checkpoint)
    client = _client(server)
    for prompt in PROMPTS:
        answer = client.completions.create(model=str(checkpoint), prompt=prompt, temperature=0,
                                           max_tokens=NEW_TOKENS, logprobs=1,
                                           extra_body={"ignore_eos": True})
        ref_ids, ref_logprobs = transformers_greedy(model, prompt, NEW_TOKENS)
        assert answer.usage.completion_tokens == NEW_TOKENS
        assert np.allclose(answer.choices[0].logprobs.token_logprobs, ref_logprobs,
                           atol=1e-4, rtol=0)
        native = httpx.post(f"{server.base_url}/generate", timeout=60, json={
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                "ignore_eos": True}}).json()
        assert native["output_ids"] == ref_ids
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        info = wait_until_idle(http)
        assert info["kv_cache_idle_and_free"] is True
        assert info["speculative_algorithm"] == "ngram"
        assert info["spec_verifications"] > 0 and info["spec_accept_length"] > 1.0


def test_n_and_stop_strings_match_plain_decoding(server: ServerProcess, checkpoint: Path,
                                                  shared: SharedPool) -> None:
    params = {"model": str(checkpoint), "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 12,
              "n": 2}
    spec = _client(server).completions.create(**params)
    stop = spec.choices[0].text[3:6]
    stopped = _client(server).completions.create(**params, stop=[stop]) if stop else None
    with shared.server(checkpoint) as plain_server:
        plain = _client(plain_server).completions.create(**params)
        plain_stopped = (_client(plain_server).completions.create(**params, stop=[stop])
                         if stop else None)
    assert [c.text for c in spec.choices] == [c.text for c in plain.choices]
    if stopped is not None and plain_stopped is not None:
        assert [c.text for c in stopped.choices] == [c.text for c in plain_stopped.choices]
        assert [c.finish_reason for c in stopped.choices] == [
            c.finish_reason for c in plain_stopped.choices]


def test_metrics_report_the_accepted_length(server: ServerProcess, checkpoint: Path) -> None:
    _client(server).completions.create(model=str(checkpoint), prompt=PROMPTS[1], temperature=0,
                                       max_tokens=NEW_TOKENS)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        wait_until_idle(http)
        text = ""
        for _ in range(100):  # the Scheduler reports about once a second
            text = http.get("/metrics").text
            if _gauge(text, "framework:spec_accept_length") > 1.0:
                break
            time.sleep(0.1)
        assert _gauge(text, "framework:spec_accept_length") > 1.0
        assert 0.0 < _gauge(text, "framework:spec_acceptance_rate") <= 1.0


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_a_draft_model_server_gives_transformers_greedy_tokens(
        checkpoint: Path, tiny_checkpoint: Callable[..., Path], shared: SharedPool) -> None:
    draft = tiny_checkpoint("llama", seed=3, num_hidden_layers=1)
    model = reference_model(checkpoint)
    with shared.server(checkpoint, "--speculative-algorithm", "draft",
                       "--speculative-draft-model-path", str(draft)) as server:
        client = _client(server)
        for prompt in PROMPTS:
            answer = client.completions.create(model=str(checkpoint), prompt=prompt,
                                               temperature=0, max_tokens=NEW_TOKENS, logprobs=1,
                                               extra_body={"ignore_eos": True})
            _, ref_logprobs = transformers_greedy(model, prompt, NEW_TOKENS)
            assert np.allclose(answer.choices[0].logprobs.token_logprobs, ref_logprobs,
                               atol=1e-4, rtol=0)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            info = wait_until_idle(http)
    assert info["kv_cache_idle_and_free"] is True
    assert info["speculative_algorithm"] == "draft" and info["verify_steps"] > 0
