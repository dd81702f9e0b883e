"""The ports one server picks never collide: its HTTP port and its channels' tcp ports."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from framework.comm import zmq as zmq_transport
from framework.config import ServerArgs
from framework.server import serve


class _ProbeOffering:
    """A stand-in for ``socket.socket`` whose bind to port 0 gets the next port of a list."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self, *args: Any) -> _ProbeOffering:
        return self

    def __enter__(self) -> _ProbeOffering:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_free_tcp_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may offer a port again once the probe is closed.
    monkeypatch.setattr(zmq_transport, "_HANDED_OUT", set())
    monkeypatch.setattr(zmq_transport.socket, "socket", _ProbeOffering([40001, 40001, 40002]))
    assert [zmq_transport.free_tcp_port(), zmq_transport.free_tcp_port()] == [40001, 40002]


def test_the_http_port_is_bound_before_the_components_pick_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    bound: list[socket.socket] = []

    def listening_socket(host: str, port: int) -> socket.socket:
        order.append("http port")
        bound.append(socket.socket())
        return bound[-1]

    class Components:
        def __init__(self, server_args: ServerArgs) -> None:
            order.append("channel ports")
            raise RuntimeError("stop here")

    monkeypatch.setattr(serve, "listening_socket", listening_socket)
    monkeypatch.setattr(serve, "ComponentTree", Components)
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(serve._serve(ServerArgs(model_path="/m", port=0)))
    assert order == ["http port", "channel ports"]
    assert bound[0].fileno() == -1  # closed when start-up failed
