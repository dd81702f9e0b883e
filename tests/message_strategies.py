"""Hypothesis strategies for every message type, derived from the messages' type hints."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from framework.messages import (
    BatchTokenIDOutput,
    FinishReason,
    PromptLogprobs,
    RequestConstants,
)

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
_int = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_float = st.floats(allow_nan=False, allow_infinity=False)
_array = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float16, np.int32, np.int64]),
    shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=300),
    elements={"allow_nan": False, "allow_infinity": False},
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy that builds values of the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is str:
        return _text
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _int
    if tp is float:
        return _float
    if tp is type(None):
        return st.none()
    if tp is np.ndarray:
        return _array
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=5)
    if origin is dict:
        return st.dictionaries(_text, strategy_for(args[1]), max_size=4)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    """Every field of ``cls`` drawn from its annotation (and laid out, where a message must be)."""
    hints = typing.get_type_hints(cls)
    derived = st.builds(
        cls, **{name: strategy_for(hints[name]) for name in cls.__struct_fields__})
    if cls is BatchTokenIDOutput:
        # Arbitrary arrays, and ones laid out as the Scheduler lays them out.
        return st.one_of(derived, token_id_outputs())
    return derived


_token_id = st.integers(min_value=0, max_value=2**31 - 1)
_handle = st.integers(min_value=0, max_value=2**63 - 1)
_logprob = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def token_id_outputs(draw: st.DrawFn) -> BatchTokenIDOutput:
    """A ``BatchTokenIDOutput`` laid out as the Scheduler builds it.

    Requests with zero or more new ids, some finished, some new (with their
    constants), and, if any request asked, logprobs aligned with the ids (NaN
    for the requests that did not ask). When every request has as many new ids,
    sometimes with ``output_offsets`` ``None`` (as the Scheduler sends them), and
    sometimes with explicit offsets (which a sender may still send).
    """
    if draw(st.booleans()):
        count = draw(st.integers(0, 3))
        per_request = draw(st.lists(
            st.lists(_token_id, min_size=count, max_size=count), min_size=1, max_size=6))
    else:
        per_request = draw(st.lists(st.lists(_token_id, max_size=4), max_size=6))
    size = len(per_request)
    uniform = size > 0 and len({len(ids) for ids in per_request}) == 1
    indices = st.lists(st.integers(0, max(size - 1, 0)), unique=True, max_size=size)
    finished = draw(indices)
    new = draw(indices)
    asked = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    msg = BatchTokenIDOutput(
        handles=np.array(draw(st.lists(_handle, min_size=size, max_size=size, unique=True)),
                         dtype=np.int64),
        output_ids=np.array([i for ids in per_request for i in ids], dtype=np.int32),
        output_offsets=None if uniform and draw(st.booleans()) else np.cumsum(
            [0, *map(len, per_request)], dtype=np.int32),
        finished_indices=finished,
        finished_reasons=[draw(struct_strategy(FinishReason)) for _ in finished],
        new_indices=new,
        new_constants=[draw(struct_strategy(RequestConstants)) for _ in new],
    )
    # Prompt logprobs come with some of the first outputs.
    prompt_indices = [i for i in new if draw(st.booleans())]
    msg.prompt_logprob_indices = prompt_indices
    msg.prompt_logprobs = [draw(struct_strategy(PromptLogprobs)) for _ in prompt_indices]
    if any(asked):
        values: list[float] = []
        for ids, wants in zip(per_request, asked):
            count = len(ids)
            values += draw(st.lists(_logprob, min_size=count, max_size=count)) if wants else (
                [np.nan] * count)
        widths = [0 if np.isnan(v) else draw(st.integers(0, 3)) for v in values]
        msg.output_token_logprobs = np.array(values, dtype=np.float32)
        msg.output_top_logprobs_val = [
            draw(st.lists(_logprob, min_size=n, max_size=n)) for n in widths]
        msg.output_top_logprobs_idx = [
            draw(st.lists(_token_id, min_size=n, max_size=n)) for n in widths]
    return msg


def same(a: Any, b: Any) -> bool:
    """Deep equality that treats arrays by dtype, shape and values (NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(
            same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
