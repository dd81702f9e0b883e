"""Grammar compiles on threads: several at once, and one nobody waits for stops counting.

A compile runs in native code that cannot be interrupted (xgrammar releases the GIL
while it runs), so a slow one cannot be cancelled, only abandoned: when its last request
is aborted, or its budget (``--grammar-compile-timeout``) is spent, its result is
dropped and its thread stops counting against ``workers``, so that a fresh thread takes
the next compile at once. Threads still running abandoned compiles are capped
(``max_stray``); past the cap, new compiles queue until one of them ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from framework.constrained.base import Constraint


class CompileJob:
    """One constraint's compile: queued, running on a thread of its own, then done.

    ``future`` holds the compiled grammar or the compile's exception; ``started_at``
    (monotonic seconds) is set by the compile function when the compile proper begins,
    after anything it waits for first (the tokenizer, the backend's build), so that a
    budget counts the compile alone.
    """

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.future: cf.Future[Any] = cf.Future()
        self.started_at: float | None = None
        #: Why the job was given up (a timeout), raised to the requests that waited for it.
        self.error: Exception | None = None
        # Which count the job is in: queued, live, stray (abandoned, still running), done.
        self.slot = "queued"

    def start_clock(self) -> None:
        """Mark the start of the compile proper (called on the job's thread)."""
        self.started_at = time.monotonic()

    def running(self) -> bool:
        """True between the start of the compile proper and its end."""
        return self.started_at is not None and not self.future.done()

    def overdue(self, budget: float) -> bool:
        """True once the compile proper has run for more than ``budget`` seconds."""
        return self.running() and time.monotonic() - self.started_at > budget  # type: ignore[operator]


class CompilePool:
    """Runs ``compile_fn(job)`` for each job submitted, ``workers`` at a time.

    Thread-safe: jobs are submitted and abandoned from the Scheduler's thread and end
    on their own threads.
    """

    def __init__(self, compile_fn: Callable[[CompileJob], Any], workers: int,
                 max_stray: int) -> None:
        self.compile_fn = compile_fn
        self.workers = workers
        self.max_stray = max_stray
        self._lock = threading.Lock()
        self._queue: deque[CompileJob] = deque()
        self._live = 0
        self._stray = 0

    def submit(self, constraint: Constraint) -> CompileJob:
        """Queue the compile of ``constraint``; it starts as soon as a thread is free."""
        job = CompileJob(constraint)
        with self._lock:
            self._queue.append(job)
        self._start_queued()
        return job

    def abandon(self, job: CompileJob) -> None:
        """Nobody waits for ``job`` any more: never start it, or stop counting its thread.

        Its result, when its thread ends, is dropped with the job.
        """
        with self._lock:
            if job.slot == "queued":
                self._queue.remove(job)
                job.future.cancel()
                job.slot = "done"
            elif job.slot == "live":
                self._live -= 1
                self._stray += 1
                job.slot = "stray"
        self._start_queued()

    def counts(self) -> dict[str, int]:
        """Jobs queued, compiles running that someone waits for, and abandoned ones running."""
        with self._lock:
            return {"queued": len(self._queue), "live": self._live, "stray": self._stray}

    def close(self) -> None:
        """Drop the queued jobs; running compiles end on their (daemon) threads."""
        with self._lock:
            for job in self._queue:
                job.future.cancel()
                job.slot = "done"
            self._queue.clear()

    def _start_queued(self) -> None:
        with self._lock:
            while self._queue and self._live < self.workers and self._stray < self.max_stray:
                job = self._queue.popleft()
                job.future.set_running_or_notify_cancel()
                job.slot = "live"
                self._live += 1
                # A thread per compile: a stray one must not hold up the compiles behind it.
                threading.Thread(target=self._run, args=(job,), daemon=True,
                                 name="grammar-compile").start()

    def _run(self, job: CompileJob) -> None:
        try:
            job.future.set_result(self.compile_fn(job))
        except Exception as exc:  # the waiting requests get it from the future
            job.future.set_exception(exc)
        finally:
            with self._lock:
                if job.slot == "live":
                    self._live -= 1
                elif job.slot == "stray":
                    self._stray -= 1
                job.slot = "done"
            self._start_queued()
