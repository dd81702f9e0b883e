"""Parsing ``--lora-paths``: kept free of torch, for the server's own process."""

from __future__ import annotations

from collections.abc import Sequence


def parse_lora_paths(entries: Sequence[str]) -> dict[str, str]:
    """``NAME=DIR`` entries (or a bare ``DIR``, named after itself) as ``{name: dir}``.

    Raises:
        ValueError: an empty name or directory, or a name given twice.
    """
    paths: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = entry, entry
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r} is not NAME=DIR")
        if name in paths:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        paths[name] = path
    return paths
