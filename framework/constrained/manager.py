"""The Scheduler's side of structured outputs: compiling off its loop, caching, bitmasks.

A constrained request waits in the queue until its grammar is compiled. Compiles run on
threads of a ``CompilePool``, several at once, so neither the loop nor another request
waits behind a slow one; each has a budget (``--grammar-compile-timeout``), past which
its requests end with an error. Each distinct constraint compiles once for all the
requests waiting for it; when the last of them is aborted, the compile is abandoned
and its result dropped. Compiled grammars are cached, the least recently used dropped
past ``--grammar-cache-mb``; every request gets its own matcher, kept through retraction
and dropped when the request ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from framework.constrained.base import (
    Constraint,
    GrammarBackend,
    GrammarMatcher,
    InvalidConstraintError,
    bitmask_words,
)
from framework.constrained.cache import GrammarCache
from framework.constrained.compile_pool import CompileJob, CompilePool
from framework.constrained.validation import NO_GRAMMAR_BACKEND
from framework.registry import GRAMMAR_BACKENDS
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.scheduler")

_DEFAULT_TIMEOUT_S = 10.0
_DEFAULT_CACHE_BYTES = 256 * 2**20
# Compiles that run at once; more wait their turn (their own budget not yet counting).
_COMPILE_WORKERS = 4
# Threads still running abandoned compiles, at most; past it new compiles wait for one.
_MAX_STRAY_COMPILES = 2 * _COMPILE_WORKERS


class CompileTimeoutError(RuntimeError):
    """A grammar that did not compile within its budget; its requests end with this."""


class GrammarManager:
    """Compiles constraints on a pool of threads, caches them, and fills a batch's bitmask.

    The backend is built on first use (on a compile thread: reading a large vocabulary
    takes a while), so a server that never sees a constraint never imports one.
    ``tokenizer`` may be a future of it (a Scheduler's loads in the background): the
    backend's build waits for it, and a compile's budget starts after that. Used from
    the Scheduler's thread (the compiles run on their own).
    """

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int], *, compile_timeout: float = _DEFAULT_TIMEOUT_S,
                 cache_bytes: int = _DEFAULT_CACHE_BYTES) -> None:
        # Checked by name at start-up, without importing the backend.
        known = [NO_GRAMMAR_BACKEND, *GRAMMAR_BACKENDS.names()]
        if backend_name not in known:
            raise ValueError(f"unknown grammar backend {backend_name!r}; known: "
                             f"{', '.join(known)}")
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout = compile_timeout
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.cache = GrammarCache(cache_bytes)
        self.pool = CompilePool(self._compile, _COMPILE_WORKERS, _MAX_STRAY_COMPILES)
        #: The compile of each constraint that some request waits for (or has just got).
        self.jobs: dict[Constraint, CompileJob] = {}
        #: The ids of the requests waiting for each constraint's grammar.
        self.waiters: dict[Constraint, set[str]] = {}

    # ------------------------------------------------------------------ compiling

    def backend(self) -> GrammarBackend:
        """The backend, built once (thread-safe)."""
        with self._backend_lock:
            if self._backend is None:
                # The tokenizer first: a backend's import may import transformers, which
                # must not happen while another thread (the tokenizer's load) imports it.
                tokenizer = self.tokenizer.result() if isinstance(self.tokenizer, cf.Future) \
                    else self.tokenizer
                backend_class = GRAMMAR_BACKENDS.get(self.backend_name)
                self._backend = backend_class(tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    def _compile(self, job: CompileJob) -> Any:
        backend = self.backend()
        job.start_clock()
        return backend.compile(job.constraint)

    @staticmethod
    def constraint_of(params: SamplingParams) -> Constraint | None:
        """The ``Constraint`` a request's ``SamplingParams`` carry, or None."""
        found = params.constraint()
        return None if found is None else Constraint(*found)

    def prefetch(self, req: Any) -> None:
        """Start compiling a new request's constraint at once (it waits in the queue).

        ``req`` is the Scheduler's ``Req`` (its ``rid`` and ``sampling_params``).
        """
        constraint = self.constraint_of(req.sampling_params)
        if constraint is not None and self.backend_name != NO_GRAMMAR_BACKEND \
                and constraint not in self.cache:
            self._wait_for(constraint, req.rid)

    def _wait_for(self, constraint: Constraint, rid: str) -> CompileJob:
        """``rid`` waits for ``constraint``'s compile, started now if none runs."""
        job = self.jobs.get(constraint)
        if job is None:
            job = self.jobs[constraint] = self.pool.submit(constraint)
        self.waiters.setdefault(constraint, set()).add(rid)
        return job

    def ready(self, req: Any) -> bool:
        """Whether ``req`` may be scheduled; gives it a matcher when its grammar is compiled.

        Raises ``InvalidConstraintError`` when its grammar cannot be compiled, and
        ``CompileTimeoutError`` when the compile ran past its budget.
        """
        if req.grammar is not None:
            return True
        constraint = self.constraint_of(req.sampling_params)
        if constraint is None:
            return True
        if self.backend_name == NO_GRAMMAR_BACKEND:
            raise InvalidConstraintError(
                constraint.kind, "structured outputs are off (--grammar-backend none)")
        compiled = None if constraint in self.jobs else self.cache.get(constraint)
        if compiled is None:
            job = self._wait_for(constraint, req.rid)
            try:
                compiled = self._result(job)
            except Exception:
                self.release(req)
                raise
            if compiled is None:
                return False
        self.release(req)
        req.grammar = self.backend().new_matcher(compiled)
        return True

    def _result(self, job: CompileJob) -> Any | None:
        """``job``'s compiled grammar (cached at its first sight), None while it compiles."""
        if job.error is None and job.overdue(self.compile_timeout):
            job.error = CompileTimeoutError(
                f"the {job.constraint.kind} constraint did not compile within "
                f"{self.compile_timeout:g} s (--grammar-compile-timeout); a smaller one "
                "(fewer enum entries, a shorter pattern) compiles faster")
            self.pool.abandon(job)
            # The OpenAI routes show the requests only finish_reason abort: say why here.
            logger.warning("a %s constraint (%d characters) did not compile within %g s "
                           "(--grammar-compile-timeout); its requests end with abort",
                           job.constraint.kind, len(job.constraint.value),
                           self.compile_timeout)
        if job.error is not None:
            raise job.error
        if not job.future.done():
            return None
        error = job.future.exception()
        if error is not None:
            # Not cached: a failure other than the constraint's own may pass next time.
            if isinstance(error, InvalidConstraintError):
                raise error
            raise InvalidConstraintError(job.constraint.kind, f"{type(error).__name__}: {error}")
        compiled = job.future.result()
        if job.constraint not in self.cache:
            self.cache.put(job.constraint, compiled, self.backend().size_bytes(compiled))
        return compiled

    def release(self, req: Any) -> None:
        """``req`` no longer waits for a grammar (it got one, failed, or ended).

        A compile that nobody waits for any more is abandoned: never started if it
        was queued, its result dropped if it runs.
        """
        constraint = self.constraint_of(req.sampling_params)
        waiting = self.waiters.get(constraint) if constraint is not None else None
        if waiting is None:
            return
        waiting.discard(req.rid)
        if not waiting:
            del self.waiters[constraint]  # type: ignore[arg-type]
            job = self.jobs.pop(constraint)  # type: ignore[arg-type]
            if not job.future.done():
                self.pool.abandon(job)

    def compiled(self, constraint: Constraint, timeout: float) -> Any:
        """The compiled grammar of ``constraint``, from the cache or compiled now.

        Blocks up to ``timeout`` seconds (``TimeoutError`` past it, the compile left
        running for the next call): for tools and tests; the Scheduler never blocks.
        """
        compiled = self.cache.get(constraint)
        if compiled is not None:
            return compiled
        job = self.jobs.get(constraint)
        if job is None:
            job = self.jobs[constraint] = self.pool.submit(constraint)
        if not cf.wait([job.future], timeout=timeout).done:
            raise TimeoutError(f"the {constraint.kind} constraint did not compile within "
                               f"{timeout:g} s")
        try:
            return self._result(job)
        finally:
            if constraint not in self.waiters:
                del self.jobs[constraint]

    def compiling(self) -> bool:
        """True while some compile that a request waits for has not finished."""
        return any(not job.future.done() for job in self.jobs.values())

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some running compile finishes."""
        running = [job.future for job in self.jobs.values() if not job.future.done()]
        if running:
            cf.wait(running, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # ------------------------------------------------------------------ decoding

    def bitmask(self, matchers: Sequence[GrammarMatcher | None],
                device: torch.device) -> torch.Tensor | None:
        """The step's packed token bitmask, ``[B, words]`` int32 on ``device``.

        Rows without a matcher allow every token; None when no row has one, so an
        unconstrained batch pays nothing.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        mask = torch.full((len(matchers), bitmask_words(self.vocab_size)), -1,
                          dtype=torch.int32)
        constrained = [matchers[i] for i in rows]
        self.backend().fill_bitmask(constrained, mask, rows)  # type: ignore[arg-type]
        return mask.to(device)

    def close(self) -> None:
        """Drop queued compiles; running ones end on their own (daemon) threads."""
        self.pool.close()
