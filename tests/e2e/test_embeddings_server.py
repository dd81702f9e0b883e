"""/v1/embeddings on a real BERT checkpoint served by `framework serve`."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import transformers

from tests.model_fixtures import minilm_checkpoint, reference_sentence_embeddings
from tests.server_harness import start_server


def test_embeddings_endpoint_matches_transformers(tmp_path: Path) -> None:
    model_dir = minilm_checkpoint()
    texts = ["A man is eating food.", "Serving systems batch requests."]
    server = start_server(model_dir, tmp_path, "--transport", "zmq", "--codec", "msgpack")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            reply = client.post("/v1/embeddings", json={"input": texts}).json()
            packed = client.post("/v1/embeddings", json={"input": texts[0],
                                                         "encoding_format": "base64"}).json()
            refused = client.post("/v1/completions", json={"prompt": "x"})
    finally:
        assert server.stop() == 0, server.log()
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
