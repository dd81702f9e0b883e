"""Structured outputs: grammar backends behind one small interface.

``base`` holds the interface (``GrammarBackend``, ``GrammarMatcher``, ``Constraint``),
``manager`` the Scheduler's side (compiling off the loop on ``compile_pool``'s threads,
caching in ``cache``, bitmasks), ``validation`` the edge's check (with ``limits``, the
size limits), and ``xgrammar_backend`` the built-in backend, with ``json_schema`` (the
schema keywords it enforces) and ``patterns`` (the regex features).
Nothing here imports a backend until a constraint is used, and importing this package
imports no torch (the HTTP side uses ``check_constraint``).
"""

from __future__ import annotations

from framework.constrained.base import (
    CONSTRAINT_KINDS,
    Constraint,
    GrammarBackend,
    GrammarMatcher,
    InvalidConstraintError,
)
from framework.constrained.validation import check_constraint

__all__ = [
    "CONSTRAINT_KINDS",
    "Constraint",
    "GrammarBackend",
    "GrammarMatcher",
    "InvalidConstraintError",
    "check_constraint",
]
