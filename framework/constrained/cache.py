"""The cache of compiled grammars, bounded by the bytes they hold (``--grammar-cache-mb``).

A compiled grammar holds token masks for the whole vocabulary: from kilobytes for a
small regex to tens of megabytes for a large enum, so a bound by count bounds nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from framework.constrained.base import Constraint


class GrammarCache:
    """Compiled grammars by constraint, the least recently used dropped past ``max_bytes``.

    One larger than ``max_bytes`` is not kept (the requests waiting for it still get it);
    ``max_bytes`` 0 keeps none. Used from the Scheduler's thread only.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Constraint, tuple[Any, int]] = OrderedDict()

    def __contains__(self, constraint: Constraint) -> bool:
        return constraint in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, constraint: Constraint) -> Any | None:
        """The compiled grammar of ``constraint``, now the most recently used, or None."""
        entry = self._entries.get(constraint)
        if entry is None:
            return None
        self._entries.move_to_end(constraint)
        return entry[0]

    def put(self, constraint: Constraint, compiled: Any, size: int) -> None:
        """Keep ``compiled`` (``size`` bytes), dropping the least recently used to fit."""
        self.discard(constraint)
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
        self._entries[constraint] = (compiled, size)
        self.bytes += size

    def discard(self, constraint: Constraint) -> None:
        """Drop ``constraint``'s grammar if it is kept."""
        entry = self._entries.pop(constraint, None)
        if entry is not None:
            self.bytes -= entry[1]
