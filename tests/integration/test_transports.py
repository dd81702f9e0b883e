"""Every transport carries every codec across real processes (inproc: across threads)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from framework.comm.codec import CodecError
from framework.comm.transport import InsecureChannelError, Transport, TransportError
from framework.config import PortArgs
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInfoReqInput,
    GetInfoReqOutput,
    RequestConstants,
    TokenizedGenerateReqInput,
)
from framework.registry import create_codec, create_transport
from framework.sampling_params import SamplingParams
from tests.message_strategies import same

CODECS = ["pickle", "msgpack", "json"]
# (transport name, use tcp) pairs whose ends live in two processes.
CROSS_PROCESS = [("zmq", False), ("zmq", True), ("shm", False)]


def sample_messages() -> list[Any]:
    """A few messages of each family, one of them with out-of-band arrays."""
    rng = np.random.default_rng(1)
    return [
        TokenizedGenerateReqInput(
            rid="a" * 32, handle=7, input_text="hello", input_ids=list(range(500)),
            sampling_params=SamplingParams(temperature=0.5, stop=["\n"]),
        ),
        BatchTokenIDOutput(
            handles=np.array([1, 2], dtype=np.int64),
            output_ids=np.array([5, 7, 8], dtype=np.int32),
            output_offsets=np.array([0, 1, 3], dtype=np.int32),
            finished_indices=[1], finished_reasons=[FinishReason("length")],
            new_indices=[0], new_constants=[RequestConstants(stop_strs=["\n"], prompt_tokens=10)],
        ),
        BatchTokenIDOutput(  # as many ids for each request: no offsets
            handles=np.array([3, 4, 5], dtype=np.int64),
            output_ids=np.array([9, 10, 11, 12, 13, 14], dtype=np.int32),
        ),
        BatchEmbeddingOutput(
            rids=["e1", "e2"], finished_reasons=[FinishReason("stop")] * 2,
            embeddings=rng.standard_normal((2, 8192), dtype=np.float32),
            prompt_tokens=[4, 5],
        ),
        AbortReq(rid="r9"),
    ]


def echo_child(transport: Transport, addresses: dict[str, tuple[str, str, str]],
               ready: Any) -> None:
    """Echo every message back on its codec's channel; answer RPCs; stop on abort_all."""
    ends = []
    for codec, (inbound, outbound, rpc) in addresses.items():
        receiver = transport.receiver(inbound, create_codec(codec))
        server = transport.server(rpc, create_codec(codec))
        ends.append((receiver, server, outbound, codec))
    ready.set()
    senders = {codec: transport.sender(out, create_codec(codec)) for _, _, out, codec in ends}
    live = len(ends)
    while live:
        for receiver, server, _, codec in ends:
            for msg in receiver.drain():
                if isinstance(msg, AbortReq) and msg.abort_all:
                    live -= 1
                senders[codec].send_nowait(msg)
            request = server.recv_nowait()
            if request is not None:
                token, msg = request
                reply = FlushCacheReqOutput(success=True, message=type(msg).__name__)
                server.reply(token, reply)
    for receiver, server, _, codec in ends:
        receiver.close()
        server.close()
        senders[codec].close()


def _address_set(transport: Transport, workdir: str, tcp: bool) -> dict[str, tuple[str, ...]]:
    host = "127.0.0.1" if tcp else None
    return {
        codec: tuple(transport.make_address(workdir, f"{codec}-{kind}", host)
                     for kind in ("in", "out", "rpc"))
        for codec in CODECS
    }


@pytest.fixture
def workdir(tmp_path: Any) -> Iterator[str]:
    path = tmp_path / "ch"
    path.mkdir(mode=0o700)
    yield str(path)


def _run_exchange(transport: Transport, addresses: dict[str, tuple[str, ...]],
                  start_peer: Any) -> None:
    receivers = {c: transport.receiver(a[1], create_codec(c)) for c, a in addresses.items()}
    ready = start_peer()
    senders = {c: transport.sender(a[0], create_codec(c)) for c, a in addresses.items()}
    clients = {c: transport.client(a[2], create_codec(c)) for c, a in addresses.items()}
    try:
        for codec in CODECS:
            messages = sample_messages()
            for msg in messages:
                senders[codec].send_nowait(msg)

            async def collect(codec: str = codec, n: int = len(messages)) -> list[Any]:
                return [await asyncio.wait_for(receivers[codec].recv(), 20) for _ in range(n)]

            echoed = asyncio.run(collect())
            assert all(same(a, b) for a, b in zip(echoed, messages)), codec
            reply = clients[codec].call_blocking(GetInfoReqInput(), timeout=20)
            assert reply == FlushCacheReqOutput(success=True, message="GetInfoReqInput")
    finally:
        for codec in CODECS:
            senders[codec].send_nowait(AbortReq(abort_all=True))
        ready.join()
        for end in (*receivers.values(), *senders.values(), *clients.values()):
            end.close()


