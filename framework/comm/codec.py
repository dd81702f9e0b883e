"""Codecs: turn a message into frames and back.

``encode(msg)`` returns a list of buffers: frame 0 is the body, the others are
out-of-band buffers (array and tensor payloads) that a transport can send
without copying. ``decode(frames)`` rebuilds the message. A garbled or foreign
frame raises ``CodecError``; a receiver loop catches it and carries on. The
frames handed to ``decode`` belong to the decoded message from then on: its
arrays may be views into them (read-only when a frame is ``bytes``), so a
caller must not reuse or change them.

One codec instance belongs to one channel end and is used from one thread.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Union

import msgspec
import numpy as np

from framework.messages import Message

Buffer = Union[bytes, bytearray, memoryview]  # noqa: UP007 - used at runtime in annotations

# Arrays at least this large travel as their own frame instead of inside the body. Below
# it, copying into the body costs less than a frame: a per-step token batch (a few KiB of
# ids and counts) stays one frame, while embeddings and tensors go out of band.
DEFAULT_OOB_THRESHOLD = 64 * 1024


class CodecError(Exception):
    """A frame could not be decoded (or a message could not be encoded) by a codec."""

    def __init__(self, codec: str, detail: str) -> None:
        super().__init__(f"{codec} codec: {detail}")
        self.codec = codec


class Codec(ABC):
    """Turns messages into frames and back."""

    name: ClassVar[str]
    #: True when decoding can run arbitrary code (pickle): refused on tcp:// by default.
    local_only: ClassVar[bool] = False

    @abstractmethod
    def encode(self, msg: Any) -> list[Buffer]:
        """Frame 0 the body, then out-of-band buffers."""

    @abstractmethod
    def decode(self, frames: Sequence[Buffer]) -> Message:
        """Rebuild a message; raise ``CodecError`` on anything that is not one."""

    def _check(self, obj: Any) -> Message:
        if not isinstance(obj, Message):
            raise CodecError(self.name, f"decoded a {type(obj).__name__}, not a message")
        return obj


def message_union() -> Any:
    """A Union over every ``Message`` subclass defined so far (user messages included)."""
    seen: list[type] = []
    stack = list(Message.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return Union[tuple(seen)]  # noqa: UP007


# --------------------------------------------------------------------------- torch helpers


def _torch() -> Any:
    """The torch module if something already imported it; codecs never import torch."""
    return sys.modules.get("torch")


def _is_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_to_numpy(tensor: Any) -> tuple[np.ndarray, str]:
    """A CPU numpy view of a tensor plus its torch dtype name (bfloat16 goes as int16)."""
    torch = _torch()
    tensor = tensor.detach().cpu().contiguous()
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy(), dtype_name
    return tensor.numpy(), dtype_name


def _numpy_to_tensor(array: np.ndarray, dtype_name: str) -> Any:
    import torch

    if not array.flags.writeable:
        # torch warns on read-only buffers; a received frame is ours alone to use.
        array = np.frombuffer(bytearray(array.tobytes()), dtype=array.dtype).reshape(array.shape)
    tensor = torch.from_numpy(array)
    target = getattr(torch, dtype_name)
    return tensor.view(target) if tensor.dtype != target else tensor


# --------------------------------------------------------------------------- pickle


def _reduce_tensor(tensor: Any) -> tuple[Any, tuple[np.ndarray, str]]:
    """Pickle a tensor through numpy so that its payload can go out of band."""
    return _numpy_to_tensor, _tensor_to_numpy(tensor)


def _array_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small array rebuilt from its bytes (a read-only view of them)."""
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _reducer_of_arrays(oob_threshold: int) -> Any:
    """Pickles arrays under ``oob_threshold`` bytes as their bytes, dtype and shape.

    numpy's own reduction takes about 10 us to pickle an array of a few elements and as
    long to unpickle it (a per-step token batch holds two or three such arrays); bytes
    and a reshape take about one. Larger arrays, and dtypes that are not plain data,
    keep numpy's reduction, whose payload goes out of band.
    """

    def reduce(array: np.ndarray) -> tuple[Any, ...]:
        if array.nbytes >= oob_threshold or array.dtype.hasobject or array.dtype.names:
            return array.__reduce_ex__(5)
        return _array_from_bytes, (array.tobytes(), array.dtype.str, array.shape)

    return reduce


