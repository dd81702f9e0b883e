"""Hypothesis strategies for every message type, derived from the messages' type hints."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

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
    """Every field of ``cls`` drawn from its annotation."""
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{name: strategy_for(hints[name]) for name in cls.__struct_fields__})


def same(a: Any, b: Any) -> bool:
    """Deep equality that treats arrays by dtype, shape and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
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
