"""A codec plugin: msgpack with the body compressed by zlib (arrays stay out of band).

Installed with ``pip install examples/plugins/zlib_codec``, it registers itself
through the ``framework.codecs`` entry point and is used by name:
``framework serve --codec zlib-msgpack``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from framework.comm.codec import Buffer, Codec, CodecError, MsgpackCodec
from framework.messages import Message


class ZlibMsgpackCodec(Codec):
    """msgpack frames with frame 0 (the body) zlib-compressed."""

    name = "zlib-msgpack"

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._inner = MsgpackCodec()

    def encode(self, msg: Message) -> list[Buffer]:
        frames = self._inner.encode(msg)
        return [zlib.compress(frames[0], self.level), *frames[1:]]

    def decode(self, frames: Sequence[Buffer]) -> Message:
        if not frames:
            raise CodecError(self.name, "no frames")
        try:
            body = zlib.decompress(frames[0])
        except zlib.error as exc:
            raise CodecError(self.name, f"garbled frame: {exc}") from None
        return self._inner.decode([body, *frames[1:]])
