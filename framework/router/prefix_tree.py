"""An approximate radix tree of the prompt text one worker has seen, bounded in size.

The router keeps one tree per worker: the longer a new prompt's match in a worker's tree,
the more of its prefix that worker likely still holds in its own KV cache. Text, not
tokens: the router has no tokenizer, and a character prefix is a token prefix closely
enough for choosing a worker.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    """One edge of text and the subtree under it."""

    text: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)
    last_used: int = 0


def _common_length(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    limit = min(len(a), len(b))
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Radix tree of strings with least-recently-used leaf eviction past ``max_chars``.

    Recency is a counter bumped by every insert and match (no clock): a leaf matched or
    inserted last is the last to go.
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.size = 0  # characters held on all edges
        self._root = _Node("", None)
        self._clock = itertools.count(1)

    def insert(self, text: str) -> None:
        """Record ``text``, then evict the least recently used leaves while over the bound."""
        now = next(self._clock)
        node, rest = self._root, text
        while rest:
            node.last_used = now
            child = node.children.get(rest[0])
            if child is None:
                node.children[rest[0]] = _Node(rest, node, last_used=now)
                self.size += len(rest)
                break
            shared = _common_length(child.text, rest)
            if shared < len(child.text):
                child = self._split(child, shared)
            node, rest = child, rest[shared:]
        node.last_used = now
        self.evict()

    def match(self, text: str) -> int:
        """Characters of ``text``'s longest prefix held in the tree (marks that path used)."""
        now = next(self._clock)
        node, rest, matched = self._root, text, 0
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            shared = _common_length(child.text, rest)
            child.last_used = now
            matched += shared
            if shared < len(child.text):
                break
            node, rest = child, rest[shared:]
        return matched

    def evict(self) -> None:
        """Drop the least recently used leaves until the tree holds at most ``max_chars``."""
        if self.size <= self.max_chars:
            return
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.size > self.max_chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None  # the root is never a leaf in this heap
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            # A parent left childless is a leaf now, as old as its own last use.
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge at ``at``: a new node holds the head, ``child`` the tail."""
        parent = child.parent
        assert parent is not None
        head = _Node(child.text[:at], parent, last_used=child.last_used)
        parent.children[head.text[0]] = head
        child.text, child.parent = child.text[at:], head
        head.children[child.text[0]] = child
        return head

    def _nodes(self) -> list[_Node]:
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
