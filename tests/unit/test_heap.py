"""The Scheduler's heap: freed memory held for reuse, free pages handed back once per interval."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
import textwrap

import pytest

from framework.runtime.heap import HeapTrimmer

GLIBC_ONLY = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="mallopt and malloc_trim are glibc's")

# In a fresh process (another test may have moved glibc's adaptive thresholds): the page
# faults of writing a 16 MiB buffer, freed, and allocated again, five times over.
_REUSE_FAULTS = textwrap.dedent("""
    import ctypes, ctypes.util, resource, sys
    from framework.runtime.heap import hold_freed_memory
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    held = sys.argv[1] == "hold" and hold_freed_memory()
    size = 16 << 20
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = libc.malloc(size)
        ctypes.memset(buffer, 1, size)
        libc.free(buffer)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(held, *faults)
""")


def _reuse_faults(mode: str) -> tuple[bool, list[int]]:
    out = subprocess.run([sys.executable, "-c", _REUSE_FAULTS, mode], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", [int(n) for n in out[1:]]


@GLIBC_ONLY
def test_held_memory_is_reused_without_new_page_faults() -> None:
    held, faults = _reuse_faults("hold")
    assert held
    pages = (16 << 20) // resource.getpagesize()
    assert faults[0] >= pages // 2  # the first write maps the buffer's pages
    assert max(faults[1:]) < pages // 16  # later ones reuse them
    # What the default adaptive thresholds do: the second buffer lands on new pages too.
    _, default = _reuse_faults("default")
    assert default[1] >= pages // 2


@GLIBC_ONLY
def test_trims_once_per_interval_with_the_real_malloc_trim() -> None:
    now = [0.0]
    trimmer = HeapTrimmer(interval=30.0, clock=lambda: now[0])
    assert trimmer.maybe_trim() is False  # the interval counts from creation
    now[0] = 29.9
    assert trimmer.maybe_trim() is False
    now[0] = 30.0
    assert trimmer.maybe_trim() is True
    assert trimmer.maybe_trim() is False
    now[0] = 61.0
    assert trimmer.maybe_trim() is True
    assert trimmer.trims == 2
