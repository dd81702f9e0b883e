"""A Scheduler subclass named by --scheduler-class runs in the server's Scheduler process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest

from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import start_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LONG, MEDIUM, SHORT = "word " * 60, "word " * 20, "word"
#: The blocker's tokens, within the model's context (``CONTEXT``).
BLOCKER_TOKENS, CONTEXT = 4000, 4096


async def first_chunk_order(base_url: str) -> list[str]:
    """Start a long-running blocker, queue three prompts behind it, note who streams first.

    Each prompt is sent once the Scheduler holds the one before it in its queue, so
    that they arrive in this order whatever the machine's speed: queueing takes a few
    dozen of the blocker's steps, which has thousands to run. Then the blocker is
    cancelled (the server aborts it), and the queue runs.
    """
    order: list[str] = []

    async def stream(client: httpx.AsyncClient, name: str, prompt: str, tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and name not in order:
                    order.append(name)

    async def wait_until_queued(client: httpx.AsyncClient, count: int) -> None:
        for _ in range(2000):
            info = (await client.get("/get_server_info")).json()["scheduler"]
            if info["num_waiting_reqs"] >= count:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the Scheduler never held {count} waiting requests")

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        blocker = asyncio.create_task(stream(client, "blocker", "x", BLOCKER_TOKENS))
        deadline = time.monotonic() + 60  # a liveness bound: its first chunk comes at once
        while "blocker" not in order:
            if blocker.done():
                blocker.result()  # its error, if it failed before streaming
            assert time.monotonic() < deadline, "the blocker never streamed"
            await asyncio.sleep(0.01)
        queued = []
        for count, (name, prompt) in enumerate(
                (("long", LONG), ("medium", MEDIUM), ("short", SHORT)), start=1):
            queued.append(asyncio.create_task(stream(client, name, prompt, 4)))
            await wait_until_queued(client, count)
        assert order == ["blocker"]  # the three were queued while the blocker ran
        blocker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocker
        await asyncio.gather(*queued)
    return order


def test_scheduler_subclass_changes_batch_selection(tmp_path: Path) -> None:
    """The default Scheduler's order for the same queue (long, medium, short) is asserted
    on the fake model worker, with this class beside it: tests/unit/test_scheduler_subclass.py."""
    model = make_tiny_checkpoint(tmp_path, "llama", seed=7, max_position_embeddings=CONTEXT)
    custom = start_server(
        model, tmp_path, "--max-running-requests", "1", "--scheduler-class",
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


def test_a_class_that_is_not_a_subclass_is_refused(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "llama", seed=7)
    with pytest.raises(RuntimeError, match="not a subclass of Scheduler"):
        start_server(model, tmp_path, "--scheduler-class", "collections.OrderedDict",
                     timeout=60)
