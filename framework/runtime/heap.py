"""The Scheduler's heap: freed memory held for reuse, and given back every half minute.

A Scheduler allocates and frees tensors of a different size at almost every step.
glibc's allocator keeps what is freed inside its heap for reuse, and with sizes that
keep changing the heap fragments, so a long-running process's resident memory keeps
creeping up although nothing is leaked (measured: about +18% over ten minutes of
mixed traffic on the default model). ``malloc_trim`` returns the free pages; doing it
every half minute costs a few milliseconds each time.

Between trims, a scheduler rank's process asks glibc to hold on to what is freed
(``hold_freed_memory``, called by the launcher in every scheduler process it starts; a
Scheduler running as a thread leaves its host process's allocator alone). By default
glibc gives a multi-megabyte buffer straight back to the kernel when it is freed
(``mmap`` above a threshold that adapts, and a trim whenever the heap's free top grows
past twice that), so the next step's tensors of those sizes land on fresh pages, each
costing a page fault: 10,000-35,000 faults per offline benchmark job (about 1.5 µs each
on the benchmark machine, 10-70 ms of system time). Held, the memory is reused at once
and the faults all but vanish; the periodic ``malloc_trim`` still returns what is left
free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from framework.libc import libc_function

TRIM_INTERVAL_S = 30.0
#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap (32 MiB, the most glibc accepts on 64-bit).
HELD_MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top that glibc keeps rather than returns on its own.
HELD_TRIM_THRESHOLD = 1 << 30


def hold_freed_memory() -> bool:
    """Keep freed memory (up to 32 MiB a buffer) in this process's heap for reuse.

    Fixes glibc's thresholds, which otherwise adapt; whether both were accepted
    (False without glibc's ``mallopt``).
    """
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HELD_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HELD_TRIM_THRESHOLD))


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` at most once per ``interval`` seconds (a no-op without glibc)."""

    def __init__(self, interval: float = TRIM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._trim = libc_function("malloc_trim")
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