class PickleCodec(Codec):
    """Pickle protocol 5; large array payloads as out-of-band ``PickleBuffer`` frames."""

    name = "pickle"
    local_only = True

    def __init__(self, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> None:
        self.oob_threshold = oob_threshold
        # The reducers by type, made once (and again once torch is imported, for tensors).
        self._dispatch_table: dict[type, Any] | None = None
        self._with_torch = False

    def _reducers(self) -> dict[type, Any]:
        torch = _torch()
        if self._dispatch_table is None or (torch is not None and not self._with_torch):
            table = {**copyreg.dispatch_table,
                     np.ndarray: _reducer_of_arrays(self.oob_threshold)}
            if torch is not None:
                table.update(dict.fromkeys((torch.Tensor, torch.nn.Parameter), _reduce_tensor))
            self._dispatch_table, self._with_torch = table, torch is not None
        return self._dispatch_table

    def encode(self, msg: Any) -> list[Buffer]:
        frames: list[Buffer] = [b""]

        def keep_in_band(buf: pickle.PickleBuffer) -> bool:
            raw = buf.raw()
            if raw.nbytes < self.oob_threshold:
                return True
            frames.append(raw)
            return False

        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=5, buffer_callback=keep_in_band)
        pickler.dispatch_table = self._reducers()
        try:
            pickler.dump(msg)
        except Exception as exc:  # pickling user objects can raise anything
            raise CodecError(self.name, f"cannot encode {type(msg).__name__}: {exc}") from exc
        frames[0] = out.getbuffer()
        return frames

    def decode(self, frames: Sequence[Buffer]) -> Message:
        if not frames:
            raise CodecError(self.name, "no frames")
        try:
            obj = pickle.loads(frames[0], buffers=frames[1:])
        except Exception as exc:  # a garbled pickle can raise anything
            raise CodecError(self.name, f"garbled frame: {exc!r}") from None
        return self._check(obj)


# --------------------------------------------------------------------------- msgspec

_EXT_NDARRAY_OOB = 1
_EXT_NDARRAY_INLINE = 2
_EXT_TENSOR_OOB = 3
_EXT_TENSOR_INLINE = 4
# A small one-dimensional array of a common dtype (the per-step batch arrays): one byte
# naming the dtype, then the raw data. No header to encode or decode, so it costs a few
# tenths of a microsecond each way where the general inline form costs about one.
_EXT_NDARRAY_INLINE_1D = 5

_INLINE_1D_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(name) for name in (
    "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "?"))
_INLINE_1D_PREFIX: dict[np.dtype, bytes] = {
    dtype: bytes([code]) for code, dtype in enumerate(_INLINE_1D_DTYPES)}

_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[str, str, list[int], int])


