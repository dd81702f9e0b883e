"""/v1/embeddings on a real BERT checkpoint served by `framework serve`."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers

from tests.model_fixtures import minilm_checkpoint, reference_sentence_embeddings
from tests.server_harness import ServerProcess, SharedPool, http_client


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return minilm_checkpoint()


@pytest.fixture(scope="module")
def server(model_dir: Path, shared: SharedPool) -> Iterator[ServerProcess]:
    with shared.server(model_dir, "--transport", "zmq", "--codec", "msgpack") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=60)


def test_embeddings_endpoint_matches_transformers(model_dir: Path,
                                                  client: httpx.Client) -> None:
    texts = ["A man is eating food.", "Serving systems batch requests."]
    reply = client.post("/v1/embeddings", json={"input": texts}).json()
    packed = client.post("/v1/embeddings", json={"input": texts[0],
                                                 "encoding_format": "base64"}).json()
    refused = client.post("/v1/completions", json={"prompt": "x"})
    assert reply["object"] == "list"
    assert [d["index"] for d in reply["data"]] == [0, 1]
    got = np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)
    want = reference_sentence_embeddings(model_dir, texts)
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert (cosines > 0.9999).all(), cosines
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert reply["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in texts)
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype=np.float32)
    assert np.allclose(decoded, got[0], atol=1e-6)
    assert refused.status_code == 400
    assert "embedding model" in refused.json()["error"]["message"]


def test_dimensions_must_be_the_embedding_size(model_dir: Path, client: httpx.Client) -> None:
    size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    same = client.post("/v1/embeddings", json={"input": "hello", "dimensions": size})
    assert same.status_code == 200, same.text
    assert len(same.json()["data"][0]["embedding"]) == size
    for dimensions in (size // 2, size + 1, 0):
        response = client.post("/v1/embeddings", json={"input": "hello",
                                                       "dimensions": dimensions})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "dimensions", error
        assert f"dimensions must be this model's embedding size, {size}" in error["message"]


def test_an_input_may_fill_the_context(model_dir: Path, client: httpx.Client) -> None:
    """The model's whole context (512 positions here) is embedded; one more is refused."""
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    word = tokenizer.convert_tokens_to_ids("word")
    full = [tokenizer.cls_token_id, *[word] * (context - 2), tokenizer.sep_token_id]
    reply = client.post("/v1/embeddings", json={"input": full})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == context
    over = client.post("/v1/embeddings", json={"input": [*full, word]})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "input must not hold an empty string"),
    ({"input": ["fine", ""]}, "input", "input must not hold an empty string"),
    ({"input": [1, -1]}, "input", "input must hold integer token ids in [0, "),
    ({"input": [[1, 2], [10**9]]}, "input", "input must hold integer token ids in [0, "),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format",
     "encoding_format must be 'float' or 'base64', got 'hex'"),
    ({"input": 5}, "input", "Expected `str | array`, got `int`"),
])
def test_bad_inputs_are_refused_naming_the_field(client: httpx.Client, body: dict,
                                                 param: str, words: str) -> None:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
