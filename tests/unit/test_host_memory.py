"""``available_host_memory``: MemAvailable, lowered to the room under the cgroup's memory limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.host_memory import available_host_memory

GIB = 1 << 30


def _proc(tmp_path: Path, mem_available_kb: int | None, self_cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    lines = ["MemTotal:       32000000 kB", "MemFree:         1000000 kB"]
    if mem_available_kb is not None:
        lines.append(f"MemAvailable:   {mem_available_kb} kB")
    (proc / "meminfo").write_text("\n".join(lines) + "\n")
    (proc / "self" / "cgroup").write_text(self_cgroup)
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def test_without_a_memory_limit_it_is_mem_available(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 8 * 1024 * 1024, "0::/user.slice/session-1.scope\n")
    root = tmp_path / "cgroup"
    _write(root / "user.slice/session-1.scope", memory_max="max", memory_current=str(GIB))
    assert available_host_memory(proc, root) == 8 * GIB


def test_a_cgroup_v2_limit_leaves_the_room_under_it(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 8 * 1024 * 1024, "0::/docker/abc\n")
    root = tmp_path / "cgroup"
    _write(root / "docker/abc", memory_max=str(4 * GIB), memory_current=str(3 * GIB))
    assert available_host_memory(proc, root) == GIB


def test_a_namespaced_cgroup_is_read_at_the_controller_s_root(tmp_path: Path) -> None:
    """Inside a container the named path does not exist: the root is the group."""
    proc = _proc(tmp_path, 8 * 1024 * 1024, "0::/\n")
    root = tmp_path / "cgroup"
    _write(root, memory_max=str(2 * GIB), memory_current=str(GIB // 2))
    assert available_host_memory(proc, root) == GIB + GIB // 2


def test_a_cgroup_v1_memory_controller_is_read_too(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 8 * 1024 * 1024,
                 "5:devices:/\n4:memory:/job/42\n3:cpu,cpuacct:/\n0::/\n")
    root = tmp_path / "cgroup"
    _write(root / "memory/job/42", memory_limit_in_bytes=str(6 * GIB),
           memory_usage_in_bytes=str(GIB))
    assert available_host_memory(proc, root) == 5 * GIB
    # A usage over the limit (the kernel reclaims lazily) leaves no room, not a negative one.
    _write(root / "memory/job/42", memory_usage_in_bytes=str(7 * GIB))
    assert available_host_memory(proc, root) == 0


def test_what_the_kernel_does_not_say_is_left_out(tmp_path: Path) -> None:
    proc = _proc(tmp_path, None, "0::/\n")
    root = tmp_path / "cgroup"
    _write(root, memory_max=str(3 * GIB), memory_current="0")
    assert available_host_memory(proc, root) == 3 * GIB
    assert available_host_memory(tmp_path / "nowhere", tmp_path / "none") is None


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads Linux's /proc")
def test_this_machine_reports_some_memory() -> None:
    available = available_host_memory()
    assert available is not None and available > 0
