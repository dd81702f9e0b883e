"""The C library, for the few Linux calls the runtime makes.

``madvise`` (huge pages for the KV buffers), ``prctl`` (a child dies with its parent),
``mallopt`` and ``malloc_trim`` (the Scheduler's heap).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def linux_libc() -> ctypes.CDLL | None:
    """The C library (errno kept) on Linux; None elsewhere, or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError):
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return None


def libc_function(name: str) -> Callable[..., int] | None:
    """The Linux C library's function ``name``, or None where there is none (musl lacks some)."""
    library = linux_libc()
    return None if library is None else getattr(library, name, None)  # type: ignore[no-any-return]


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``signum`` to the child when its parent
    dies (``PR_SET_PDEATHSIG``), so that a command killed outright leaves no server
    behind; None where Linux's ``prctl`` is missing. Resolved here, before the fork."""
    prctl = libc_function("prctl")
    if prctl is None:
        return None

    def ask() -> None:
        prctl(1, signum)  # PR_SET_PDEATHSIG

    return ask
