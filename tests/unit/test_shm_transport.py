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
from framework.comm.shm import receiver as shm_receiver
from framework.comm.shm import sender as shm_sender
from framework.comm.shm.ring import ASLEEP, READ_AT, STATE_AT, WRITE_AT, Ring
from framework.comm.transport import TransportError
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    FlushCacheReqInput,
    GetInfoReqInput,
    GetInfoReqOutput,
    RequestConstants,
    TokenizedGenerateReqInput,
)
from framework.registry import create_codec, create_transport
from framework.sampling_params import SamplingParams
from tests.message_strategies import same

CODECS = ["pickle", "msgpack", "json"]
# A liveness bound only: no test here asserts how fast something happens.
DEADLINE_S = 20.0
# A receiver's safety-net re-check interval that outlasts every deadline: with it, a
# receiver that wakes in time was woken by its sender.
NO_SAFETY_NET_S = 10 * DEADLINE_S


# --------------------------------------------------------------------------- the other process


def _peer_main(conn: Connection) -> None:
    """Run commands from the test process until told to stop; answer each with its outcome."""
    commands = {
        "send": _peer_send,
        "serve": _peer_serve,
        "stream": _peer_stream,
        "count_up": _peer_count_up,
    }
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
    use_async: bool = False,
) -> int:
    """Send ``("msg", message)`` items through a Sender, ``("raw", frames)`` through a raw end.

    Returns how many items were sent.
    """
    transport = ShmTransport(**options)
    raw = transport.pipe_sender(address)
    typed = transport.sender(address, create_codec(codec))

    async def send_all_async() -> None:
        for kind, item in items:
            await (raw.send_frames(item) if kind == "raw" else typed.send(item))

    try:
        if use_async:
            asyncio.run(send_all_async())
        else:
            for kind, item in items:
                if kind == "raw":
                    raw.send_frames_nowait(item)
                else:
                    typed.send_nowait(item)
        return len(items)
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


def _peer_stream(conn: Connection, options: dict[str, Any], address: str, count: int) -> None:
    """Send ``stream_record(0)`` to ``stream_record(count - 1)`` through the async face."""
    sender = ShmTransport(**options).pipe_sender(address)

    async def send_all() -> None:
        for index in range(count):
            await sender.send_frames(stream_record(index))

    try:
        asyncio.run(send_all())
    finally:
        sender.close()


