"""The shared-memory transport, across real (spawned) processes where it matters."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from framework.comm.codec import CodecError
from framework.comm.shm import ShmTransport, segment_name
from framework.comm.transport import TransportError
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    FlushCacheReqInput,
    GetInfoReqInput,
    GetInfoReqOutput,
    TokenizedGenerateReqInput,
)
from framework.registry import create_codec, create_transport
from framework.sampling_params import SamplingParams
from tests.message_strategies import same

CODECS = ["pickle", "msgpack", "json"]
DEADLINE_S = 20.0


# --------------------------------------------------------------------------- the other process


def _peer_main(conn: Connection) -> None:
    """Run commands from the test process until told to stop; answer each with its outcome."""
    commands = {"send": _peer_send, "serve": _peer_serve}
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        try:
            conn.send(("ok", commands[command](conn, **args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _peer_send(
    conn: Connection,
    options: dict[str, Any],
    address: str,
    codec: str,
    items: list[tuple[str, Any]],
    delay: float = 0.0,
    use_async: bool = False,
) -> float:
    """Send ``("msg", message)`` items through a Sender, ``("raw", frames)`` through a raw end.

    Returns the wall-clock time of the first send.
    """
    transport = ShmTransport(**options)
    raw = transport.pipe_sender(address)
    typed = transport.sender(address, create_codec(codec))

    async def send_all_async() -> None:
        for kind, item in items:
            await (raw.send_frames(item) if kind == "raw" else typed.send(item))

    try:
        time.sleep(delay)
        sent_at = time.time()
        if use_async:
            asyncio.run(send_all_async())
        else:
            for kind, item in items:
                if kind == "raw":
                    raw.send_frames_nowait(item)
                else:
                    typed.send_nowait(item)
        return sent_at
    finally:
        raw.close()
        typed.close()


def _peer_serve(
    conn: Connection, options: dict[str, Any], address: str, codec: str, calls: int
) -> None:
    """Bind an RPC server, say so, and answer ``calls`` requests."""
    server = ShmTransport(**options).server(address, create_codec(codec))
    conn.send(("bound", None))

    async def serve() -> None:
        for index in range(calls):
            token, request = await asyncio.wait_for(server.recv(), DEADLINE_S)
            server.reply(token, GetInfoReqOutput(info={"request": type(request).__name__,
                                                       "index": index}))

    try:
        asyncio.run(serve())
    finally:
        server.close()


class Peer:
    """The test's handle on the other process."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def start(self, command: str, **args: Any) -> None:
        self.conn.send((command, args))

    def answer(self) -> tuple[str, Any]:
        assert self.conn.poll(DEADLINE_S), "the peer process did not answer"
        return self.conn.recv()

    def result(self) -> Any:
        status, value = self.answer()
        assert status == "ok", value
        return value


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_peer_main, args=(theirs,), daemon=True)
    process.start()
    try:
        yield Peer(ours)
    finally:
        ours.send(("stop", {}))
        process.join(10)
        if process.is_alive():
            process.kill()


@pytest.fixture
def workdir(tmp_path: Any) -> str:
    path = tmp_path / "ch"
    path.mkdir(mode=0o700)
    return str(path)


# --------------------------------------------------------------------------- helpers


def sample_messages() -> list[Any]:
    """A few message families; the embeddings are 64 KiB of float32 (an out-of-band frame)."""
    rng = np.random.default_rng(7)
    return [
        TokenizedGenerateReqInput(
            rid="g" * 32, input_text="hello", input_ids=list(range(300)),
            sampling_params=SamplingParams(temperature=0.7, stop=["\n"]),
        ),
        BatchTokenIDOutput(
            rids=["r1"], finished_reasons=[FinishReason("length")], output_ids=[[42]],
            skip_special_tokens=[True], spaces_between_special_tokens=[True],
            no_stop_trim=[False], prompt_tokens=[3], completion_tokens=[1], cached_tokens=[0],
        ),
        BatchEmbeddingOutput(
            rids=[f"e{i}" for i in range(4)], finished_reasons=[FinishReason("stop")] * 4,
            embeddings=rng.standard_normal((4, 4096), dtype=np.float32),
            prompt_tokens=[5, 6, 7, 8],
        ),
        GetInfoReqOutput(info={"model": "tiny", "max_total_tokens": 4096, "ratio": 0.5}),
        AbortReq(rid="r9"),
    ]


