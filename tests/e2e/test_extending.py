"""A Scheduler subclass named by --scheduler-class runs in the server's Scheduler process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import start_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LONG, MEDIUM, SHORT = "word " * 60, "word " * 20, "word"


async def first_chunk_order(base_url: str) -> list[str]:
    """Start a long-running blocker, queue three prompts behind it, note who streams first."""
    order: list[str] = []

    async def stream(client: httpx.AsyncClient, name: str, prompt: str, tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and name not in order:
                    order.append(name)

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        blocker = asyncio.create_task(stream(client, "blocker", "x", 150))
        while "blocker" not in order:
            await asyncio.sleep(0.01)
        queued = []
        for name, prompt in (("long", LONG), ("medium", MEDIUM), ("short", SHORT)):
            queued.append(asyncio.create_task(stream(client, name, prompt, 4)))
            await asyncio.sleep(0.05)  # arrive in this order while the blocker runs
        await asyncio.gather(blocker, *queued)
    return order


def test_scheduler_subclass_changes_batch_selection(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "llama", seed=7)
    common = ("--max-running-requests", "1")
    custom = start_server(
        model, tmp_path, *common, "--scheduler-class",
        "shortest_prompt_first.ShortestPromptFirstScheduler",
        env={"PYTHONPATH": str(EXAMPLES)},
    )
    try:
        info = httpx.get(f"{custom.base_url}/get_server_info").json()["scheduler"]
        assert info["scheduler_class"] == "shortest_prompt_first.ShortestPromptFirstScheduler"
        assert asyncio.run(first_chunk_order(custom.base_url)) == [
            "blocker", "short", "medium", "long"]
    finally:
        assert custom.stop() == 0, custom.log()

    default = start_server(model, tmp_path, *common)
    try:
        assert asyncio.run(first_chunk_order(default.base_url)) == [
            "blocker", "long", "medium", "short"]
    finally:
        assert default.stop() == 0, default.log()


def test_a_class_that_is_not_a_subclass_is_refused(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "llama", seed=7)
    with pytest.raises(RuntimeError, match="not a subclass of Scheduler"):
        start_server(model, tmp_path, "--scheduler-class", "collections.OrderedDict",
                     timeout=60)
