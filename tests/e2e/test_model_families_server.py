"""Gemma 2, Gemma 3, Phi-3 and the Mixture-of-Experts Qwen2-MoE, Qwen3-MoE and Mixtral
served over HTTP: greedy tokens and logprobs equal transformers', with prompts and
outputs longer than the layers' sliding window (where the fixture has one), prompts
prefilled in chunks, and prompts sent again with a new ending answered from the prefix
cache (the fixtures are in ``tests/model_fixtures.py``; the Engine's tests of the same are
``tests/integration/test_model_families.py`` and ``tests/integration/test_moe_models.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import transformers

from tests.model_fixtures import reference_model, transformers_greedy
from tests.server_harness import SharedPool, wait_until_idle

PROMPTS = ["the quick brown fox jumps over the lazy dog",
           "one two three four five six seven eight nine ten eleven twelve", "def add(a, b):"]
AGAIN = [p + " and again" for p in PROMPTS]
NEW_TOKENS = 16


def _generate(client: httpx.Client, prompts: list[str]) -> list[dict[str, Any]]:
    answer = client.post("/generate", json={
        "text": prompts, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_greedy_tokens_match_transformers_past_the_window(
        arch: str, tiny_checkpoint: Callable[..., Path], shared: SharedPool) -> None:
    checkpoint = tiny_checkpoint(arch, seed=3)
    with shared.server(checkpoint, "--chunked-prefill-size", "16") as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        first = _generate(client, PROMPTS)
        again = _generate(client, AGAIN)
        assert wait_until_idle(client)["kv_cache_idle_and_free"] is True
    assert all(out["meta_info"]["cached_tokens"] > 6 for out in again)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = reference_model(checkpoint)
    for prompt, out in zip(PROMPTS + AGAIN, first + again, strict=True):
        ref_ids, ref_logprobs = transformers_greedy(model, tokenizer.encode(prompt), NEW_TOKENS)
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt
