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


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu avx512f", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
    ("fpu avx512_bf16x", False)])
def test_bfloat16_instructions_are_read_from_the_flags(
        monkeypatch: pytest.MonkeyPatch, flags: str, expected: bool) -> None:
    monkeypatch.setattr(cpuinfo, "_cpuinfo_lines", lambda: (f"flags\t\t: {flags}",))
    assert cpuinfo.cpu_multiplies_bfloat16() is expected


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
