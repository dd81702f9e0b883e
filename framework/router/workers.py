"""The worker set: each worker's URL, health and requests in flight; add, remove, drain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Worker:
    """One upstream server as the router sees it."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    removed: bool = False  # no new request; kept until its requests in flight finish
    served: int = 0  # requests sent to it so far

    @property
    def load(self) -> int:
        """Requests in flight, the load the policies balance."""
        return self.in_flight

    def describe(self) -> dict[str, Any]:
        """The worker as ``/list_workers`` shows it."""
        state = "draining" if self.removed else ("healthy" if self.healthy else "unhealthy")
        return {"url": self.url, "state": state, "healthy": self.healthy,
                "in_flight": self.in_flight, "served": self.served}


def normalize_url(url: str) -> str:
    """``url`` without a trailing ``/``, with ``http://`` when no scheme is given."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("a worker URL is empty")
    return url if "://" in url else f"http://{url}"


class WorkerSet:
    """The workers requests may go to, and the removed ones still finishing requests."""

    def __init__(self, urls: list[str]) -> None:
        self._active: dict[str, Worker] = {}
        self._draining: list[Worker] = []
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Worker:
        """Add the worker at ``url`` (the one already there if it is listed)."""
        url = normalize_url(url)
        if url not in self._active:
            self._active[url] = Worker(url)
        return self._active[url]

    def remove(self, url: str) -> Worker | None:
        """Take ``url`` out of the pool; requests in flight on it still finish."""
        worker = self._active.pop(normalize_url(url), None)
        if worker is not None:
            worker.removed = True
            if worker.in_flight:
                self._draining.append(worker)
        return worker

    def active(self) -> list[Worker]:
        """Every worker in the pool, healthy or not."""
        return list(self._active.values())

    def healthy(self, exclude: Worker | None = None) -> list[Worker]:
        """The workers a new request may go to."""
        return [w for w in self._active.values() if w.healthy and w is not exclude]

    def acquire(self, worker: Worker) -> None:
        """Count a request sent to ``worker``."""
        worker.in_flight += 1
        worker.served += 1

    def release(self, worker: Worker) -> None:
        """Count a request of ``worker`` finished; a drained removed worker is forgotten."""
        worker.in_flight -= 1
        if worker.removed and worker.in_flight == 0 and worker in self._draining:
            self._draining.remove(worker)

    def describe(self) -> list[dict[str, Any]]:
        """Every worker, draining ones included, as ``/list_workers`` shows them."""
        return [w.describe() for w in (*self._active.values(), *self._draining)]
