"""Cutting a list of token ids into the chunks a stream would deliver them in."""

from __future__ import annotations

from collections.abc import Sequence


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut ``ids`` into chunks whose lengths cycle through ``sizes`` (one empty chunk if none)."""
    chunks: list[list[int]] = []
    start = 0
    while start < len(ids):
        size = sizes[len(chunks) % len(sizes)]
        chunks.append(list(ids[start : start + size]))
        start += size
    return chunks or [[]]
