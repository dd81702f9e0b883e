"""The TokenizerManager's bookkeeping when sends fail, and its aborts on a full channel.

The Scheduler and the Detokenizer are played by the test over the inproc
transport (or shm, where a full ring matters), so each case controls exactly
what arrives and when.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from framework.comm.codec import Buffer, Codec, CodecError
from framework.comm.shm import ShmTransport
from framework.comm.transport import Frames, PipeSender, TransportError
from framework.config import PortArgs, ServerArgs
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FinishReason,
    Message,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from framework.model_facts import ModelFacts
from framework.registry import create_codec, create_transport
from framework.runtime import tokenizer_manager as tm_module
from framework.runtime.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager
from framework.sampling_params import SamplingParams
from framework.server.app import ServerState, build_app

CODEC = "msgpack"
# A liveness bound only: every wait below ends as soon as what it waits for happens.
DEADLINE_S = 20.0


# --------------------------------------------------------------------------- fakes


class FailingCodec(Codec):
    """The manager's codec, except that encoding the ``fail_at``-th request raises."""

    name = "failing"

    def __init__(self, inner: Codec, kind: type[Message], fail_at: int = 1) -> None:
        self.inner = inner
        self.kind = kind
        self.fail_at = fail_at
        self.seen = 0

    def encode(self, msg: Any) -> list[Buffer]:
        if isinstance(msg, self.kind):
            self.seen += 1
            if self.seen == self.fail_at:
                raise CodecError(self.name, f"cannot encode request {self.seen}")
        return self.inner.encode(msg)

    def decode(self, frames: Any) -> Message:
        return self.inner.decode(frames)


class FailingPipe(PipeSender):
    """A raw sender that raises ``TransportError`` on its ``fail_at``-th send, else passes on."""

    def __init__(self, inner: PipeSender, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.sends = 0

    def send_frames_nowait(self, frames: Frames) -> None:
        self.sends += 1
        if self.sends == self.fail_at:
            raise TransportError("the channel broke halfway through a message")
        self.inner.send_frames_nowait(frames)

    def close(self) -> None:
        self.inner.close()


class FakeRuntime:
    """Plays the Scheduler (it reads what the manager sends) and the Detokenizer."""

    def __init__(self, transport: Any, port_args: PortArgs) -> None:
        self.inbox = transport.receiver(port_args.scheduler_input, create_codec(CODEC))
        self.outputs = transport.sender(port_args.tokenizer_input, create_codec(CODEC))
        # Each request's handle, as the Scheduler keeps it: outputs name requests by it.
        self.handles: dict[str, int] = {}

    async def next(self) -> Message:
        """The next message the manager sent."""
        msg = await asyncio.wait_for(self.inbox.recv(), DEADLINE_S)
        if isinstance(msg, TokenizedGenerateReqInput):
            self.handles[msg.rid] = msg.handle
        return msg

    async def requests(self, count: int) -> list[Message]:
        return [await self.next() for _ in range(count)]

    def finish(self, rid: str, text: str = " done") -> None:
        """Answer ``rid`` with one last piece of text."""
        self.outputs.send_nowait(BatchStrOutput(
            handles=[self.handles[rid]], finished_reasons=[FinishReason("length")],
            output_strs=[text],
            output_ids=[[7]], prompt_tokens=[2], completion_tokens=[1], cached_tokens=[0]))

    def close(self) -> None:
        self.inbox.close()
        self.outputs.close()


@pytest.fixture
def inproc() -> Iterator[tuple[TokenizerManager, FakeRuntime]]:
    """A manager over inproc with the test as its Scheduler and Detokenizer."""
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="inproc", codec=CODEC),
                          port_args, transport, tokenizer=None,
                          model=ModelFacts(context_len=64, vocab_size=100,
                                           is_embedding=False, hidden_size=32))
    runtime = FakeRuntime(transport, port_args)
    yield tm, runtime
    runtime.close()
    port_args.cleanup()


def _request(rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=[3, 4], rid=rid,
                           sampling_params=SamplingParams(max_new_tokens=1))


