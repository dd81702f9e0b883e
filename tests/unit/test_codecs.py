"""Every message type round-trips through every codec; bad frames give CodecError."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework.comm.codec import CodecError, MsgpackCodec, PickleCodec
from framework.messages import (
    MESSAGE_TYPES,
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    Message,
)
from framework.registry import CODECS, create_codec
from tests.message_strategies import same, struct_strategy, token_id_outputs

CODEC_NAMES = ["pickle", "msgpack", "json"]


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(
    codec_name: str, message_type: type, data: st.DataObject
) -> None:
    msg = data.draw(struct_strategy(message_type))
    codec = create_codec(codec_name)
    decoded = codec.decode(codec.encode(msg))
    assert same(decoded, msg)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=token_id_outputs())
def test_token_batches_keep_their_layout(codec_name: str, msg: BatchTokenIDOutput) -> None:
    """Flat ids, offsets, NaN logprob placeholders and sparse fields all come back as sent."""
    codec = create_codec(codec_name)
    decoded = codec.decode(codec.encode(msg))
    assert same(decoded, msg)
    assert decoded.output_ids.dtype == np.int32
    assert decoded.id_lists() == msg.id_lists()
    assert decoded.finished_reason_list() == msg.finished_reason_list()
    for i in range(len(msg.handles)):
        assert decoded.logprobs_of(i) == msg.logprobs_of(i)
        assert decoded.top_logprobs_of(i) == msg.top_logprobs_of(i)


def _embedding_output(n: int, dim: int) -> BatchEmbeddingOutput:
    rng = np.random.default_rng(0)
    return BatchEmbeddingOutput(
        rids=[f"r{i}" for i in range(n)],
        finished_reasons=[FinishReason("stop")] * n,
        embeddings=rng.standard_normal((n, dim), dtype=np.float32),
        prompt_tokens=[3] * n,
    )


@pytest.mark.parametrize("codec_cls", [PickleCodec, MsgpackCodec])
def test_large_arrays_travel_out_of_band_without_copies(codec_cls: type) -> None:
    msg = _embedding_output(32, 1024)
    frames = codec_cls().encode(msg)
    assert len(frames) == 2  # the body, then the 128 KiB array as one frame
    assert memoryview(frames[1]).nbytes == 32 * 1024 * 4
    # Zero-copy on both sides: the frame is a view of the array, and the decoded array a view
    # of the frame.
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), msg.embeddings)
    decoded = codec_cls().decode(frames)
    assert np.shares_memory(decoded.embeddings, np.frombuffer(frames[1], dtype=np.float32))
    assert same(decoded, msg)


@pytest.mark.parametrize("codec_cls", [PickleCodec, MsgpackCodec])
def test_small_arrays_stay_in_the_body(codec_cls: type) -> None:
    msg = _embedding_output(3, 4)
    frames = codec_cls().encode(msg)
    assert len(frames) == 1
    assert same(codec_cls().decode(frames), msg)


class ArrayCarrier(Message):
    """A user message holding arrays, to check every dtype and layout of the inline forms."""

    arrays: list[np.ndarray]


_BASE = np.arange(-50, 50)
INLINE_ARRAYS = [
    *(_BASE.astype(dtype) for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                        np.uint16, np.uint32, np.uint64, np.float16,
                                        np.float32, np.float64, np.bool_)),
    np.zeros(0, dtype=np.int64),  # an empty batch
    _BASE.astype(np.int32)[::3],  # not contiguous
    _BASE.astype(">i4"),  # not native byte order: the general inline form
    _BASE.reshape(4, 25).astype(np.float32),  # two dimensions: the general inline form
    np.array(7, dtype=np.int64),  # no dimension
    _BASE.astype("<M8[s]"),  # a dtype outside the one-byte table
    _BASE.astype(np.complex64),
]


@pytest.mark.parametrize("array", INLINE_ARRAYS, ids=lambda a: f"{a.dtype.str}x{a.shape}")
def test_small_arrays_of_any_dtype_and_layout_round_trip_inline(array: np.ndarray) -> None:
    codec = MsgpackCodec()
    frames = codec.encode(ArrayCarrier(arrays=[array, array]))
    assert len(frames) == 1
    for back in codec.decode(frames).arrays:  # type: ignore[attr-defined]
        assert back.dtype == array.dtype and back.shape == array.shape
        assert np.array_equal(back, array)
        assert back.flags.c_contiguous


def test_small_1d_arrays_are_views_into_the_frame_they_came_in() -> None:
    """The frames belong to the decoded message: its small arrays are views, not copies."""
    codec = MsgpackCodec()
    array = np.arange(100, dtype=np.int32)
    body = bytes(codec.encode(ArrayCarrier(arrays=[array]))[0])
    back = codec.decode([body]).arrays[0]  # type: ignore[attr-defined]
    assert np.array_equal(back, array) and not back.flags.owndata
    assert not back.flags.writeable  # a view into immutable bytes stays read-only
    with pytest.raises(ValueError):
        back[0] = 1
    # A transport's own buffer (shm's large frames) gives a writable view into it.
    owned = bytearray(body)
    back = codec.decode([owned]).arrays[0]  # type: ignore[attr-defined]
    assert back.flags.writeable and np.shares_memory(back, np.frombuffer(owned, np.uint8))
    del owned
    assert np.array_equal(back, array)  # the view keeps its frame alive


def test_small_batch_arrays_cost_one_byte_of_header() -> None:
    """A token batch's arrays take the one-byte-header form (the per-step fast path)."""
    handles = np.arange(256, dtype=np.int64)
    msg = BatchTokenIDOutput(handles=handles, output_ids=np.zeros(256, dtype=np.int32),
                             output_offsets=np.arange(257, dtype=np.int32))
    body = bytes(MsgpackCodec().encode(msg)[0])
    payload = 256 * 8 + 256 * 4 + 257 * 4
    assert len(body) < payload + 100  # three arrays with a few bytes of framing each
    assert same(MsgpackCodec().decode([body]), msg)