@pytest.mark.parametrize(
    ("transport_name", "tcp"), CROSS_PROCESS, ids=["zmq-ipc", "zmq-tcp", "shm"]
)
def test_transport_carries_every_codec_across_processes(
    transport_name: str, tcp: bool, workdir: str
) -> None:
    transport = create_transport(transport_name, allow_insecure_pickle=tcp)
    addresses = _address_set(transport, workdir, tcp)
    ctx = mp.get_context("spawn")

    def start_peer() -> Any:
        ready = ctx.Event()
        proc = ctx.Process(target=echo_child, args=(transport, addresses, ready), daemon=True)
        proc.start()
        assert ready.wait(60), "child did not bind its channels"
        return proc

    _run_exchange(transport, addresses, start_peer)
    assert not os.listdir(workdir), "socket or wake-up files survived close()"


def test_inproc_transport_carries_every_codec_across_threads(workdir: str) -> None:
    transport = create_transport("inproc")
    addresses = _address_set(transport, workdir, tcp=False)

    def start_peer() -> threading.Thread:
        ready = threading.Event()
        thread = threading.Thread(target=echo_child, args=(transport, addresses, ready))
        thread.start()
        assert ready.wait(10)
        return thread

    _run_exchange(transport, addresses, start_peer)
    assert transport.hub.addresses() == []


@pytest.mark.parametrize("transport_name", ["zmq", "inproc", "shm"])
def test_recv_nowait_on_an_empty_channel_returns_none(transport_name: str, workdir: str) -> None:
    transport = create_transport(transport_name)
    address = transport.make_address(workdir, "empty")
    receiver = transport.receiver(address, create_codec("msgpack"))
    server = transport.server(transport.make_address(workdir, "rpc"), create_codec("msgpack"))
    try:
        assert receiver.recv_nowait() is None
        assert receiver.drain() == []
        assert server.recv_nowait() is None
    finally:
        receiver.close()
        server.close()


def _token_batch(seed: int, size: int) -> BatchTokenIDOutput:
    rng = np.random.default_rng(seed)
    return BatchTokenIDOutput(
        handles=rng.integers(0, 2**40, size, dtype=np.int64),
        output_ids=rng.integers(0, 2**31 - 1, size, dtype=np.int32),
        output_token_logprobs=rng.standard_normal(size, dtype=np.float32))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("transport_name", ["zmq", "inproc", "shm"])
def test_received_batches_stay_intact_while_later_ones_arrive(
    transport_name: str, codec: str, workdir: str
) -> None:
    """Decoded arrays may be views into the received frames: no transport may reuse them.

    Several batches are in flight before the first is read, and every one is checked
    after the last arrived: small ones (bytes frames) and ones of over 64 KiB (shm's
    bytearray frames, zmq's zero-copy frames), each array still inline (under 64 KiB).
    """
    transport = create_transport(transport_name)
    address = transport.make_address(workdir, "batches")
    receiver = transport.receiver(address, create_codec(codec))
    sender = transport.sender(address, create_codec(codec))
    sent = [_token_batch(seed, size) for seed, size in enumerate([256, 7000, 1, 256, 7000])]

    async def scenario() -> list[Any]:
        for msg in sent:
            await sender.send(msg)
        return [await asyncio.wait_for(receiver.recv(), 20) for _ in sent]

    try:
        got = asyncio.run(scenario())
    finally:
        receiver.close()
        sender.close()
    assert all(same(a, b) for a, b in zip(got, sent))
    assert [m.id_lists() for m in got] == [m.id_lists() for m in sent]


