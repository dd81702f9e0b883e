"""The Engine's streaming and async API: ``generate(stream=True)`` and ``async_generate``.

Most cases run the Engine with ``launch_mode="thread"`` on a tiny random Llama
(fast); one runs the default process mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from framework import Engine
from tests.model_fixtures import make_tiny_checkpoint

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
# Long enough that a stream left after its first chunk is still running.
LONG = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-async"), "llama", seed=5)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    """One thread-mode Engine for the module; each test leaves it idle."""
    with Engine(model_path=str(model_dir), launch_mode="thread", max_total_tokens=2048,
                stream_interval=2) as eng:
        yield eng


def wait_idle_and_free(engine: Engine, timeout: float = 30.0) -> None:
    """Wait (a generous liveness bound) until the Scheduler is idle with every KV slot free."""
    deadline = time.monotonic() + timeout
    while not engine.get_server_info()["kv_cache_idle_and_free"]:
        assert time.monotonic() < deadline, "the KV cache was not freed"
        time.sleep(0.05)


def aborted(engine: Engine) -> int:
    """How many running or waiting requests the Scheduler has aborted so far."""
    return engine.get_server_info()["aborted_requests"]


def held_by_the_scheduler(engine: Engine) -> bool:
    """Whether the Scheduler has a request waiting or running."""
    info = engine.get_server_info()
    return info["num_running_reqs"] + info["num_waiting_reqs"] > 0


def joined(chunks: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """The text and ids of a stream's chunks, concatenated."""
    return "".join(c["text"] for c in chunks), [i for c in chunks for i in c["output_ids"]]


def test_stream_chunks_concatenate_to_the_text(engine: Engine) -> None:
    full = engine.generate(PROMPTS[1], GREEDY)
    chunks = list(engine.generate(PROMPTS[1], GREEDY, stream=True))
    assert len(chunks) > 1, "stream_interval=2 should give several chunks"
    assert joined(chunks) == (full["text"], full["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == {
        "type": "length", "length": GREEDY["max_new_tokens"]}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert "index" not in chunks[0]


def test_stream_of_several_prompts_is_indexed(engine: Engine) -> None:
    full = engine.generate(PROMPTS, GREEDY)
    chunks = list(engine.generate(PROMPTS, GREEDY, stream=True))
    for index, expected in enumerate(full):
        mine = [c for c in chunks if c["index"] == index]
        assert joined(mine) == (expected["text"], expected["output_ids"])


def test_leaving_a_sync_stream_early_aborts(engine: Engine) -> None:
    before = aborted(engine)
    stream = engine.generate(PROMPTS[0], LONG, stream=True)
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    stream.close()  # as a `break` out of a for loop does, once the iterator is dropped
    wait_idle_and_free(engine)
    assert aborted(engine) == before + 1


def test_async_generate_inside_a_running_loop(engine: Engine) -> None:
    expected = engine.generate(PROMPTS, GREEDY)

    async def main() -> list[Any]:
        one = await engine.async_generate(PROMPTS[0], GREEDY)
        # Two calls at once share the continuous batch.
        both = await asyncio.gather(engine.async_generate(PROMPTS[0], GREEDY),
                                    engine.async_generate(PROMPTS[1], GREEDY))
        several = await engine.async_generate(PROMPTS, GREEDY)
        return [one, *both, several]

    one, first, second, several = asyncio.run(main())
    assert _same_output(one, expected[0])
    assert _same_output(first, expected[0]) and _same_output(second, expected[1])
    assert [_same_output(a, b) for a, b in zip(several, expected)] == [True, True]
    wait_idle_and_free(engine)


def _same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same text and ids (request ids differ)."""
    return (a["text"], a["output_ids"]) == (b["text"], b["output_ids"])


def test_async_stream_concatenates_and_leaving_early_aborts(engine: Engine) -> None:
    full = engine.generate(PROMPTS[1], GREEDY)
    before = aborted(engine)

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        stream = await engine.async_generate(PROMPTS[1], GREEDY, stream=True)
        chunks = [chunk async for chunk in stream]
        long_stream = await engine.async_generate(PROMPTS[0], LONG, stream=True)
        async with contextlib.aclosing(long_stream):
            first = await anext(long_stream)
        return chunks, first

    chunks, first = asyncio.run(main())
    assert joined(chunks) == (full["text"], full["output_ids"])
    assert first["meta_info"]["finish_reason"] is None
    wait_idle_and_free(engine)
    assert aborted(engine) == before + 1


def test_cancelling_async_generate_aborts(engine: Engine) -> None:
    before = aborted(engine)

    async def main() -> None:
        task = asyncio.ensure_future(engine.async_generate(PROMPTS[0], LONG))
        # Cancel once the Scheduler holds the request: one cancelled before its message
        # went out is withdrawn, and there is nothing to abort.
        deadline = time.monotonic() + 60  # a liveness bound: it is sent at once
        while not await asyncio.to_thread(held_by_the_scheduler, engine):
            assert time.monotonic() < deadline and not task.done(), "never in flight"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle_and_free(engine)
    assert aborted(engine) == before + 1


def test_bad_values_raise_value_error(engine: Engine) -> None:
    bad = {"top_p": 1.5}
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS[0], bad)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS[0], bad, stream=True)  # at the call, not at the first chunk
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(PROMPTS[0], GREEDY, top_logprobs_num=-1)

    async def main() -> None:
        with pytest.raises(ValueError, match="top_p"):
            await engine.async_generate(PROMPTS[0], bad)
        with pytest.raises(ValueError, match="top_p"):
            await engine.async_generate(PROMPTS, [GREEDY, bad], stream=True)

    asyncio.run(main())
    wait_idle_and_free(engine)


def test_process_mode_streams_and_serves_a_running_loop(model_dir: Path) -> None:
    with Engine(model_path=str(model_dir), max_total_tokens=2048) as engine:
        full = engine.generate(PROMPTS[0], GREEDY)
        chunks = list(engine.generate(PROMPTS[0], GREEDY, stream=True))
        assert joined(chunks) == (full["text"], full["output_ids"])

        async def main() -> tuple[Any, list[dict[str, Any]]]:
            out = await engine.async_generate(PROMPTS[0], GREEDY)
            stream = await engine.async_generate(PROMPTS[0], GREEDY, stream=True)
            return out, [c async for c in stream]

        out, async_chunks = asyncio.run(main())
        assert _same_output(out, full)
        assert joined(async_chunks) == (full["text"], full["output_ids"])
        wait_idle_and_free(engine)