async def _until(condition: Any) -> None:
    """Yield to the loop until ``condition()`` holds (bounded only as a liveness limit)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


# --------------------------------------------------------------------------- a failed send


def test_a_request_that_fails_to_encode_leaves_no_state_and_frees_its_rid(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    tm, runtime = inproc
    tm.send_to_scheduler.codec = FailingCodec(tm.send_to_scheduler.codec,
                                              TokenizedGenerateReqInput)

    async def scenario() -> dict[str, Any]:
        tm.start()
        try:
            with pytest.raises(CodecError, match="cannot encode request 1"):
                await tm.generate_one(_request("mine"))
            assert tm.rid_to_state == {}
            # The same rid is free again, and nothing (not even an abort) went out for the
            # request that never left.
            retry = asyncio.create_task(tm.generate_one(_request("mine")))
            sent = await runtime.next()
            assert isinstance(sent, TokenizedGenerateReqInput)
            assert sent.rid == "mine"
            runtime.finish("mine")
            return await asyncio.wait_for(retry, DEADLINE_S)
        finally:
            await tm.close()

    out = asyncio.run(scenario())
    assert out.text == " done"
    assert tm.rid_to_state == {}


def test_a_request_whose_send_breaks_is_aborted_and_forgotten(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    # Part of a message may have gone out: the request is aborted in the Scheduler, ahead
    # of the retry that reuses its rid, and the manager keeps no state for it.
    tm, runtime = inproc
    tm.send_to_scheduler.raw = FailingPipe(tm.send_to_scheduler.raw, fail_at=1)

    async def scenario() -> list[Message]:
        tm.start()
        try:
            with pytest.raises(TransportError, match="broke"):
                await tm.generate_one(_request("mine"))
            assert tm.rid_to_state == {}
            retry = asyncio.create_task(tm.generate_one(_request("mine")))
            got = await runtime.requests(2)
            runtime.finish("mine")
            await asyncio.wait_for(retry, DEADLINE_S)
            return got
        finally:
            await tm.close()

    abort, request = asyncio.run(scenario())
    assert isinstance(abort, AbortReq)
    assert abort.rid == "mine"
    assert isinstance(request, TokenizedGenerateReqInput)
    assert request.rid == "mine"
    assert tm.rid_to_state == {}


def test_an_embedding_that_fails_to_send_leaves_no_state(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    tm, _ = inproc
    tm.model = msgspec.structs.replace(tm.model, is_embedding=True)
    tm.send_to_scheduler.codec = FailingCodec(tm.send_to_scheduler.codec,
                                              TokenizedEmbeddingReqInput)

    async def scenario() -> None:
        tm.start()
        try:
            with pytest.raises(CodecError):
                await tm.embed(input_ids=[3, 4])
        finally:
            await tm.close()

    asyncio.run(scenario())
    assert tm.rid_to_state == {}


def test_an_embedding_the_scheduler_aborts_raises_instead_of_returning_none(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    tm, runtime = inproc
    tm.model = msgspec.structs.replace(tm.model, is_embedding=True)

    async def scenario() -> None:
        tm.start()
        try:
            task = asyncio.create_task(tm.embed(input_ids=[3, 4]))
            sent = await runtime.next()
            assert isinstance(sent, TokenizedEmbeddingReqInput)
            # An aborted batch carries no embedding columns.
            runtime.outputs.send_nowait(BatchEmbeddingOutput(
                rids=[sent.rid], embeddings=np.zeros((1, 0), dtype=np.float32),
                finished_reasons=[FinishReason("abort", message="the prompt is empty")],
                prompt_tokens=[2]))
            with pytest.raises(RequestError, match="aborted: the prompt is empty"):
                await asyncio.wait_for(task, DEADLINE_S)
        finally:
            await tm.close()

    asyncio.run(scenario())
    assert tm.rid_to_state == {}


def test_each_kind_of_request_is_refused_by_the_other_kind_of_model(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    tm, _ = inproc

    async def scenario() -> None:
        tm.model = msgspec.structs.replace(tm.model, is_embedding=False)
        with pytest.raises(RequestError, match="does not serve embeddings"):
            await tm.embed(input_ids=[3, 4])
        tm.model = msgspec.structs.replace(tm.model, is_embedding=True)
        with pytest.raises(RequestError, match="not text generation"):
            await tm.prepare(_request())

    asyncio.run(scenario())
    assert tm.rid_to_state == {}


# --------------------------------------------------------------------------- fan-out


def test_a_part_that_fails_after_its_siblings_were_sent_aborts_them(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    # /v1/completions with two prompts and n=2: four requests. The third send breaks after
    # two went out; every part that was sent must be aborted (not left to generate for
    # nobody), and the client gets an error rather than a hang.
    tm, runtime = inproc
    tm.send_to_scheduler.raw = FailingPipe(tm.send_to_scheduler.raw, fail_at=3)
    app = build_app(ServerState(tokenizer_manager=tm, server_args=tm.server_args,
                                model_name="tiny", model_path="unused", model=tm.model))
    body = {"prompt": [[3, 4], [5, 6]], "n": 2, "max_tokens": 32, "ignore_eos": True}

    def every_sent_part_aborted(got: list[Message]) -> bool:
        sent = {m.rid for m in got if isinstance(m, TokenizedGenerateReqInput)}
        return bool(sent) and sent <= {m.rid for m in got if isinstance(m, AbortReq)}

    async def scenario() -> tuple[httpx.Response, list[Message]]:
        tm.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                response = await asyncio.wait_for(
                    client.post("/v1/completions", json=body), DEADLINE_S)
            got: list[Message] = []
            while not every_sent_part_aborted(got):
                got.append(await runtime.next())
            return response, got
        finally:
            await tm.close()

    response, got = asyncio.run(scenario())
    assert response.status_code == 500, response.text
    assert "broke" in response.json()["error"]["message"]
    assert sum(isinstance(m, TokenizedGenerateReqInput) for m in got) >= 2
    assert tm.rid_to_state == {}


# --------------------------------------------------------------------------- a full shm ring


def _filler(transport: ShmTransport) -> tuple[AbortReq, int]:
    """A message and the ring size that it fills exactly (a record: counts, lengths, bytes)."""
    msg = AbortReq(rid="filler", reason="x" * 64)
    frames = create_codec(CODEC).encode(msg)
    return msg, 8 * (1 + len(frames)) + sum(memoryview(f).nbytes for f in frames)


@pytest.fixture
def shm_manager() -> Iterator[tuple[TokenizerManager, Any, AbortReq]]:
    """A manager over shm whose Scheduler ring (bound, never read by the manager) is tiny."""
    transport = ShmTransport()
    port_args = PortArgs.create(transport)
    filler, ring_bytes = _filler(transport)
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="shm", codec=CODEC),
                          port_args, transport, tokenizer=None)
    scheduler_in = ShmTransport(ring_bytes=ring_bytes).receiver(port_args.scheduler_input,
                                                                create_codec(CODEC))
    yield tm, scheduler_in, filler
    scheduler_in.close()
    port_args.cleanup()


def _read_when_told(receiver: Any, go: threading.Event, started: threading.Event,
                    count: int, got: list[Message]) -> None:
    """Read ``count`` messages once ``go`` is set (or the deadline passes: a liveness bound)."""
    go.wait(DEADLINE_S)
    started.set()
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count and time.monotonic() < deadline:
        got.extend(receiver.drain(count - len(got)))
        receiver.wait(0.05)


def test_abort_nowait_on_a_full_shm_ring_returns_at_once_and_goes_out_later(
    shm_manager: tuple[TokenizerManager, Any, AbortReq],
) -> None:
    tm, scheduler_in, filler = shm_manager
    go, started = threading.Event(), threading.Event()
    got: list[Message] = []
    # Started now, it reads only when told; its deadline frees a manager that blocks
    # (the bug) so that the test fails instead of hanging.
    reader = threading.Thread(target=_read_when_told,
                              args=(scheduler_in, go, started, 3, got), daemon=True)

    async def scenario() -> None:
        tm.start()
        try:
            tm.send_to_scheduler.send_nowait(filler)  # the ring is full now
            reader.start()
            tm.abort_nowait("a")
            tm.abort_nowait("b")
            assert not started.is_set(), "abort_nowait waited for room in the ring"
            for _ in range(100):  # the loop runs on while the aborts wait for room
                await asyncio.sleep(0)
            assert tm.outbox.pending == 2
            go.set()
            await asyncio.to_thread(reader.join, DEADLINE_S)
            await _until(lambda: tm.outbox.pending == 0)
        finally:
            await tm.close()

    asyncio.run(scenario())
    assert [type(m) for m in got] == [AbortReq] * 3
    assert [m.rid for m in got] == ["filler", "a", "b"]  # type: ignore[attr-defined]


def test_close_drops_aborts_that_cannot_go_out(
    shm_manager: tuple[TokenizerManager, Any, AbortReq],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # Nobody ever reads the full ring: close() gives the abort its flush time, then drops
    # it with a log line instead of waiting for room forever.
    monkeypatch.setattr(tm_module, "CLOSE_FLUSH_S", 0.05)
    tm, _, filler = shm_manager

    async def scenario() -> None:
        tm.start()
        tm.send_to_scheduler.send_nowait(filler)
        tm.abort_nowait("a")
        await asyncio.sleep(0)
        await asyncio.wait_for(tm.close(), DEADLINE_S)
        tm.abort_nowait("late")  # after close: dropped, never raised

    asyncio.run(scenario())
    assert tm.outbox.pending == 0
    assert "dropped on close" in caplog.text


def test_aborts_and_requests_leave_in_the_order_they_were_handed_over(
    inproc: tuple[TokenizerManager, FakeRuntime],
) -> None:
    # An abort queued before a retry that reuses the rid must reach the Scheduler first,
    # or it would abort the retry.
    tm, runtime = inproc

    async def scenario() -> list[Message]:
        tm.start()
        try:
            tm.abort_nowait("x")
            tm.abort_nowait("y")
            retry = asyncio.create_task(tm.generate_one(_request("x")))
            got = await runtime.requests(3)
            runtime.finish("x")
            await asyncio.wait_for(retry, DEADLINE_S)
            return got
        finally:
            await tm.close()

    got = asyncio.run(scenario())
    assert [(type(m).__name__, m.rid) for m in got] == [  # type: ignore[attr-defined]
        ("AbortReq", "x"), ("AbortReq", "y"), ("TokenizedGenerateReqInput", "x")]



class _RecordingChatTokenizer:
    """A tokenizer whose chat template records the thread it runs on."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def apply_chat_template(self, conversation: list[dict[str, Any]], **options: Any
                            ) -> list[int]:
        self.threads.append(threading.current_thread())
        return [len(m["content"]) % 100 for m in conversation]


@pytest.mark.parametrize("size, on_loop", [(10, True), (5000, False)])
def test_a_long_chat_is_templated_off_the_event_loop(
        inproc: tuple[TokenizerManager, FakeRuntime], size: int, on_loop: bool) -> None:
    tm, _ = inproc
    tokenizer = tm.tokenizer = _RecordingChatTokenizer()
    chat = [{"role": "user", "content": "x" * size}]
    ids = asyncio.run(tm.chat_prompt_ids(chat))
    assert ids == [size % 100]
    assert (tokenizer.threads == [threading.main_thread()]) is on_loop


def test_a_tokenizer_without_a_chat_template_is_a_request_error(
        inproc: tuple[TokenizerManager, FakeRuntime]) -> None:
    tm, _ = inproc
    tm.tokenizer = SimpleNamespace(chat_template=None)
    with pytest.raises(RequestError, match="has no chat template"):
        asyncio.run(tm.chat_prompt_ids([{"role": "user", "content": "hi"}]))
