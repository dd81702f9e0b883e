"""How the router picks a worker: ``cache_aware``, ``round_robin``, ``shortest_queue``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from framework.router.prefix_tree import PrefixTree


class Candidate(Protocol):
    """What a policy reads of a worker."""

    @property
    def url(self) -> str: ...

    @property
    def load(self) -> int: ...


@dataclass(frozen=True)
class Choice:
    """The chosen worker, the prompt characters its tree matched, and why it won."""

    worker: Candidate
    matched_chars: int = 0
    reason: str = "policy"


class Policy(Protocol):
    """Picks one of ``candidates`` (never empty) for a prompt's text."""

    def choose(self, candidates: Sequence[Candidate], text: str) -> Choice: ...

    def forget(self, url: str) -> None:
        """Drop what the policy keeps about a removed worker."""


class RoundRobin:
    """Each worker in turn, in the order listed."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], text: str) -> Choice:
        return Choice(candidates[next(self._counter) % len(candidates)])

    def forget(self, url: str) -> None:
        """Nothing is kept per worker."""


class ShortestQueue:
    """The worker with the fewest requests in flight (the first listed on a tie)."""

    def choose(self, candidates: Sequence[Candidate], text: str) -> Choice:
        return Choice(min(candidates, key=lambda w: w.load))

    def forget(self, url: str) -> None:
        """Nothing is kept per worker."""


@dataclass(frozen=True)
class CacheAwareSettings:
    """The thresholds of ``cache_aware`` (the CLI flags of the same names)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 22


class CacheAware:
    """Prefix affinity while the load is balanced, the least loaded worker when it is not.

    Each worker has a tree of the prompt text sent to it. Balanced: the worker whose tree
    matches most of the prompt wins if that match covers at least ``cache_threshold`` of
    it; else the worker with the smallest tree (the most room for new prefixes), the less
    loaded first on a tie. Imbalanced (max − min load above the absolute threshold and max
    above the relative threshold × min): the least loaded worker. The winner's tree
    records the prompt either way.
    """

    def __init__(self, settings: CacheAwareSettings) -> None:
        self.settings = settings
        self._trees: dict[str, PrefixTree] = {}

    def choose(self, candidates: Sequence[Candidate], text: str) -> Choice:
        if self._imbalanced(candidates):
            least = min(candidates, key=lambda w: w.load)
            choice = Choice(least, self._tree(least.url).match(text), "balance")
        else:
            choice = self._by_prefix(candidates, text)
        self._tree(choice.worker.url).insert(text)
        return choice

    def forget(self, url: str) -> None:
        self._trees.pop(url, None)

    def tree_chars(self, url: str) -> int:
        """Characters held in ``url``'s tree."""
        return self._tree(url).size

    def _imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [w.load for w in candidates]
        high, low = max(loads), min(loads)
        return (high - low > self.settings.balance_abs_threshold
                and high > self.settings.balance_rel_threshold * low)

    def _by_prefix(self, candidates: Sequence[Candidate], text: str) -> Choice:
        matches = [self._tree(w.url).match(text) for w in candidates]
        # max and min keep the first of equals: the order listed breaks ties.
        best = max(range(len(candidates)), key=lambda i: matches[i])
        if text and matches[best] / len(text) >= self.settings.cache_threshold:
            return Choice(candidates[best], matches[best], "prefix")
        roomiest = min(range(len(candidates)),
                       key=lambda i: (self._tree(candidates[i].url).size, candidates[i].load))
        return Choice(candidates[roomiest], matches[roomiest], "smallest_tree")

    def _tree(self, url: str) -> PrefixTree:
        tree = self._trees.get(url)
        if tree is None:
            tree = self._trees[url] = PrefixTree(self.settings.max_tree_chars)
        return tree


POLICIES = ("cache_aware", "round_robin", "shortest_queue")


def make_policy(name: str, settings: CacheAwareSettings) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``)."""
    if name == "cache_aware":
        return CacheAware(settings)
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
