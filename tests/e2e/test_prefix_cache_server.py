"""The prefix cache through the real server: cached_tokens reported, /flush_cache, same outputs."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, wait_until_idle

SHARED = ("The scheduler picks which requests run next; the tokenizer turns text into ids. "
          "Paged memory splits the cache into slots so that requests of any length fit "
          "together. Attention lets every token look at the tokens before it.")


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


def complete(client: openai.OpenAI, prompt: str) -> openai.types.Completion:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                     temperature=0)


def test_a_shared_prefix_is_reported_as_cached_and_flush_empties_the_cache(
        server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    # The server is shared: what other tests left in the cache goes first.
    assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    first = complete(client, SHARED + " First question?")
    assert first.usage.prompt_tokens_details is None  # nothing was cached yet

    second_prompt = SHARED + " A second, different question?"
    cached_run = complete(client, second_prompt)
    details = cached_run.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= cached_run.usage.prompt_tokens // 2

    native = httpx.post(f"{server.base_url}/generate", json={
        "text": second_prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        timeout=60).json()
    assert native["meta_info"]["cached_tokens"] == cached_run.usage.prompt_tokens - 1

    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["scheduler"]
    assert info["cache_hit_rate"] > 0 and info["evictable_kv_tokens"] > 0
    assert info["kv_cache_idle_and_free"] is True

    flushed = httpx.post(f"{server.base_url}/flush_cache", timeout=30)
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["scheduler"]
    assert info["evictable_kv_tokens"] == 0 and info["kv_cache_idle_and_free"] is True

    uncached_run = complete(client, second_prompt)
    assert uncached_run.usage.prompt_tokens_details is None
    # Greedy output computed over the cached prefix equals the one computed from scratch.
    assert uncached_run.choices[0].text == cached_run.choices[0].text


def test_flush_is_refused_while_a_request_runs(server: ServerProcess) -> None:
    body = {"prompt": "count", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        refused = httpx.post(f"{server.base_url}/flush_cache", timeout=30)
        assert refused.status_code == 400
        assert "in flight" in refused.json()["message"]
    # The stream was left early: its request is aborted and everything is freed.
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert wait_until_idle(client)["kv_cache_idle_and_free"] is True