def _peer_count_up(conn: Connection, segment: str) -> int:
    """Store 1, 2, 3, ... into the read position word of ``segment`` until told to stop.

    The test stops it by setting the segment's write position word; the deadline only
    bounds a test that never does.
    """
    ring = Ring.attach(segment, atomic_words=False)
    value = 0
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not ring.load(WRITE_AT) and time.monotonic() < deadline:
            for _ in range(1000):
                value += 1
                ring.store(READ_AT, value)
        return value
    finally:
        ring.close(unlink=False)


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
            rid="g" * 32, handle=3, input_text="hello", input_ids=list(range(300)),
            sampling_params=SamplingParams(temperature=0.7, stop=["\n"]),
        ),
        BatchTokenIDOutput(
            handles=np.array([1], dtype=np.int64), output_ids=np.array([42], dtype=np.int32),
            output_offsets=np.array([0, 1], dtype=np.int32),
            finished_indices=[0], finished_reasons=[FinishReason("length")],
            new_indices=[0], new_constants=[RequestConstants(prompt_tokens=3)],
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


def stream_record(index: int) -> list[Any]:
    """Record ``index`` of a stream: 100 KiB to 1 MiB records of three frames between small ones.

    The float32 frame is a plain memoryview, whose len() counts floats rather than bytes,
    and every other large record ends in an empty frame.
    """
    rng = np.random.default_rng(index)
    if index % 3 == 2:
        return [rng.bytes(int(rng.integers(1, 300)))]
    body = rng.bytes(int(rng.integers(1, 12_000)))
    floats = rng.standard_normal(int(rng.integers(25_600, 262_144)), dtype=np.float32)
    tail = b"" if index % 3 == 1 else index.to_bytes(8, "little")
    return [body, memoryview(floats), tail]


async def receive_stream(receiver: Any, count: int) -> list[int]:
    """Take ``count`` stream records, polling first, then waiting briefly (often cancelled).

    Returns the indices of the records whose frames differ from what was sent.
    """
    wrong = []
    deadline = time.monotonic() + DEADLINE_S
    for index in range(count):
        frames = receiver.recv_frames_nowait()
        while frames is None:
            assert time.monotonic() < deadline, f"record {index} of {count} did not arrive"
            try:
                frames = await asyncio.wait_for(receiver.recv_frames(), 0.002)
            except asyncio.TimeoutError:
                frames = receiver.recv_frames_nowait()
        sent = [memoryview(frame).cast("B") for frame in stream_record(index)]
        if [bytes(frame) for frame in frames] != [bytes(frame) for frame in sent]:
            wrong.append(index)
    return wrong


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


def is_asleep(receiver: Any) -> bool:
    """Whether ``receiver`` (a raw or typed shm receiver) sleeps on its FIFO right now."""
    raw = getattr(receiver, "raw", receiver)
    return bool(raw._ring.load(STATE_AT) & ASLEEP)


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
    style: str, peer: Peer, workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The receiver's safety-net re-checks are pushed past the deadline, and the other
    # process sends only once the receiver sleeps on its FIFO: a message that arrives at all
    # was delivered by the sender's wake-up. For the async face, the send is triggered from
    # the receiver's own event loop, which therefore must keep running while it sleeps; a
    # watchdog thread triggers it at the deadline instead, so a blocked loop fails the test
    # rather than hanging it.
    monkeypatch.setattr(shm_receiver, "_FIRST_WAKE_CHECK_S", NO_SAFETY_NET_S)
    monkeypatch.setattr(shm_receiver, "_LAST_WAKE_CHECK_S", NO_SAFETY_NET_S)
    transport = ShmTransport()
    address = transport.make_address(workdir, "late")
    receiver = transport.receiver(address, create_codec("msgpack"))
    triggered_by: list[str] = []
    lock = threading.Lock()

    def trigger(by: str) -> None:
        with lock:
            if not triggered_by:
                triggered_by.append(by)
                peer.start("send", options={}, address=address, codec="msgpack",
                           items=[("msg", AbortReq(rid="late"))])

    async def trigger_once_asleep() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not is_asleep(receiver):
            assert time.monotonic() < deadline, "the receiver never went to sleep"
            await asyncio.sleep(0.001)
        trigger("loop")

    async def receive_async() -> Any:
        task = asyncio.create_task(trigger_once_asleep())
        try:
            return await asyncio.wait_for(receiver.recv(), 2 * DEADLINE_S)
        finally:
            task.cancel()

    def trigger_from_thread() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not is_asleep(receiver) and time.monotonic() < deadline:
            time.sleep(0.001)
        trigger("thread")

    watchdog = threading.Timer(DEADLINE_S, trigger, args=("watchdog",))
    watchdog.start()
    try:
        if style == "async":
            got = asyncio.run(receive_async())
        else:
            threading.Thread(target=trigger_from_thread, daemon=True).start()
            started = time.monotonic()
            woke = receiver.wait(2 * DEADLINE_S)
            # Ending by its timeout takes the whole timeout; only a wake-up ends it sooner.
            assert woke and time.monotonic() - started < 2 * DEADLINE_S, "no wake-up came"
            got = receiver.recv_nowait()
    finally:
        watchdog.cancel()
    peer.result()
    receiver.close()
    assert got == AbortReq(rid="late")
    if style == "async":
        assert triggered_by == ["loop"], "the event loop was blocked while the receiver slept"
    else:
        assert triggered_by == ["thread"], "the receiver never slept on its FIFO"


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
    # It waits out its connect timeout (a lower bound monotonic time guarantees), then gives
    # up: it does not wait for the default 30 s timeout, nor forever (liveness bound).
    transport = ShmTransport(connect_timeout=0.2)
    sender = transport.sender(transport.make_address(workdir, "nobody"), create_codec("json"))
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"no shm receiver bound .* within 0\.2 s"):
        sender.send_nowait(AbortReq())
    waited = time.monotonic() - started
    assert 0.2 <= waited < DEADLINE_S
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