class TensorCarrier(Message):
    """A user message holding tensors, to check tensor support."""

    name: str
    tensors: list[torch.Tensor]


@pytest.mark.parametrize("codec_cls", [PickleCodec, MsgpackCodec])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_torch_tensors_round_trip(codec_cls: type, dtype: torch.dtype) -> None:
    tensors = [torch.arange(40_000).reshape(40, 1000).to(dtype), torch.ones(2, dtype=dtype)]
    codec = codec_cls()
    frames = codec.encode(TensorCarrier(name="t", tensors=tensors))
    assert len(frames) == 2  # only the large tensor goes out of band
    decoded = codec.decode(frames)
    for got, want in zip(decoded.tensors, tensors):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


GARBAGE = [
    [b""],
    [b"\x00\x01\x02garbage"],
    [b"\xff" * 40],
    [msgspec.msgpack.encode(["NoSuchMessage", 1, 2])],
    [msgspec.json.encode({"not": "a message"})],
    [pickle.dumps({"a": "dict, not a message"})],
    [pickle.dumps(AbortReq(rid="x"))[:-3]],
    # An inline array naming no known dtype, and one whose bytes are not whole items.
    [msgspec.msgpack.encode(["ArrayCarrier", [msgspec.msgpack.Ext(5, b"\xee\x00")]])],
    [msgspec.msgpack.encode(["ArrayCarrier", [msgspec.msgpack.Ext(5, b"\x02\x00\x00")]])],
    [],
]


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("frames", GARBAGE, ids=range(len(GARBAGE)))
def test_garbled_or_foreign_frames_raise_codec_error(codec_name: str, frames: list) -> None:
    codec = create_codec(codec_name)
    with pytest.raises(CodecError, match=codec_name):
        codec.decode(frames)
    # The codec is still usable afterwards.
    assert codec.decode(codec.encode(AbortReq(rid="ok"))) == AbortReq(rid="ok")


def test_msgpack_refuses_what_it_cannot_encode() -> None:
    class Holder(Message):
        value: object

    with pytest.raises(CodecError, match="msgpack"):
        MsgpackCodec().encode(Holder(value=object()))


def test_user_defined_messages_decode_with_msgspec_codecs() -> None:
    class CustomNote(Message):
        text: str
        values: list[int]

    for name in ("msgpack", "json"):
        codec = create_codec(name)  # made after the class exists, so it knows the tag
        assert codec.decode(codec.encode(CustomNote("hi", [1, 2]))) == CustomNote("hi", [1, 2])


def test_codec_registry_lists_built_ins() -> None:
    assert {"pickle", "msgpack", "json"} <= set(CODECS.names())
    assert CODECS.get("pickle").local_only
    assert not CODECS.get("msgpack").local_only
