"""``framework.cpuinfo``: fields of ``/proc/cpuinfo``."""

from __future__ import annotations

import pytest

from framework import cpuinfo

_TWO_CORES = (
    "processor\t: 0",
    "vendor_id\t: AuthenticAMD",
    "model name\t: AMD EPYC 9R14",
    "flags\t\t: fpu avx512f",
    "",
    "processor\t: 1",
    "vendor_id\t: GenuineIntel",
    "model name\t: another name",
)


def test_each_field_is_the_first_core_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpuinfo, "_cpuinfo_lines", lambda: _TWO_CORES)
    assert cpuinfo.cpuinfo_fields("model name", "flags", "Features") == {
        "model name": "AMD EPYC 9R14", "flags": "fpu avx512f"}
    assert cpuinfo.cpu_vendor() == "AuthenticAMD"


def test_without_cpuinfo_there_is_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpuinfo, "_cpuinfo_lines", lambda: ())
    assert cpuinfo.cpuinfo_fields("vendor_id") == {}
    assert cpuinfo.cpu_vendor() == ""


def test_this_machine_names_a_vendor_on_linux_x86() -> None:
    import platform
    import sys

    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("vendor_id is an x86 Linux field")
    assert cpuinfo.cpu_vendor()  # GenuineIntel, AuthenticAMD, ...