def test_position_words_are_never_seen_half_written(peer: Peer, workdir: str) -> None:
    # A position word read while another process stores it must hold the old or the new
    # value. A store that clears the word first lets the sender see the read position at 0,
    # reckon more room than the ring has, and overwrite bytes the receiver has not taken.
    # The other process counts up until told to stop; the reads go on until many of them
    # have seen a value being stored meanwhile (the two really overlapped), and a million
    # reads have been made.
    segment = segment_name(f"shm://{workdir}/words")
    ring = Ring.create(segment, 4096, atomic_words=False)
    try:
        peer.start("count_up", segment=segment)
        highest = backwards = reads = fresh = 0
        deadline = time.monotonic() + DEADLINE_S
        while (fresh < 1000 or reads < 1_000_000) and time.monotonic() < deadline:
            for _ in range(1000):
                value = ring.load(READ_AT)
                backwards += value < highest
                fresh += value > highest
                highest = max(highest, value)
            reads += 1000
        ring.store(WRITE_AT, 1)  # stop the counting
        stored = peer.result()
        assert ring.load(READ_AT) == stored
    finally:
        ring.close(unlink=True)
    assert fresh >= 1000, f"only {fresh} reads saw a new value: the processes barely overlapped"
    assert backwards == 0, f"{backwards} of {reads} reads went back"


def test_large_records_stream_intact_through_a_small_ring(peer: Peer, workdir: str) -> None:
    # Records of up to 16 times the ring, between small ones: the sender streams them in
    # chunks, re-reading the read position while the receiver moves it, and the receiver
    # assembles them across polls and async receives that time out (are cancelled) often.
    options = {"ring_bytes": 64 * 1024}
    transport = ShmTransport(**options)
    address = transport.make_address(workdir, "stream")
    receiver = transport.pipe_receiver(address)
    count = 45
    peer.start("stream", options=options, address=address, count=count)
    try:
        wrong = asyncio.run(receive_stream(receiver, count))
    finally:
        receiver.close()  # a sender still waiting for room gives up once the receiver is gone
        status, detail = peer.answer()
    assert wrong == [], f"records {wrong} arrived with other bytes than were sent"
    assert status == "ok", detail
    assert leftovers(workdir, address) == []


def test_a_record_ending_in_an_empty_frame_arrives_in_chunks(workdir: str) -> None:
    # The last chunk of the record ends where its last non-empty frame does: the empty frame
    # after it must not keep the record waiting for bytes that will never come.
    transport = ShmTransport(ring_bytes=4096)
    address = transport.make_address(workdir, "empty-tail")
    receiver = transport.pipe_receiver(address)
    sender = transport.pipe_sender(address)
    record = [os.urandom(20_000), b"", b""]
    thread = threading.Thread(target=sender.send_frames_nowait, args=(record,))
    thread.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        frames = receiver.recv_frames_nowait()
        while frames is None and time.monotonic() < deadline:
            receiver.wait(0.05)
            frames = receiver.recv_frames_nowait()
        thread.join(DEADLINE_S)
    finally:
        sender.close()
        receiver.close()
    assert frames == record


def test_an_async_receiver_is_woken_for_every_chunk_of_a_large_record(
    workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sender wakes a sleeping receiver once per sleep. A receiver that took part of a record
    # must sleep anew, or the later chunks wait for its safety-net timer: pushed past the
    # deadline here, so such a receiver would never get the record. The sender's periodic
    # liveness pokes would hide that, so they are off too. (Sender and receiver are threads
    # of one process, so the cross-process race the safety net covers cannot occur.)
    monkeypatch.setattr(shm_sender, "_LIVENESS_EVERY", 1 << 30)
    monkeypatch.setattr(shm_receiver, "_FIRST_WAKE_CHECK_S", NO_SAFETY_NET_S)
    monkeypatch.setattr(shm_receiver, "_LAST_WAKE_CHECK_S", NO_SAFETY_NET_S)
    transport = ShmTransport(ring_bytes=4096)
    address = transport.make_address(workdir, "chunks")
    receiver = transport.pipe_receiver(address)
    sender = transport.pipe_sender(address)
    record = [os.urandom(12 * 4096)]
    thread = threading.Thread(target=sender.send_frames_nowait, args=(record,))

    async def scenario() -> list[Any]:
        receiving = asyncio.create_task(receiver.recv_frames())
        deadline = time.monotonic() + DEADLINE_S
        while not is_asleep(receiver):  # asleep on the FIFO before the first chunk comes
            assert time.monotonic() < deadline, "the receiver never went to sleep"
            await asyncio.sleep(0.001)
        thread.start()
        return await asyncio.wait_for(receiving, DEADLINE_S)

    try:
        frames = asyncio.run(scenario())
    finally:
        receiver.close()  # a sender still waiting for room gives up once the receiver is gone
        if thread.ident is not None:  # started
            thread.join(DEADLINE_S)
        sender.close()
    assert frames == record