def big_embedding(total_bytes: int) -> BatchEmbeddingOutput:
    rng = np.random.default_rng(3)
    n = 4
    return BatchEmbeddingOutput(
        rids=[f"b{i}" for i in range(n)], finished_reasons=[None] * n,
        embeddings=rng.standard_normal((n, total_bytes // 4 // n), dtype=np.float32),
        prompt_tokens=[1] * n,
    )


async def recv_all(receiver: Any, count: int) -> list[Any]:
    return [await asyncio.wait_for(receiver.recv(), DEADLINE_S) for _ in range(count)]


def poll_all(receiver: Any, count: int) -> list[Any]:
    """Receive like a scheduler's poll loop: drain, then sleep on wait()."""
    got: list[Any] = receiver.drain()
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages arrived"
        receiver.wait(0.1)
        got += receiver.drain()
    return got


def leftovers(workdir: str, *addresses: str) -> list[str]:
    """Files and shared memory segments that a closed channel should not have left."""
    segments = [f"/dev/shm/{segment_name(a)}" for a in addresses]
    return os.listdir(workdir) + [s for s in segments if os.path.exists(s)]


# --------------------------------------------------------------------------- tests


def test_addresses_are_local_paths_and_tcp_is_refused(workdir: str) -> None:
    transport = create_transport("shm")
    assert isinstance(transport, ShmTransport)
    assert transport.make_address(workdir, "chan") == f"shm://{workdir}/chan"
    with pytest.raises(TransportError, match="tcp"):
        transport.make_address(workdir, "chan", tcp_host="127.0.0.1")
    with pytest.raises(TransportError, match="does not serve"):
        transport.receiver(f"ipc://{workdir}/x", create_codec("msgpack"))
    with pytest.raises(ValueError, match="ring_bytes"):
        ShmTransport(ring_bytes=8)
    a, b = transport.make_address(workdir, "a"), transport.make_address(workdir, "b")
    assert segment_name(a) != segment_name(b)


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_carries_messages_across_processes(
    codec: str, peer: Peer, workdir: str
) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "in")
    receiver = transport.receiver(address, create_codec(codec))
    messages = sample_messages()
    peer.start("send", options={}, address=address, codec=codec,
               items=[("msg", m) for m in messages])
    got = asyncio.run(recv_all(receiver, len(messages)))
    peer.result()
    receiver.close()
    assert all(same(a, b) for a, b in zip(got, messages, strict=True))
    assert leftovers(workdir, address) == []


@pytest.mark.parametrize(
    ("atomic_words", "use_async"), [(False, False), (True, True)], ids=["plain", "atomic-async"]
)
def test_order_is_kept_through_a_small_wrapping_ring(
    atomic_words: bool, use_async: bool, peer: Peer, workdir: str
) -> None:
    # 4 KiB of ring for ~60 KiB of records of varied sizes: it wraps at many offsets, and the
    # sender keeps finding it full.
    options = {"ring_bytes": 4096, "atomic_words": atomic_words}
    transport = ShmTransport(**options)
    address = transport.make_address(workdir, "ordered")
    receiver = transport.receiver(address, create_codec("msgpack"))
    messages = [AbortReq(rid=f"{i}:" + "x" * (i % 97)) for i in range(1000)]
    peer.start("send", options=options, address=address, codec="msgpack",
               items=[("msg", m) for m in messages], use_async=use_async)
    got = poll_all(receiver, len(messages))
    peer.result()
    receiver.close()
    assert got == messages
    assert leftovers(workdir, address) == []


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_larger_than_the_ring_arrives_in_chunks(
    codec: str, peer: Peer, workdir: str
) -> None:
    options = {"ring_bytes": 64 * 1024}
    transport = ShmTransport(**options)
    address = transport.make_address(workdir, "large")
    receiver = transport.receiver(address, create_codec(codec))
    large = big_embedding(256 * 1024)  # four times the ring
    after = AbortReq(rid="after")
    peer.start("send", options=options, address=address, codec=codec,
               items=[("msg", large), ("msg", after)])
    got = asyncio.run(recv_all(receiver, 2))
    peer.result()
    receiver.close()
    assert same(got[0], large)
    assert got[1] == after


def test_recv_nowait_on_an_empty_channel_returns_none(workdir: str) -> None:
    transport = ShmTransport()
    receiver = transport.receiver(transport.make_address(workdir, "empty"), create_codec("json"))
    try:
        assert receiver.recv_nowait() is None
        assert receiver.raw.recv_frames_nowait() is None
        assert receiver.drain() == []
        assert receiver.wait(0.02) is False
    finally:
        receiver.close()


@pytest.mark.parametrize("style", ["async", "poll"])
def test_a_sleeping_receiver_is_woken_by_the_sender(
    style: str, peer: Peer, workdir: str
) -> None:
    # After 0.6 s asleep the receiver re-checks the ring only every 250 ms, so a message that
    # arrives within 0.1 s was delivered by the FIFO wake-up, not by the safety net.
    transport = ShmTransport()
    address = transport.make_address(workdir, "late")
    receiver = transport.receiver(address, create_codec("msgpack"))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def receive() -> Any:
        task = asyncio.create_task(ticker())
        try:
            return await asyncio.wait_for(receiver.recv(), DEADLINE_S)
        finally:
            task.cancel()

    peer.start("send", options={}, address=address, codec="msgpack",
               items=[("msg", AbortReq(rid="late"))], delay=0.6)
    got = asyncio.run(receive()) if style == "async" else poll_all(receiver, 1)[0]
    arrived_at = time.time()
    sent_at = peer.result()
    receiver.close()
    assert got == AbortReq(rid="late")
    assert arrived_at - sent_at < 0.1
    if style == "async":
        assert ticks >= 20, "the event loop was blocked while the receiver waited"


def test_rpc_round_trips_across_processes(peer: Peer, workdir: str) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "rpc")
    peer.start("serve", options={}, address=address, codec="msgpack", calls=3)
    assert peer.answer() == ("bound", None)
    client = transport.client(address, create_codec("msgpack"))
    replies = [client.call_blocking(GetInfoReqInput(), timeout=DEADLINE_S) for _ in range(2)]
    replies.append(asyncio.run(client.call(FlushCacheReqInput(), timeout=DEADLINE_S)))
    peer.result()
    client.close()
    assert replies == [
        GetInfoReqOutput(info={"request": "GetInfoReqInput", "index": 0}),
        GetInfoReqOutput(info={"request": "GetInfoReqInput", "index": 1}),
        GetInfoReqOutput(info={"request": "FlushCacheReqInput", "index": 2}),
    ]
    assert leftovers(workdir, f"{address}.req", f"{address}.rep") == []


