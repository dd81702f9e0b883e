"""Per-step outputs name requests by handle; the rid travels once and still reaches the client.

A real TokenizerManager, Scheduler (on the fake model runner) and Detokenizer,
chained by hand in one event loop: every ``BatchTokenIDOutput`` and
``BatchStrOutput`` is checked on the wire (encoded by each codec) for rid
strings, and every output the client sees for the rid it gave.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from framework.config import PortArgs, ServerArgs
from framework.messages import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    TokenizedGenerateReqInput,
)
from framework.model_facts import ModelFacts
from framework.registry import create_codec, create_transport
from framework.runtime.detokenizer import Detokenizer
from framework.runtime.tokenizer_manager import GenerateRequest, TokenizerManager
from framework.sampling_params import SamplingParams
from tests.fake_worker import SchedulerHarness
from tests.model_fixtures import TINY_VOCAB_SIZE, make_tiny_tokenizer

DEADLINE_S = 20.0
NEW_TOKENS = 6
# Distinctive rids, so that finding their bytes in a frame cannot be a coincidence.
RIDS = [f"client-rid-{name}-0123456789abcdef" for name in ("alpha", "beta", "gamma")]


def _wire(msg: Any) -> list[bytes]:
    """``msg`` as each codec puts it on the wire, every frame as bytes."""
    return [bytes(frame) for name in ("msgpack", "pickle", "json")
            for frame in create_codec(name).encode(msg)]


async def _all(outputs: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [out async for out in outputs]


def _manager(port_args: PortArgs | list[PortArgs], transport: Any) -> TokenizerManager:
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="inproc", codec="msgpack"),
                          port_args, transport, tokenizer=None,
                          model=ModelFacts(context_len=256, vocab_size=TINY_VOCAB_SIZE,
                                           is_embedding=False, hidden_size=32))
    return tm


def test_outputs_carry_handles_only_and_the_rid_still_reaches_the_client() -> None:
    harness = SchedulerHarness()
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = _manager(port_args, transport)
    inbox = transport.receiver(port_args.scheduler_input, create_codec("msgpack"))
    detokenizer = Detokenizer(make_tiny_tokenizer())
    batches: list[BatchTokenIDOutput] = []
    texts: list[BatchStrOutput] = []

    async def scenario() -> tuple[list[TokenizedGenerateReqInput], list[list[dict[str, Any]]]]:
        tm.start()
        try:
            clients = [asyncio.create_task(_all(tm.generate(GenerateRequest(
                input_ids=[3 + i, 4, 5, 6], rid=rid, stream=True,
                sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                               temperature=0.0)))))
                for i, rid in enumerate(RIDS)]
            requests = [await asyncio.wait_for(inbox.recv(), DEADLINE_S) for _ in RIDS]
            for request in requests:
                harness.send(request)  # the TokenizerManager's message, as it was sent
            for _ in range(100):
                if all(client.done() for client in clients):
                    break
                harness.scheduler.step()
                for batch in harness.from_scheduler.drain():
                    batches.append(batch)
                    texts.append(detokenizer.handle_batch(batch))
                    tm.handle_output(texts[-1])
                await asyncio.sleep(0)
            return requests, [await asyncio.wait_for(c, DEADLINE_S) for c in clients]
        finally:
            await tm.close()
            inbox.close()

    try:
        requests, outputs = asyncio.run(scenario())
    finally:
        harness.close()
        port_args.cleanup()

    # Each request carries its rid once, with a handle of its own.
    assert all(isinstance(r, TokenizedGenerateReqInput) for r in requests)
    assert [r.rid for r in requests] == RIDS
    handles = [r.handle for r in requests]
    assert all(type(h) is int for h in handles) and len(set(handles)) == len(RIDS)
    # Every per-step output names requests by those handles, and no rid is on the wire.
    assert "rids" not in BatchTokenIDOutput.__struct_fields__
    assert "rids" not in BatchStrOutput.__struct_fields__
    decode_steps = [b for b in batches if len(b.handles) == len(RIDS) and not b.new_indices]
    assert decode_steps, "no decode step ran all the requests together"
    for batch, text in zip(batches, texts):
        assert batch.handles.dtype == np.int64 and set(batch.handles.tolist()) <= set(handles)
        assert text.handles == batch.handles.tolist()
        for frame in _wire(batch) + _wire(text):
            assert not any(rid.encode() in frame for rid in RIDS), "a rid went out per step"
    # The client sees its own rid in every output, and all of its tokens.
    for rid, outs in zip(RIDS, outputs):
        assert outs, f"{rid} got no output"
        assert all(out.meta_info["id"] == rid for out in outs)
        assert len(outs[-1].output_ids) == NEW_TOKENS
        assert outs[-1].meta_info["finish_reason"]["type"] == "length"
    assert tm.rid_to_state == {} and tm.handle_to_state == {}


def test_an_output_for_a_released_handle_is_dropped() -> None:
    """A rid reused after its request ended gets a new handle: late outputs miss it."""
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = _manager(port_args, transport)

    async def scenario() -> None:
        first = tm.requests.register("same", 2)
        tm.requests.release("same", first, reached=False)
        second = tm.requests.register("same", 2)
        assert second.handle != first.handle
        tm.handle_output(BatchStrOutput(
            handles=[first.handle], finished_reasons=[None], output_strs=["stale"],
            output_ids=[[7]], prompt_tokens=[2], completion_tokens=[1], cached_tokens=[0]))
        assert second.text == "" and not second.chunks
        tm.requests.release("same", second, reached=False)

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(tm.close())
        port_args.cleanup()


@pytest.mark.parametrize("dp_size", [2, 3])
def test_handles_are_unique_across_replicas_and_aborts_still_go_by_rid(dp_size: int) -> None:
    transport = create_transport("inproc")
    port_args = [PortArgs.create(transport) for _ in range(dp_size)]
    tm = _manager(port_args, transport)
    inboxes = [transport.receiver(p.scheduler_input, create_codec("msgpack")) for p in port_args]
    count = 2 * dp_size

    async def scenario() -> dict[str, tuple[int, TokenizedGenerateReqInput]]:
        tm.start()
        got: dict[str, tuple[int, TokenizedGenerateReqInput]] = {}
        clients = [asyncio.create_task(tm.generate_one(GenerateRequest(
            input_ids=[3, 4], rid=f"r{i}", sampling_params=SamplingParams(max_new_tokens=1))))
            for i in range(count)]
        try:
            for _ in range(int(DEADLINE_S * 1000)):
                for index, inbox in enumerate(inboxes):
                    while (msg := inbox.recv_nowait()) is not None:
                        got[msg.rid] = (index, msg)
                if len(got) == count:
                    break
                await asyncio.sleep(0.001)
            tm.abort_nowait("r1", "stop r1")
            for _ in range(int(DEADLINE_S * 1000)):
                abort = inboxes[got["r1"][0]].recv_nowait()
                if abort is not None:
                    assert isinstance(abort, AbortReq) and abort.rid == "r1"
                    break
                await asyncio.sleep(0.001)
            else:
                raise AssertionError("the abort never reached r1's replica")
        finally:
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            await tm.close()
            for inbox in inboxes:
                inbox.close()
        return got

    try:
        got = asyncio.run(scenario())
    finally:
        for p in port_args:
            p.cleanup()
    assert len(got) == count
    assert len({index for index, _ in got.values()}) == dp_size  # spread over every replica
    handles = [msg.handle for _, msg in got.values()]
    assert len(set(handles)) == count  # one counter for every replica
