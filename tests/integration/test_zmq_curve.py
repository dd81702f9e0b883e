"""``tcp://`` channels are authenticated with ZMQ CURVE: strangers are never heard.

A stranger is a plain zmq socket in its own context: one with no keys, one
with a fresh keypair that knows the server's public key (only the ZAP
check on client keys stops it), and one with a fresh keypair and a wrong
server key. For each, the test waits until the stranger's own socket
reports that its handshake failed (a liveness bound), then checks that
nothing reached the receiver or the RPC server, and that an authenticated
peer still gets through.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from framework.comm import zmq as zmq_transport
from framework.comm.transport import RpcServer
from framework.comm.zmq import CurveError, ZmqTransport
from framework.messages import AbortReq, FlushCacheReqOutput, GetInfoReqInput
from framework.registry import create_codec
from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import start_server

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

_LIVENESS_S = 20.0  # generous: how long a handshake may take to end, on a loaded machine
_QUIET_S = 1.0  # how long nothing must arrive after the stranger's handshake failed
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH}
STRANGERS = ["no-keys", "wrong-client-key", "wrong-server-key"]


@pytest.fixture
def transport() -> ZmqTransport:
    return ZmqTransport()


@pytest.fixture
def tcp_address(transport: ZmqTransport, tmp_path: Path) -> str:
    return transport.make_address(str(tmp_path), "net", tcp_host="127.0.0.1")


@pytest.fixture
def stranger_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _stranger(context: zmq.Context, kind: int, who: str, transport: ZmqTransport) -> zmq.Socket:
    """A socket that is not one of ``transport``'s ends, with the keys ``who`` names."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if who != "no-keys":
        public, secret = zmq.curve_keypair()
        assert transport.curve_keys is not None
        server_key = transport.curve_keys.server_public if who == "wrong-client-key" else public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_key
    return sock


def _send_and_await_refusal(sock: zmq.Socket, address: str, frames: list[bytes]) -> None:
    """Connect ``sock``, queue ``frames`` on it, and wait until its handshake has failed.

    The frames wait in the stranger's queue, to go out if a handshake ever succeeds.
    """
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        deadline = time.monotonic() + _LIVENESS_S
        while time.monotonic() < deadline:
            if not monitor.poll(100):
                continue
            event = recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a stranger completed a handshake"
            if event in _HANDSHAKE_FAILED:
                return
        raise AssertionError("the stranger's handshake neither failed nor succeeded")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def _stays_quiet(poll: Any) -> bool:
    """Whether ``poll()`` keeps returning ``None`` for ``_QUIET_S``."""
    deadline = time.monotonic() + _QUIET_S
    while time.monotonic() < deadline:
        if poll() is not None:
            return False
        time.sleep(0.01)
    return True


def _recv_within(poll: Any) -> Any:
    """The first value ``poll()`` returns other than ``None``, within the liveness bound."""
    deadline = time.monotonic() + _LIVENESS_S
    while time.monotonic() < deadline:
        got = poll()
        if got is not None:
            return got
        time.sleep(0.005)
    raise AssertionError("nothing arrived")


# --------------------------------------------------------------------------- the good path


def test_authenticated_ends_exchange_messages_and_rpcs_over_tcp(
    transport: ZmqTransport, tcp_address: str, tmp_path: Path
) -> None:
    codec = create_codec("msgpack")
    receiver = transport.receiver(tcp_address, codec)
    # The child's copy: what a spawned component unpickles.
    child = pickle.loads(pickle.dumps(transport))
    sender = child.sender(tcp_address, create_codec("msgpack"))
    rpc_address = transport.make_address(str(tmp_path), "rpc", tcp_host="127.0.0.1")
    server = child.server(rpc_address, create_codec("msgpack"))
    client = transport.client(rpc_address, create_codec("msgpack"))
    thread = threading.Thread(target=_answer_one, args=(server,))
    thread.start()
    try:
        sender.send_nowait(AbortReq(rid="over-tcp"))
        assert _recv_within(receiver.recv_nowait) == AbortReq(rid="over-tcp")
        assert client.call_blocking(GetInfoReqInput(), timeout=_LIVENESS_S) == (
            FlushCacheReqOutput(success=True, message="GetInfoReqInput"))
    finally:
        thread.join(_LIVENESS_S)
        for end in (sender, receiver, client, server):
            end.close()


def _answer_one(server: RpcServer) -> None:
    token, msg = _recv_within(server.recv_nowait)
    server.reply(token, FlushCacheReqOutput(success=True, message=type(msg).__name__))


# --------------------------------------------------------------------------- strangers


@pytest.mark.parametrize("who", STRANGERS)
def test_a_stranger_cannot_push_to_a_tcp_receiver(
    who: str, transport: ZmqTransport, tcp_address: str, stranger_context: zmq.Context
) -> None:
    receiver = transport.receiver(tcp_address, create_codec("msgpack"))
    stranger = _stranger(stranger_context, zmq.PUSH, who, transport)
    sender = transport.sender(tcp_address, create_codec("msgpack"))
    abort_all = [bytes(f) for f in create_codec("msgpack").encode(AbortReq(abort_all=True))]
    try:
        _send_and_await_refusal(stranger, tcp_address, abort_all)
        assert _stays_quiet(receiver.recv_nowait)
        # The receiver still hears its own peers, and only them.
        sender.send_nowait(AbortReq(rid="friend"))
        assert _recv_within(receiver.recv_nowait) == AbortReq(rid="friend")
        assert receiver.recv_nowait() is None
    finally:
        for end in (stranger, sender, receiver):
            end.close()