def test_close_removes_the_segment_and_the_fifo(workdir: str) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "tidy")
    receiver = transport.pipe_receiver(address)
    sender = transport.pipe_sender(address)
    sender.send_frames_nowait([b"x"])
    assert sorted(leftovers(workdir, address)) == sorted(
        ["tidy", f"/dev/shm/{segment_name(address)}"]
    )
    assert receiver.recv_frames_nowait() == [b"x"]
    sender.close()
    receiver.close()
    receiver.close()  # closing twice is harmless
    assert leftovers(workdir, address) == []


@pytest.mark.parametrize("codec", CODECS)
def test_garbled_frames_raise_codec_error_and_the_next_message_arrives(
    codec: str, peer: Peer, workdir: str
) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "garbled")
    receiver = transport.receiver(address, create_codec(codec))
    good = AbortReq(rid="good")
    peer.start("send", options={}, address=address, codec=codec,
               items=[("raw", [b"\x00garbage\xff"]), ("msg", good)])

    async def scenario() -> Any:
        with pytest.raises(CodecError, match=codec):
            await asyncio.wait_for(receiver.recv(), DEADLINE_S)
        return await asyncio.wait_for(receiver.recv(), DEADLINE_S)

    assert asyncio.run(scenario()) == good
    peer.result()
    receiver.close()