class MsgpackCodec(Codec):
    """msgspec msgpack; arrays and tensors above a size threshold as zero-copy frames."""

    name = "msgpack"

    def __init__(self, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> None:
        self.oob_threshold = oob_threshold
        self._out: list[Buffer] = []
        self._in: Sequence[Buffer] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        # No dec_hook: every array or tensor comes from ``_ext_hook`` already built, and
        # msgspec checks its type itself; a hook would cost a call per array field.
        self._decoder = msgspec.msgpack.Decoder(message_union(), ext_hook=self._ext_hook)

    def encode(self, msg: Any) -> list[Buffer]:
        self._out = [b""]
        try:
            self._out[0] = self._encoder.encode(msg)
        except Exception as exc:
            raise CodecError(self.name, f"cannot encode {type(msg).__name__}: {exc}") from exc
        frames, self._out = self._out, []
        return frames

    def decode(self, frames: Sequence[Buffer]) -> Message:
        if not frames:
            raise CodecError(self.name, "no frames")
        self._in = frames
        try:
            return self._check(self._decoder.decode(frames[0]))
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(self.name, f"garbled frame: {exc}") from None
        finally:
            self._in = ()

    def _enc_hook(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.ndim == 1 and obj.nbytes < self.oob_threshold:
            prefix = _INLINE_1D_PREFIX.get(obj.dtype)
            if prefix is not None:
                return msgspec.msgpack.Ext(_EXT_NDARRAY_INLINE_1D, prefix + obj.tobytes())
        if _is_tensor(obj):
            array, dtype_name = _tensor_to_numpy(obj)
            return self._array_ext(array, dtype_name, _EXT_TENSOR_OOB, _EXT_TENSOR_INLINE)
        if isinstance(obj, np.ndarray):
            return self._array_ext(obj, "", _EXT_NDARRAY_OOB, _EXT_NDARRAY_INLINE)
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _array_ext(self, array: np.ndarray, tag: str, oob: int, inline: int) -> msgspec.msgpack.Ext:
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # (which would make a 0-d array 1-d)
        if array.nbytes >= self.oob_threshold:
            self._out.append(memoryview(array).cast("B"))
            header = (array.dtype.str, tag, list(array.shape), len(self._out) - 1)
            return msgspec.msgpack.Ext(oob, _header_encoder.encode(header))
        header = _header_encoder.encode((array.dtype.str, tag, list(array.shape), -1))
        payload = len(header).to_bytes(4, "little") + header + array.tobytes()
        return msgspec.msgpack.Ext(inline, payload)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_NDARRAY_INLINE_1D:
            try:
                dtype = _INLINE_1D_DTYPES[data[0]]
            except IndexError:
                raise CodecError(self.name, "unknown inline array dtype") from None
            # A view into the body frame, not a copy: the frames handed to ``decode`` belong
            # to the decoded message (every transport hands over its own ``bytes`` or
            # buffer, never one it reuses), as with the out-of-band arrays. Read-only when
            # the frame is ``bytes``; the view keeps the frame alive.
            # (Positional arguments: numpy parses keywords slowly, a third of the call here.)
            return np.frombuffer(data, dtype, -1, 1)
        if code in (_EXT_NDARRAY_OOB, _EXT_TENSOR_OOB):
            dtype, tag, shape, index = _header_decoder.decode(data)
            array = np.frombuffer(self._in[index], dtype=dtype).reshape(shape)
        elif code in (_EXT_NDARRAY_INLINE, _EXT_TENSOR_INLINE):
            size = int.from_bytes(data[:4], "little")
            dtype, tag, shape, _ = _header_decoder.decode(data[4 : 4 + size])
            array = np.frombuffer(data[4 + size :], dtype=dtype).reshape(shape).copy()
        else:
            raise CodecError(self.name, f"unknown extension type {code}")
        if code in (_EXT_TENSOR_OOB, _EXT_TENSOR_INLINE):
            return _numpy_to_tensor(array, tag)
        return array


def _dec_hook(tp: type, obj: Any) -> Any:
    """Rebuild an array from its JSON form where a field wants an ndarray (JSON only)."""
    if tp is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if isinstance(obj, dict) and {"dtype", "shape", "data"} <= obj.keys():
            return np.asarray(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"])
    if _is_tensor(obj):
        return obj
    raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")


class JsonCodec(Codec):
    """msgspec JSON: one readable frame, arrays as nested lists (no out-of-band frames)."""

    name = "json"

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder(enc_hook=_json_enc_hook)
        self._decoder = msgspec.json.Decoder(message_union(), dec_hook=_dec_hook)

    def encode(self, msg: Any) -> list[Buffer]:
        try:
            return [self._encoder.encode(msg)]
        except Exception as exc:
            raise CodecError(self.name, f"cannot encode {type(msg).__name__}: {exc}") from exc

    def decode(self, frames: Sequence[Buffer]) -> Message:
        if len(frames) != 1:
            raise CodecError(self.name, f"expected 1 frame, got {len(frames)}")
        try:
            return self._check(self._decoder.decode(frames[0]))
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(self.name, f"garbled frame: {exc}") from None


def _json_enc_hook(obj: Any) -> Any:
    if _is_tensor(obj):
        obj = obj.detach().cpu().float().numpy()
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")