@pytest.mark.parametrize("who", STRANGERS)
def test_a_stranger_gets_no_answer_from_a_tcp_rpc_server(
    who: str, transport: ZmqTransport, tmp_path: Path, stranger_context: zmq.Context
) -> None:
    address = transport.make_address(str(tmp_path), "rpc", tcp_host="127.0.0.1")
    server = transport.server(address, create_codec("msgpack"))
    stranger = _stranger(stranger_context, zmq.DEALER, who, transport)
    client = transport.client(address, create_codec("msgpack"))
    request = [b"", (1).to_bytes(8, "little"),
               *(bytes(f) for f in create_codec("msgpack").encode(GetInfoReqInput()))]
    try:
        _send_and_await_refusal(stranger, address, request)
        assert _stays_quiet(server.recv_nowait), "the server received a stranger's request"
        assert not stranger.poll(0), "a stranger got a reply"
        # An authenticated client is still answered.
        thread = threading.Thread(target=_answer_one, args=(server,))
        thread.start()
        reply = client.call_blocking(GetInfoReqInput(), timeout=_LIVENESS_S)
        thread.join(_LIVENESS_S)
        assert reply == FlushCacheReqOutput(success=True, message="GetInfoReqInput")
        assert server.recv_nowait() is None
    finally:
        for end in (stranger, client, server):
            end.close()


def test_another_transports_ends_are_strangers(
    transport: ZmqTransport, tcp_address: str
) -> None:
    receiver = transport.receiver(tcp_address, create_codec("msgpack"))
    other = ZmqTransport().sender(tcp_address, create_codec("msgpack"))
    try:
        other.send_nowait(AbortReq(abort_all=True))
        assert _stays_quiet(receiver.recv_nowait)
    finally:
        other.close()
        receiver.close()


# --------------------------------------------------------------------------- key files


def test_transports_sharing_a_key_dir_talk_and_others_do_not(tmp_path: Path) -> None:
    key_dir = tmp_path / "keys"
    key_dir.mkdir(mode=0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(key_dir, name)
    node_a = ZmqTransport(curve_key_dir=str(key_dir))
    node_b = ZmqTransport(curve_key_dir=str(key_dir))
    assert node_a.curve_keys == node_b.curve_keys
    address = node_a.make_address(str(tmp_path), "net", tcp_host="127.0.0.1")
    receiver = node_a.receiver(address, create_codec("msgpack"))
    sender = node_b.sender(address, create_codec("msgpack"))
    try:
        sender.send_nowait(AbortReq(rid="from-b"))
        assert _recv_within(receiver.recv_nowait) == AbortReq(rid="from-b")
    finally:
        sender.close()
        receiver.close()


def test_a_key_dir_without_the_key_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CurveError, match=r"server\.key_secret"):
        ZmqTransport(curve_key_dir=str(tmp_path))


# --------------------------------------------------------------------------- no CURVE


def test_without_curve_tcp_is_refused_and_ipc_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_transport, "curve_available", lambda: False)
    transport = ZmqTransport()
    assert transport.curve_keys is None
    with pytest.raises(CurveError, match="CURVE") as refused:
        transport.make_address(str(tmp_path), "net", tcp_host="127.0.0.1")
    assert isinstance(refused.value, ValueError)  # the CLI prints ValueErrors as one line
    with pytest.raises(CurveError):
        transport.receiver("tcp://127.0.0.1:1", create_codec("msgpack"))
    transport.receiver(transport.make_address(str(tmp_path), "local"),
                       create_codec("msgpack")).close()


def test_serve_use_tcp_without_curve_fails_with_one_line() -> None:
    script = ("import sys, framework.comm.zmq as z; z.curve_available = lambda: False; "
              "from framework.cli import main; "
              "sys.exit(main(['serve', '--use-tcp', '--codec', 'msgpack', '--port', '1']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "CURVE" in lines[0] and lines[0].startswith("framework: error:"), \
        done.stderr


# --------------------------------------------------------------------------- the server


@pytest.mark.slow
def test_serve_over_authenticated_tcp(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=1)
    server = start_server(model, tmp_path, "--use-tcp", "--codec", "msgpack")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            done = http.post("/v1/completions", json={
                "prompt": "hello world", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["completion_tokens"] == 4
            info = http.get("/get_server_info")  # an RPC to the Scheduler over tcp
            assert info.status_code == 200, info.text
        children = server.children()
        assert children
    finally:
        assert server.stop() == 0, server.log()
    # The children's authenticator threads do not keep them alive after shutdown.
    deadline = time.monotonic() + _LIVENESS_S
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_curve_key_dir_reaches_the_runtime_s_transport(tmp_path: Path) -> None:
    from framework.config import ServerArgs
    from framework.registry import create_transport
    from framework.runtime.launch import transport_options

    key_dir = tmp_path / "keys"
    key_dir.mkdir(mode=0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(key_dir, name)
    args = ServerArgs(use_tcp=True, curve_key_dir=str(key_dir))
    transport = create_transport("zmq", **transport_options(args))
    assert transport.curve_keys == ZmqTransport(curve_key_dir=str(key_dir)).curve_keys
    with pytest.raises(ValueError, match="curve_key_dir is for the zmq transport"):
        transport_options(args.replace(transport="shm"))
