"""Fuzzing every route of /openapi.json with schemathesis: no 5xx, and every 4xx in
OpenAI's error body; request bodies past the size limit get 413.

Bounded for CI: a small context, generated token counts capped before each call, 20
examples per operation, no example database (the same examples on every run).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server_harness import ServerProcess, wait_until_idle

EXAMPLES = 20
# Fields whose generated values would make a call long rather than interesting.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_new_tokens": 4, "n": 2,
        "min_tokens": 2, "min_new_tokens": 2}


@pytest.fixture(scope="module")
def server(small_context_server: ServerProcess) -> ServerProcess:
    return small_context_server


def cap(value: Any) -> None:
    """Cap token counts wherever they are in a generated body (in place)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in CAPS and isinstance(item, int) and not isinstance(item, bool):
                value[key] = min(item, CAPS[key])
            else:
                cap(item)
    elif isinstance(value, list):
        for item in value:
            cap(item)


def check_response(label: str, response: Any) -> None:
    assert response.status_code < 500, (label, response.status_code, response.text[:500])
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]  # a list per header
        assert content_type[0].startswith("application/json"), (
            label, response.status_code, response.text[:500])
        assert "error" in response.json(), (label, response.status_code, response.text[:500])
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (label, error)
        assert error["type"] == "invalid_request_error", (label, error)
        assert "code" in error and "param" in error, (label, error)


def fuzz_operation(operation: Any, base_url: str) -> None:
    """Call one operation with ``EXAMPLES`` generated requests and check every answer."""
    label = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def call(case: Any) -> None:
        cap(case.body)
        check_response(label, case.call(base_url=base_url, timeout=60))

    call()


def test_no_operation_answers_5xx_and_every_4xx_has_the_error_body(
        server: ServerProcess) -> None:
    doc = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        fuzz_operation(operation, server.base_url)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        info = wait_until_idle(client)
        assert info["kv_cache_idle_and_free"] is True, info


def test_a_body_past_the_size_limit_is_413(server: ServerProcess) -> None:
    huge = "x" * (33 * 1024 * 1024)
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          content=b'{"prompt": "' + huge.encode() + b'"}',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text[:200]
    error = response.json()["error"]
    assert "bytes" in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_a_chunked_body_past_the_size_limit_is_413(server: ServerProcess, tmp_path: Path
                                                   ) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * (1024 * 1024)
        yield b'"}'

    response = httpx.post(f"{server.base_url}/generate", timeout=60, content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text[:200]
