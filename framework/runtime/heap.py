"""Giving freed heap memory back to the operating system.

A Scheduler allocates and frees tensors of a different size at almost every step.
glibc's allocator keeps what is freed inside its heap for reuse, and with sizes that
keep changing the heap fragments, so a long-running process's resident memory keeps
creeping up although nothing is leaked (measured: about +18% over ten minutes of
mixed traffic on the default model). ``malloc_trim`` returns the free pages; doing it
every half minute costs a few milliseconds each time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 30.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` at most once per ``interval`` seconds (a no-op without glibc)."""

    def __init__(self, interval: float = TRIM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._trim = _load_malloc_trim()
        self._last = clock()
        self.trims = 0

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last time; whether it did."""
        now = self.clock()
        if self._trim is None or now - self._last < self.interval:
            return False
        self._trim(0)
        self._last = now
        self.trims += 1
        return True
