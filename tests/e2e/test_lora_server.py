"""LoRA adapters through the real server and the ``openai`` client.

``model: "<adapter>"`` (or ``"<served-model>:<adapter>"``) on the OpenAI routes and
``lora_path`` on ``/generate`` run the adapter: the same greedy tokens as
transformers + peft with the adapter merged; ``/v1/models`` lists the adapters
with the base model as their parent; an unknown adapter is a 404
``model_not_found`` on the OpenAI routes and a 400 naming ``lora_path`` on
``/generate``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.test_lora_engine import ADAPTERS, NEW_TOKENS, make_lora_dirs
from tests.model_fixtures import (
    make_tiny_tokenizer,
    reference_model,
    transformers_greedy,
)
from tests.server_harness import ServerProcess, start_server

PROMPT = "the quick brown fox"
SERVED = "tiny"
#: Tokens of a request that is still running while others load and unload adapters.
LONG = 200


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_lora_dirs(tmp_path_factory.mktemp("lora_server"))


@pytest.fixture(scope="module")
def server(lora_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    paths = [f"{name}={lora_dirs[name]}" for name in ADAPTERS]
    proc = start_server(lora_dirs["base"], tmp_path_factory.mktemp("logs"),
                        "--served-model-name", SERVED, "--dtype", "float32",
                        "--lora-paths", *paths)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(lora_dirs: dict[str, Path]) -> dict[str | None, list[int]]:
    import peft

    ids = make_tiny_tokenizer()(PROMPT)["input_ids"]
    tokens: dict[str | None, list[int]] = {}
    for name in (None, *ADAPTERS):
        model = reference_model(lora_dirs["base"])
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, lora_dirs[name]).merge_and_unload()
        tokens[name] = transformers_greedy(model.double(), ids, NEW_TOKENS)[0]
    return tokens


def _generate(server: ServerProcess, lora_path: str | None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": PROMPT, "lora_path": lora_path,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                            "ignore_eos": True}})


def test_model_and_lora_path_run_the_adapter(
        server: ServerProcess, reference: dict[str | None, list[int]]) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    tokenizer = make_tiny_tokenizer()
    for name in (None, *ADAPTERS):
        assert _generate(server, name).json()["output_ids"] == reference[name], name
        if name is None:
            continue
        for model in (name, f"{SERVED}:{name}"):
            completion = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
            assert completion.choices[0].text == tokenizer.decode(reference[name]), model


def test_models_lists_the_adapters(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {SERVED, *ADAPTERS}
    assert all(cards[name].parent == SERVED for name in ADAPTERS)  # type: ignore[attr-defined]


def test_an_unknown_adapter_is_refused(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found"
    refused = _generate(server, "nope")
    assert refused.status_code == 400 and "lora_path" in refused.text


def test_load_and_unload_at_run_time(
        server: ServerProcess, lora_dirs: dict[str, Path],
        reference: dict[str | None, list[int]]) -> None:
    base = server.base_url
    running = httpx.post(f"{base}/generate", timeout=5, json={
        "text": PROMPT, "lora_path": "mlp2", "stream": False,
        "sampling_params": {"max_new_tokens": 1}})
    assert running.status_code == 200
    with httpx.Client(timeout=120) as client:
        # (A refusal while requests use the adapter: test_scheduler's unit test.)
        unloaded = client.post(f"{base}/unload_lora_adapter", json={"lora_name": "mlp2"})
        assert unloaded.json()["success"] is True
        assert _generate(server, "mlp2").status_code == 400
        loaded = client.post(f"{base}/load_lora_adapter", json={
            "lora_name": "mlp2", "lora_path": str(lora_dirs["mlp2"])})
        assert loaded.json()["success"] is True, loaded.text
        bad = client.post(f"{base}/load_lora_adapter", json={
            "lora_name": "broken", "lora_path": str(lora_dirs["base"])})
        assert bad.status_code == 400
    assert _generate(server, "mlp2").json()["output_ids"] == reference["mlp2"]
    info = httpx.get(f"{base}/get_server_info", timeout=30).json()["scheduler"]
    assert info["kv_cache_idle_and_free"] is True


def test_adapters_load_and_unload_while_requests_run(
        server: ServerProcess, lora_dirs: dict[str, Path]) -> None:
    """A stream on one adapter runs while another adapter loads and serves: the stream's
    tokens are those it gets alone, the loaded adapter's are those of its directory,
    and unloading the stream's adapter is refused until it ends."""
    base = server.base_url

    def body(name: str, stream: bool) -> dict[str, Any]:
        return {"text": PROMPT, "lora_path": name, "stream": stream,
                "sampling_params": {"max_new_tokens": LONG, "temperature": 0,
                                    "ignore_eos": True}}

    with httpx.Client(timeout=120) as client:
        alone = {name: client.post(f"{base}/generate", json=body(name, False)).json()[
            "output_ids"] for name in ("attn4", "all8")}
        with client.stream("POST", f"{base}/generate", json=body("attn4", True)) as stream:
            events = (line.removeprefix("data: ") for line in stream.iter_lines()
                      if line.startswith("data: "))
            next(events)  # the request runs
            refused = client.post(f"{base}/unload_lora_adapter", json={"lora_name": "attn4"})
            assert refused.status_code == 400 and "in use by 1 requests" in refused.text
            loaded = client.post(f"{base}/load_lora_adapter", json={
                "lora_name": "late", "lora_path": str(lora_dirs["all8"])})
            assert loaded.json()["success"] is True, loaded.text
            late = client.post(f"{base}/generate", json=body("late", False)).json()
            *chunks, done = list(events)
        assert done == "[DONE]" and json.loads(chunks[-1])["output_ids"] == alone["attn4"]
        assert late["output_ids"] == alone["all8"]
        assert client.post(f"{base}/unload_lora_adapter",
                           json={"lora_name": "late"}).json()["success"] is True
        info = client.get(f"{base}/get_server_info").json()["scheduler"]
    assert info["kv_cache_idle_and_free"] is True
