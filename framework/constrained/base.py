"""The grammar-backend interface: what the runtime needs to constrain decoding.

A backend turns a ``Constraint`` (a JSON schema, a regular expression or an EBNF
grammar) into a compiled grammar once, and makes one ``GrammarMatcher`` per request
from it. The Scheduler fills each step's token bitmask through the matchers and
advances each matcher by the token sampled; the sampler applies the bitmask to the
logits. Backends are found by name in ``framework.registry.GRAMMAR_BACKENDS``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The constraint kinds, named as the sampling parameters that carry them.
from framework.sampling_params import CONSTRAINT_FIELDS as CONSTRAINT_KINDS

if TYPE_CHECKING:
    import torch

#: Bits per word of a packed token bitmask (one int32 per 32 tokens).
BITMASK_WORD_BITS = 32


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its kind (one of ``CONSTRAINT_KINDS``) and its text.

    Hashable, so that it keys the cache of compiled grammars.
    """

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                             f"got {self.kind!r}")


class InvalidConstraintError(ValueError):
    """A schema, regex or grammar that cannot be served; the API answers 400 naming it.

    ``code`` is the OpenAI error code where one is more precise than the status.
    """

    def __init__(self, param: str, problem: str, code: str | None = None) -> None:
        super().__init__(f"invalid {param}: {problem}")
        self.param, self.code = param, code


# Native errors start with a timestamp and a source location that mean nothing to a client.
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def clean_error(exc: BaseException) -> str:
    """The message of a backend's exception, without native log prefixes, on one line."""
    text = _NATIVE_PREFIX.sub("", str(exc).strip())
    return " ".join(text.split()) or type(exc).__name__


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per row of a packed bitmask over ``vocab_size`` tokens."""
    return (vocab_size + BITMASK_WORD_BITS - 1) // BITMASK_WORD_BITS


class GrammarMatcher(ABC):
    """The state of one request inside its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and fills token bitmasks for a batch.

    Built once per Scheduler with the tokenizer, the model's vocabulary size (the
    logits' width, which may exceed the tokenizer's) and the ids that end a request.
    ``compile`` runs on worker threads, several at once, and must be thread-safe (it
    cannot be interrupted: one that outlives its budget runs to its end and its result
    is dropped); the other methods run on the Scheduler's loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size

    @classmethod
    @abstractmethod
    def validate(cls, constraint: Constraint) -> None:
        """Raise ``InvalidConstraintError`` if ``constraint`` cannot compile.

        Needs no tokenizer, so that the HTTP side can refuse a bad constraint with a
        400 before the request is sent.
        """

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint`` (``InvalidConstraintError`` if invalid)."""

    @abstractmethod
    def size_bytes(self, compiled: Any) -> int:
        """The memory a compiled grammar holds, which the cache of compiled grammars counts."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    @abstractmethod
    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                     rows: Sequence[int]) -> None:
        """Write the allowed next tokens of ``matchers[i]`` into ``bitmask[rows[i]]``.

        ``bitmask`` is a CPU int32 tensor ``[batch, bitmask_words(vocab_size)]``; bit
        ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed.
        """
