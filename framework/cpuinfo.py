"""What ``/proc/cpuinfo`` says about this machine's CPU (Linux; nothing elsewhere)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines())
    except OSError:  # not Linux
        return ()


def cpuinfo_fields(*keys: str) -> dict[str, str]:
    """The first value of each of ``keys`` in ``/proc/cpuinfo`` (keys it lacks are left out)."""
    seen: dict[str, str] = {}
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            seen.setdefault(key.strip(), value.strip())
    return seen


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ...; empty where the kernel does not say."""
    return cpuinfo_fields("vendor_id").get("vendor_id", "")
