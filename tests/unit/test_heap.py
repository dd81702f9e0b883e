"""``HeapTrimmer``: glibc's free pages handed back at most once per interval."""

from __future__ import annotations

import platform

import pytest

from framework.runtime.heap import HeapTrimmer


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
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
