"""How much host memory is left for new buffers: the kernel's estimate, within the cgroup's limit.

``MemAvailable`` (``/proc/meminfo``) counts what can be allocated without
swapping, but a container's memory limit is not part of it: a process in a
cgroup capped below the machine's memory is killed at the cap. So the room
left under this process's cgroup limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``, less what the group already uses) lowers it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
# (controller directory under the root, limit file, usage file) of each cgroup version.
_V2_FILES = ("", "memory.max", "memory.current")
_V1_FILES = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")


def available_host_memory(proc: Path = Path("/proc"),
                          cgroup_root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes that new buffers may take now; None where the kernel does not say (not Linux)."""
    available = _mem_available(proc / "meminfo")
    room = _cgroup_room(proc / "self" / "cgroup", cgroup_root)
    known = [value for value in (available, room) if value is not None]
    return min(known) if known else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB
    return None


def _cgroup_room(self_cgroup: Path, root: Path) -> int | None:
    """The limit of this process's memory cgroup less its usage; None when unlimited or unknown."""
    for directory, limit_name, usage_name in _memory_cgroup_dirs(self_cgroup, root):
        limit = _read_bytes(directory / limit_name)
        usage = _read_bytes(directory / usage_name)
        if limit is not None and usage is not None:
            return max(limit - usage, 0)
    return None


def _memory_cgroup_dirs(self_cgroup: Path, root: Path) -> Iterator[tuple[Path, str, str]]:
    """Candidate directories of this process's memory cgroup, with their file names.

    ``/proc/self/cgroup`` names the group's path; inside a container whose
    cgroup namespace hides it, the controller's root directory is the group.
    """
    try:
        lines = self_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            subdir, limit_name, usage_name = _V2_FILES
        elif "memory" in controllers.split(","):
            subdir, limit_name, usage_name = _V1_FILES
        else:
            continue
        base = root / subdir if subdir else root
        for directory in (base / path.lstrip("/"), base):
            if (directory / limit_name).is_file():
                yield directory, limit_name, usage_name
                break


def _read_bytes(path: Path) -> int | None:
    """A byte count from a cgroup file; None for ``max`` (no limit) or an unreadable file."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