@pytest.mark.parametrize("transport_name", ["zmq", "inproc", "shm"])
def test_receiver_survives_garbled_frames(transport_name: str, workdir: str) -> None:
    transport = create_transport(transport_name)
    address = transport.make_address(workdir, "garbled")
    receiver = transport.receiver(address, create_codec("msgpack"))
    raw = transport.pipe_sender(address)
    good = transport.sender(address, create_codec("msgpack"))

    async def scenario() -> None:
        raw.send_frames_nowait([b"\x00garbage\xff"])
        with pytest.raises(CodecError, match="msgpack"):
            await asyncio.wait_for(receiver.recv(), 10)
        await good.send(AbortReq(rid="after"))
        assert await asyncio.wait_for(receiver.recv(), 10) == AbortReq(rid="after")
        # A poll loop's drain() skips the garbage and keeps the good message.
        raw.send_frames_nowait([b"\x01\x02"])
        good.send_nowait(AbortReq(rid="drained"))
        got: list[Any] = []
        for _ in range(200):
            got += receiver.drain()
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [AbortReq(rid="drained")]

    try:
        asyncio.run(scenario())
    finally:
        for end in (receiver, raw, good):
            end.close()


def test_pickle_over_tcp_is_refused_without_opt_in(workdir: str) -> None:
    transport = create_transport("zmq")
    address = transport.make_address(workdir, "net", tcp_host="127.0.0.1")
    with pytest.raises(InsecureChannelError, match="--allow-insecure-pickle"):
        transport.receiver(address, create_codec("pickle"))
    with pytest.raises(InsecureChannelError):
        transport.sender(address, create_codec("pickle"))
    # msgpack over tcp is fine, and so is pickle once allowed.
    transport.receiver(address, create_codec("msgpack")).close()
    allowed = create_transport("zmq", allow_insecure_pickle=True)
    other = allowed.make_address(workdir, "net2", tcp_host="127.0.0.1")
    allowed.receiver(other, create_codec("pickle")).close()


def test_pickle_over_ipc_needs_no_opt_in(workdir: str) -> None:
    transport = create_transport("zmq")
    address = transport.make_address(workdir, "local")
    receiver = transport.receiver(address, create_codec("pickle"))
    sender = transport.sender(address, create_codec("pickle"))
    sent = _token_batch(seed=1, size=16)

    async def scenario() -> Any:
        await sender.send(sent)
        return await asyncio.wait_for(receiver.recv(), 20)

    try:
        got = asyncio.run(scenario())
    finally:
        receiver.close()
        sender.close()
    assert same(got, sent)


def test_a_transport_refuses_foreign_address_schemes(workdir: str) -> None:
    with pytest.raises(TransportError, match="does not serve"):
        create_transport("inproc").receiver("ipc:///tmp/x", create_codec("msgpack"))
    with pytest.raises(TransportError, match="tcp"):
        create_transport("inproc").make_address(workdir, "x", tcp_host="127.0.0.1")


def test_port_args_make_a_private_directory_and_remove_it() -> None:
    transport = create_transport("zmq")
    port_args = PortArgs.create(transport)
    assert os.stat(port_args.workdir).st_mode & 0o777 == 0o700
    addresses = [getattr(port_args, name) for name in PortArgs.CHANNELS]
    assert len(set(addresses)) == len(addresses)
    assert all(a.startswith(f"ipc://{port_args.workdir}/") for a in addresses)
    receiver = transport.receiver(port_args.scheduler_input, create_codec("pickle"))
    receiver.close()
    port_args.cleanup()
    assert not os.path.exists(port_args.workdir)


def test_port_args_tcp_addresses_are_distinct_free_ports() -> None:
    port_args = PortArgs.create(create_transport("zmq"), tcp_host="127.0.0.1")
    try:
        addresses = [getattr(port_args, name) for name in PortArgs.CHANNELS]
        assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
        assert len(set(addresses)) == len(addresses)
    finally:
        port_args.cleanup()


def test_rpc_async_call_and_flush_reply(workdir: str) -> None:
    transport = create_transport("zmq")
    address = transport.make_address(workdir, "rpc")
    server = transport.server(address, create_codec("msgpack"))
    client = transport.client(address, create_codec("msgpack"))

    async def scenario() -> None:
        async def answer() -> None:
            token, msg = await server.recv()
            assert isinstance(msg, FlushCacheReqInput)
            server.reply(token, GetInfoReqOutput(info={"ok": True}))

        task = asyncio.create_task(answer())
        assert await client.call(FlushCacheReqInput(), timeout=10) == GetInfoReqOutput(
            info={"ok": True}
        )
        await task

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        client.close()
