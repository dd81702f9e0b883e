"""The edge's check of a request's constraint: refused with a 400 before it is sent.

Validation parses the schema, regex or grammar without a tokenizer, which is cheap;
the result is cached per constraint, so a client repeating a schema pays once.
"""

from __future__ import annotations

import functools

from framework.constrained.base import Constraint, InvalidConstraintError
from framework.constrained.limits import check_size
from framework.sampling_params import SamplingParams

_VALIDATED_CACHE_SIZE = 256
#: ``--grammar-backend`` value that switches structured outputs off.
NO_GRAMMAR_BACKEND = "none"


def check_constraint(params: SamplingParams, backend_name: str) -> None:
    """Raise ``InvalidConstraintError`` if the request's constraint cannot be served.

    A request without a constraint passes at once. Size limits come first (they need no
    backend, and a constraint past them may take long to parse); the backend is
    imported here, on first use, never for unconstrained requests.
    """
    found = params.constraint()
    if found is None:
        return
    if backend_name == NO_GRAMMAR_BACKEND:
        raise InvalidConstraintError(
            found[0], "structured outputs are off on this server (--grammar-backend none)")
    _validate(backend_name, *found)


@functools.lru_cache(maxsize=_VALIDATED_CACHE_SIZE)
def _validate(backend_name: str, kind: str, value: str) -> None:
    """Validate once per distinct constraint (failures raise, so they are not cached)."""
    from framework.registry import GRAMMAR_BACKENDS, UnknownPluginError

    check_size(kind, value)
    try:
        backend = GRAMMAR_BACKENDS.get(backend_name)
    except UnknownPluginError as exc:  # a broken install: xgrammar is a dependency
        raise InvalidConstraintError(
            kind, f"the grammar backend cannot be loaded on this server ({exc})") from None
    backend.validate(Constraint(kind, value))
