"""The Scheduler's side of structured outputs: compiling off its loop, caching, bitmasks.

A constrained request waits in the queue until its grammar is compiled; compiling runs
on a worker thread, so neither the loop nor the other requests wait for it. Each
distinct constraint is compiled once and cached (least recently used dropped past
``cache_size``); every request gets its own matcher, kept through retraction and
dropped when the request ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import OrderedDict
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
from framework.constrained.validation import NO_GRAMMAR_BACKEND
from framework.registry import GRAMMAR_BACKENDS
from framework.sampling_params import SamplingParams

_DEFAULT_CACHE_SIZE = 1024


class GrammarManager:
    """Compiles constraints on a worker thread, caches them, and fills a batch's bitmask.

    The backend is built on first use (on the worker thread: reading a large
    vocabulary takes a while), so a server that never sees a constraint never
    imports one. ``tokenizer`` may be a future of it (a Scheduler's loads in the
    background): the backend's build waits for it.
    """

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int], cache_size: int = _DEFAULT_CACHE_SIZE) -> None:
        # Checked by name at start-up, without importing the backend.
        known = [NO_GRAMMAR_BACKEND, *GRAMMAR_BACKENDS.names()]
        if backend_name not in known:
            raise ValueError(f"unknown grammar backend {backend_name!r}; known: "
                             f"{', '.join(known)}")
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[Constraint, cf.Future[Any]] = OrderedDict()

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

    def _compile(self, constraint: Constraint) -> Any:
        return self.backend().compile(constraint)

    def future(self, constraint: Constraint) -> cf.Future[Any]:
        """The compilation of ``constraint``: started now, or the one cached."""
        if constraint in self._compiled:
            self._compiled.move_to_end(constraint)
            return self._compiled[constraint]
        if self._executor is None:
            # One thread: compilations queue behind each other, never behind the loop.
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        future = self._executor.submit(self._compile, constraint)
        self._compiled[constraint] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    @staticmethod
    def constraint_of(params: SamplingParams) -> Constraint | None:
        """The ``Constraint`` a request's ``SamplingParams`` carry, or None."""
        found = params.constraint()
        return None if found is None else Constraint(*found)

    def prefetch(self, params: SamplingParams) -> None:
        """Start compiling a new request's constraint at once (it waits in the queue)."""
        constraint = self.constraint_of(params)
        if constraint is not None and self.backend_name != NO_GRAMMAR_BACKEND:
            self.future(constraint)

    def ready(self, req: Any) -> bool:
        """Whether ``req`` may be scheduled; gives it a matcher when its grammar is compiled.

        ``req`` is the Scheduler's ``Req`` (its ``sampling_params`` and ``grammar``).

        Raises ``InvalidConstraintError`` when its grammar cannot be compiled.
        """
        if req.grammar is not None:
            return True
        constraint = self.constraint_of(req.sampling_params)
        if constraint is None:
            return True
        if self.backend_name == NO_GRAMMAR_BACKEND:
            raise InvalidConstraintError(
                constraint.kind, "structured outputs are off (--grammar-backend none)")
        future = self.future(constraint)
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            # Not cached: a failure other than the constraint's own may pass next time.
            self._compiled.pop(constraint, None)
            if isinstance(error, InvalidConstraintError):
                raise error
            raise InvalidConstraintError(constraint.kind, f"{type(error).__name__}: {error}")
        req.grammar = self.backend().new_matcher(future.result())
        return True

    def compiling(self) -> bool:
        """True while some compilation has not finished."""
        return any(not f.done() for f in self._compiled.values())

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some running compilation finishes."""
        running = [f for f in self._compiled.values() if not f.done()]
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
        """Stop the worker thread (compilations in progress finish first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
