"""Garbage on the wire: bytes no codec decodes, and well-formed messages of the wrong type
or with a broken layout, sent by a stranger to every socket of a running runtime, are
logged and dropped; the runtime keeps serving, with the same outputs.

On the shm transport a stranger cannot send at all while the runtime's own sender
holds a ring (``test_a_second_sending_process_is_refused_until_the_first_closes``), and
garbled frames on a ring are dropped
(``test_garbled_frames_raise_codec_error_and_the_next_message_arrives``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from framework import Engine
from framework.messages import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishReason,
    FlushCacheReqInput,
    SchedulerMetrics,
    TokenizedGenerateReqInput,
)
from framework.registry import create_codec

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = ["hello world", "the quick brown fox"]
GARBAGE: list[list[bytes]] = [[b"\x00\xffnot a message"], [b"\x80\x05garbled pickle"], [b""],
                              [b"\x93\x01\x02", b"\x00" * 64]]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Callable[..., Path]) -> Iterator[Engine]:
    # The components as threads of this process, over zmq: the garbage crosses the same
    # sockets as between processes, and what each component drops is logged here, where
    # the test waits for it.
    with Engine(model_path=str(tiny_checkpoint("llama", seed=2)), launch_mode="thread",
                transport="zmq") as eng:
        yield eng


def wrong_messages(channel: str) -> list[Any]:
    """Well-formed messages that do not belong on ``channel``, or whose layout is broken."""
    broken_batch = BatchTokenIDOutput(
        handles=np.array([1_000_001, 1_000_002]), output_ids=np.array([1, 2, 3], dtype=np.int32),
        output_offsets=np.array([0, 5], dtype=np.int32),  # does not cover the requests
        finished_indices=[7],
        finished_reasons=[FinishReason("stop")])
    ragged_text = BatchStrOutput(handles=[1_000_001, 1_000_003], finished_reasons=[None],
                                 output_strs=["x"], output_ids=[[1]], prompt_tokens=[1],
                                 completion_tokens=[1], cached_tokens=[])
    bad_request = TokenizedGenerateReqInput(rid="bad", handle=1_000_004, input_text="",
                                            input_ids=[1, 2],
                                            sampling_params={"not": "params"})  # type: ignore[arg-type]
    by_channel = {
        "scheduler_input": [ragged_text, FlushCacheReqInput(), bad_request],
        "detokenizer_input": [AbortReq(rid="x"), broken_batch],
        "tokenizer_input": [ragged_text, AbortReq(rid="x"), broken_batch],
        "embedding_output": [ragged_text, AbortReq(rid="x")],
        "metrics": [AbortReq(rid="x"), ragged_text],
    }
    return by_channel[channel]


def dropped(caplog: pytest.LogCaptureFixture) -> int:
    """Frames the receivers dropped as undecodable so far."""
    return sum("dropped a frame that did not decode" in r.getMessage() for r in caplog.records)


def send_garbage(engine: Engine, channel: str, caplog: pytest.LogCaptureFixture) -> None:
    """Garbage, then wrong messages, then a last garbage frame, in order on one socket; back
    once the receiver dropped that last frame, so it handled everything before it."""
    transport, address = engine.transport, getattr(engine.port_args, channel)
    codec = create_codec(engine.server_args.codec)
    raw = transport.pipe_sender(address)
    expected = dropped(caplog) + len(GARBAGE) + 1
    try:
        for frames in GARBAGE:
            raw.send_frames_nowait(frames)
        for msg in wrong_messages(channel):
            raw.send_frames_nowait(codec.encode(msg))
        raw.send_frames_nowait(GARBAGE[0])
        deadline = time.monotonic() + 30  # a liveness bound: they arrive at once
        while dropped(caplog) < expected:
            assert time.monotonic() < deadline, f"{channel} dropped {dropped(caplog)} frames"
            time.sleep(0.01)
    finally:
        raw.close()


def test_every_channel_drops_garbage_and_keeps_serving(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="framework.comm")
    before = engine.generate(PROMPTS, GREEDY)
    for channel in ("scheduler_input", "detokenizer_input", "tokenizer_input",
                    "embedding_output", "metrics"):
        send_garbage(engine, channel, caplog)
        after = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before], channel
    info = engine.get_server_info()
    assert info["kv_cache_idle_and_free"] is True
    # The malformed request never ran, and no ghost request was made up.
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0


def test_the_rpc_server_drops_garbage_and_answers_the_next_call(engine: Engine) -> None:
    transport = engine.transport
    raw = transport.rpc_client(engine.port_args.rpc)
    try:
        for frames in GARBAGE:
            with pytest.raises(TimeoutError):  # garbage gets no reply
                raw.call_frames_blocking(frames, timeout=0.5)
    finally:
        raw.close()
    stranger = transport.client(engine.port_args.rpc, create_codec(engine.server_args.codec))
    try:
        reply = stranger.call_blocking(SchedulerMetrics(0, 0, 0, 1, 0.0, 0.0, 0.0, 0.0),
                                       timeout=30)
        assert "unknown RPC request" in reply.message  # a wrong type gets an error reply
    finally:
        stranger.close()
    assert engine.flush_cache().success is True
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 8

