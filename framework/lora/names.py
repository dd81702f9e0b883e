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


def lora_slot_count(max_loaded: int | None, lora_paths: Sequence[str]) -> int:
    """The adapters a model holds at once: ``--max-loaded-loras``, by default the
    ``--lora-paths`` ones (at least one)."""
    return max_loaded if max_loaded is not None else max(len(lora_paths), 1)


def adapters_per_batch(max_per_batch: int, max_loaded: int | None,
                       lora_paths: Sequence[str]) -> int:
    """The most distinct adapters one step runs: ``--max-loras-per-batch``, and no more
    than the slots hold, since a step's adapters are all loaded at once."""
    return max(1, min(max_per_batch, lora_slot_count(max_loaded, lora_paths)))
