"""What a stranger on the same machine or network can reach: the channel directory is
0700, shared-memory rings and their wake-up FIFOs are 0600 (even under a permissive
umask), and a crafted pickle sent to a tcp channel that did not opt in to pickle is
never unpickled.
"""

from __future__ import annotations

import os
import pickle
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from framework.comm.codec import CodecError
from framework.comm.shm import segment_name
from framework.config import PortArgs
from framework.messages import AbortReq
from framework.registry import create_codec, create_transport


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that would let everyone in, so that only the code's own modes protect."""
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_channel_directory_and_its_sockets_are_private(open_umask: None) -> None:
    transport = create_transport("zmq")
    port_args = PortArgs.create(transport)
    receiver = transport.receiver(port_args.scheduler_input, create_codec("pickle"))
    try:
        assert mode(port_args.workdir) == 0o700
        socket_path = port_args.scheduler_input[len("ipc://"):]
        assert os.path.dirname(socket_path) == port_args.workdir
        assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    finally:
        receiver.close()
        port_args.cleanup()
    assert not os.path.exists(port_args.workdir)


def test_shared_memory_rings_and_fifos_are_owner_only(open_umask: None) -> None:
    transport = create_transport("shm")
    port_args = PortArgs.create(transport)
    before = set(Path("/dev/shm").iterdir())
    receiver = transport.receiver(port_args.detokenizer_input, create_codec("msgpack"))
    server = transport.server(port_args.rpc, create_codec("msgpack"))
    try:
        made = set(Path("/dev/shm").iterdir()) - before
        ring = Path("/dev/shm") / segment_name(port_args.detokenizer_input)
        assert ring in made and len(made) >= 2  # the pipe's ring, and the RPC server's
        assert all(mode(p) == 0o600 for p in made), made
        fifos = [p for p in Path(port_args.workdir).iterdir() if stat.S_ISFIFO(p.stat().st_mode)]
        assert len(fifos) >= 2 and all(mode(p) == 0o600 for p in fifos), fifos
        assert mode(port_args.workdir) == 0o700
    finally:
        receiver.close()
        server.close()
        port_args.cleanup()


class _Planted:
    """Unpickling this writes a file: the proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "unpickled"))


def test_a_crafted_pickle_on_a_tcp_channel_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Planted(marker), protocol=5)
    with pytest.raises(OSError):  # the payload is live: loading it would write the marker
        pickle.loads(pickle.dumps(_Planted(tmp_path / "no-such-dir" / "x")))
    # A tcp channel without --allow-insecure-pickle cannot use pickle at all, so it runs
    # msgpack; the pickle is just undecodable bytes to it.
    transport = create_transport("zmq")
    address = transport.make_address(str(tmp_path), "net", tcp_host="127.0.0.1")
    receiver = transport.receiver(address, create_codec("msgpack"))
    raw = transport.pipe_sender(address)
    good = transport.sender(address, create_codec("msgpack"))
    try:
        raw.send_frames_nowait([payload])
        good.send_nowait(AbortReq(rid="after"))
        got: list[Any] = []
        deadline = time.monotonic() + 30  # a liveness bound only
        while not got and time.monotonic() < deadline:
            try:
                msg = receiver.recv_nowait()
            except CodecError:
                continue  # the pickle: refused as bytes that do not decode
            if msg is not None:
                got.append(msg)
            else:
                time.sleep(0.01)
        assert got == [AbortReq(rid="after")]
    finally:
        for end in (raw, good, receiver):
            end.close()
    assert not marker.exists()
