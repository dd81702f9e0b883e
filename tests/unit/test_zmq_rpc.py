"""The zmq RPC client matches each reply to its call: late replies are dropped, not delivered."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from framework.comm.transport import RpcClient, RpcServer
from framework.comm.zmq import ZmqTransport
from framework.messages import FlushCacheReqOutput, UpdateWeightsFromDiskReqInput
from framework.registry import create_codec

_FIRST_CALL_TIMEOUT_S = 0.2  # the client gives up on the first call after this
_LIVENESS_S = 20.0  # a generous bound on anything that should happen at once


@pytest.fixture
def rpc_pair(tmp_path: Path) -> Iterator[tuple[ZmqTransport, str, RpcServer, RpcClient]]:
    transport = ZmqTransport()
    address = transport.make_address(str(tmp_path), "rpc")
    server = transport.server(address, create_codec("msgpack"))
    client = transport.client(address, create_codec("msgpack"))
    yield transport, address, server, client
    client.close()
    server.close()


def _call(name: str) -> UpdateWeightsFromDiskReqInput:
    """A request that carries ``name``, so that its answer can name it back."""
    return UpdateWeightsFromDiskReqInput(model_path=name)


def _answer(msg: Any) -> FlushCacheReqOutput:
    return FlushCacheReqOutput(success=True, message=msg.model_path)


def _next_request(server: RpcServer) -> tuple[Any, Any]:
    deadline = time.monotonic() + _LIVENESS_S
    while time.monotonic() < deadline:
        got = server.recv_nowait()
        if got is not None:
            return got
        time.sleep(0.001)
    raise AssertionError("the server received no request")


def _late_then_prompt_server(server: RpcServer, first_timed_out: threading.Event) -> None:
    """Answer the first call only after the client gave up on it, then the second at once."""
    token, msg = _next_request(server)
    assert first_timed_out.wait(_LIVENESS_S)
    server.reply(token, _answer(msg))
    token, msg = _next_request(server)
    server.reply(token, _answer(msg))


def test_a_blocking_call_after_a_timeout_gets_its_own_reply(rpc_pair: Any) -> None:
    _, _, server, client = rpc_pair
    first_timed_out = threading.Event()
    thread = threading.Thread(target=_late_then_prompt_server, args=(server, first_timed_out))
    thread.start()
    try:
        with pytest.raises(TimeoutError):
            client.call_blocking(_call("first"), timeout=_FIRST_CALL_TIMEOUT_S)
        first_timed_out.set()
        assert client.call_blocking(_call("second"), timeout=_LIVENESS_S) == FlushCacheReqOutput(
            success=True, message="second")
    finally:
        first_timed_out.set()
        thread.join(_LIVENESS_S)


def test_an_async_call_after_a_timeout_gets_its_own_reply(rpc_pair: Any) -> None:
    _, _, server, client = rpc_pair
    first_timed_out = threading.Event()
    thread = threading.Thread(target=_late_then_prompt_server, args=(server, first_timed_out))
    thread.start()

    async def scenario() -> Any:
        with pytest.raises(TimeoutError):
            await client.call(_call("first"), timeout=_FIRST_CALL_TIMEOUT_S)
        first_timed_out.set()
        return await client.call(_call("second"), timeout=_LIVENESS_S)

    try:
        assert asyncio.run(scenario()) == FlushCacheReqOutput(success=True, message="second")
    finally:
        first_timed_out.set()
        thread.join(_LIVENESS_S)


def test_concurrent_async_callers_each_get_their_own_reply(rpc_pair: Any) -> None:
    _, _, server, client = rpc_pair
    names = [f"call-{i}" for i in range(8)]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            got = server.recv_nowait()
            if got is None:
                time.sleep(0.001)
                continue
            server.reply(got[0], _answer(got[1]))

    thread = threading.Thread(target=serve)
    thread.start()

    async def scenario() -> list[Any]:
        return await asyncio.gather(*(client.call(_call(n), timeout=_LIVENESS_S) for n in names))

    try:
        replies = asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(_LIVENESS_S)
    assert [r.message for r in replies] == names


def test_the_server_drops_a_request_without_a_call_id(rpc_pair: Any) -> None:
    transport, address, server, client = rpc_pair
    stranger = transport.context.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(address)
    try:
        stranger.send_multipart([b"not an rpc request"])
        stranger.send_multipart([b"", b"short"])

        def serve_one() -> None:
            token, msg = _next_request(server)
            server.reply(token, _answer(msg))

        thread = threading.Thread(target=serve_one)
        thread.start()
        reply = client.call_blocking(_call("after"), timeout=_LIVENESS_S)
        thread.join(_LIVENESS_S)
        assert reply == FlushCacheReqOutput(success=True, message="after")
    finally:
        stranger.close()


def test_reversed_ends_carry_messages_and_calls_over_curve_tcp() -> None:
    """The front binds a sender and an RPC client; the far Scheduler connects its receiver
    and its RPC server (``PortArgs.front_binds``, a replica on another node)."""
    transport = ZmqTransport()
    push, rpc = (transport.make_address("", name, "127.0.0.1") for name in ("push", "rpc"))
    codec = create_codec("msgpack")
    sender = transport.sender(push, codec, bind=True)
    client = transport.client(rpc, codec, bind=True)
    receiver = transport.receiver(push, codec, bind=False)
    server = transport.server(rpc, codec, bind=False)
    try:
        sender.send_nowait(_call("pushed"))
        assert receiver.wait(_LIVENESS_S)
        assert receiver.recv_nowait() == _call("pushed")

        def answer_one() -> None:
            token, msg = _next_request(server)
            server.reply(token, _answer(msg))

        thread = threading.Thread(target=answer_one)
        thread.start()
        assert client.call_blocking(_call("called"), timeout=_LIVENESS_S) == FlushCacheReqOutput(
            success=True, message="called")
        thread.join(_LIVENESS_S)
    finally:
        for end in (sender, client, receiver, server):
            end.close()


def test_a_transport_without_reversed_ends_says_so() -> None:
    from framework.comm.inproc import InprocTransport
    from framework.comm.transport import TransportError

    with pytest.raises(TransportError, match="the inproc transport cannot bind a sender"):
        InprocTransport().sender("inproc://x", create_codec("msgpack"), bind=True)
