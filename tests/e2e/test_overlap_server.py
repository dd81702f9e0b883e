"""Overlap scheduling through the server: greedy tokens and their logprobs equal
transformers' for every registered generation architecture, requests batched together
with chunked prefills. (With overlap off, the CPU default, every other server test
runs the same path.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers

from tests.model_fixtures import transformers_greedy
from tests.server_harness import SharedPool, wait_until_idle

PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "a",
           "one two three four five six seven eight nine ten eleven twelve", "def add(a, b):"]
NEW_TOKENS = 16


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                  "phi3"])
def test_greedy_tokens_match_transformers_with_overlap(arch: str,
                                                       tiny_checkpoint: Callable[..., Path],
                                                       shared: SharedPool) -> None:
    checkpoint = tiny_checkpoint(arch, seed=3)
    with shared.server(checkpoint, "--overlap-schedule", "on",
                       "--chunked-prefill-size", "16") as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        info = client.get("/get_server_info").json()["scheduler"]
        assert info["overlap_schedule"] is True
        answer = client.post("/generate", json={
            "text": PROMPTS, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                "ignore_eos": True}})
        assert answer.status_code == 200, answer.text
        assert wait_until_idle(client)["kv_cache_idle_and_free"] is True
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                              dtype=torch.float64).eval()
    for prompt, out in zip(PROMPTS, answer.json(), strict=True):
        ref_ids, ref_logprobs = transformers_greedy(model, tokenizer.encode(prompt), NEW_TOKENS)
        assert out["output_ids"] == ref_ids, prompt
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), prompt
