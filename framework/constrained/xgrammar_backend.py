"""The ``xgrammar`` grammar backend: JSON schemas, regexes and EBNF grammars as token masks.

Imported only when a request carries a constraint (through the registry), so that a
server without structured outputs never loads xgrammar.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from framework.constrained.base import (
    Constraint,
    GrammarBackend,
    GrammarMatcher,
    InvalidConstraintError,
    clean_error,
)
from framework.constrained.json_schema import check_schema
from framework.constrained.patterns import unsupported_feature

# Threads xgrammar may use to fill one step's bitmasks; a few are plenty for one batch.
_FILL_THREADS = min(4, os.cpu_count() or 1)
# xgrammar writes the characters of JSON strings as these classes: the bounded ones let
# control characters through, and both let surrogates through, which UTF-8 cannot encode.
# RFC 8259 forbids both unescaped, so they are excluded.
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')


class XGrammarMatcher(GrammarMatcher):
    """One request's ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self.matcher.is_terminated())


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of a JSON schema's documents, with no free whitespace.

    Without free whitespace, output cannot drift into endless spaces and newlines.
    """
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    for loose in _LOOSE_STRING_CHARS:
        ebnf = ebnf.replace(loose, _JSON_STRING_CHAR)
    return ebnf


def constraint_grammar(constraint: Constraint) -> xgr.Grammar:
    """The tokenizer-free grammar of ``constraint`` (raises on invalid input).

    What xgrammar would not enforce is refused first (``InvalidConstraintError``), so
    that every output that completes the grammar satisfies the constraint.
    """
    if constraint.kind == "json_schema":
        return xgr.Grammar.from_ebnf(json_schema_ebnf(check_schema(constraint.value)))
    if constraint.kind == "regex":
        problem = unsupported_feature(constraint.value)
        if problem is not None:
            raise InvalidConstraintError("regex", f"uses {problem}, which a grammar cannot "
                                         "enforce")
        return xgr.Grammar.from_regex(constraint.value)
    return xgr.Grammar.from_ebnf(constraint.value)


class XGrammarBackend(GrammarBackend):
    """Compiles with one ``xgrammar.GrammarCompiler``; fills a batch's bitmasks in one call."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        # The model's vocabulary may be padded past the tokenizer's: those ids stay masked.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # The GrammarManager caches compiled grammars, bounded by bytes; xgrammar's own
        # cache would keep every one ever compiled besides.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=_FILL_THREADS)

    @classmethod
    def validate(cls, constraint: Constraint) -> None:
        """Parse ``constraint`` without a tokenizer; ``InvalidConstraintError`` if it fails."""
        try:
            constraint_grammar(constraint)
        except InvalidConstraintError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError and its own kinds
            raise InvalidConstraintError(constraint.kind, clean_error(exc)) from None

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar, masks for this tokenizer included."""
        try:
            return self.compiler.compile_grammar(constraint_grammar(constraint))
        except InvalidConstraintError:
            raise
        except Exception as exc:
            raise InvalidConstraintError(constraint.kind, clean_error(exc)) from None

    def size_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        """The memory ``compiled`` holds (its token masks, mostly)."""
        return int(compiled.memory_size_bytes)

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        """A matcher at the start of ``compiled``."""
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                     rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` in one (multi-threaded) call."""
        inner = [m.matcher for m in matchers]  # type: ignore[attr-defined]
        self.batch_matcher.batch_fill_next_token_bitmask(inner, bitmask, list(rows))