def test_a_second_sending_process_is_refused_until_the_first_closes(
    peer: Peer, workdir: str
) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "spsc")
    receiver = transport.receiver(address, create_codec("msgpack"))
    ours = transport.sender(address, create_codec("msgpack"))
    ours.send_nowait(AbortReq(rid="ours"))
    items = [("msg", AbortReq(rid="theirs"))]
    peer.start("send", options={}, address=address, codec="msgpack", items=items)
    status, detail = peer.answer()
    assert status == "error"
    assert "another process is sending" in detail
    ours.close()
    peer.start("send", options={}, address=address, codec="msgpack", items=items)
    peer.result()
    got = poll_all(receiver, 2)
    receiver.close()
    assert got == [AbortReq(rid="ours"), AbortReq(rid="theirs")]


def test_senders_of_one_process_share_the_channel(workdir: str) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "shared")
    receiver = transport.receiver(address, create_codec("msgpack"))
    first = transport.sender(address, create_codec("msgpack"))
    second = ShmTransport().sender(address, create_codec("msgpack"))
    try:
        first.send_nowait(AbortReq(rid="1"))
        second.send_nowait(AbortReq(rid="2"))
        first.close()
        second.send_nowait(AbortReq(rid="3"))
        assert poll_all(receiver, 3) == [AbortReq(rid=r) for r in "123"]
    finally:
        second.close()
        receiver.close()


def test_a_sender_without_a_receiver_times_out(workdir: str) -> None:
    transport = ShmTransport(connect_timeout=0.2)
    sender = transport.sender(transport.make_address(workdir, "nobody"), create_codec("json"))
    started = time.monotonic()
    with pytest.raises(TransportError, match="no shm receiver"):
        sender.send_nowait(AbortReq())
    assert time.monotonic() - started < 5
    sender.close()


def test_sending_to_a_closed_receiver_raises(workdir: str) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "gone")
    receiver = transport.receiver(address, create_codec("msgpack"))
    sender = transport.sender(address, create_codec("msgpack"))
    sender.send_nowait(AbortReq())
    receiver.close()
    with pytest.raises(TransportError, match="closed"):
        sender.send_nowait(AbortReq())
    with pytest.raises(TransportError, match="closed"):
        receiver.recv_nowait()
    sender.close()


def test_binding_an_address_twice_is_refused(workdir: str) -> None:
    transport = ShmTransport()
    address = transport.make_address(workdir, "twice")
    receiver = transport.pipe_receiver(address)
    try:
        with pytest.raises(TransportError, match="already bound"):
            transport.pipe_receiver(address)
        sender = transport.pipe_sender(address)
        sender.send_frames_nowait([b"still works"])
        assert receiver.recv_frames_nowait() == [b"still works"]
        sender.close()
    finally:
        receiver.close()


def test_a_cancelled_async_send_still_finishes_its_record(workdir: str) -> None:
    # Half a record would corrupt the stream: the record after it must still parse.
    transport = ShmTransport(ring_bytes=4096)
    address = transport.make_address(workdir, "cancel")
    receiver = transport.pipe_receiver(address)
    sender = transport.pipe_sender(address)
    large = [os.urandom(20_000)]
    received: list[list[bytes]] = []

    def drain_in_thread() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while len(received) < 2 and time.monotonic() < deadline:
            frames = receiver.recv_frames_nowait()
            if frames is None:
                receiver.wait(0.05)
            else:
                received.append([bytes(f) for f in frames])

    async def scenario() -> None:
        task = asyncio.create_task(sender.send_frames(large))
        await asyncio.sleep(0.05)
        assert not task.done(), "the record should be waiting for room in the ring"
        thread = threading.Thread(target=drain_in_thread)
        thread.start()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sender.send_frames([b"next"])
        await asyncio.to_thread(thread.join)

    try:
        asyncio.run(scenario())
    finally:
        sender.close()
        receiver.close()
    assert received == [large, [b"next"]]
