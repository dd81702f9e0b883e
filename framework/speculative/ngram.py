"""Prompt-lookup drafting: the tokens that followed the last time the context's tail appeared.

A request that re-emits parts of its prompt (code edited in place, a quoted document, a
JSON object filled from the prompt) repeats long runs of tokens. The proposer looks for the
most recent earlier occurrence of the sequence's last ``n`` tokens, longest ``n`` first,
and drafts the ``k`` tokens that followed it. When fewer than ``k`` follow before the
sequence ends, the match lies inside a run that repeats itself (a loop of a few tokens,
a list of like items), and the copy goes on through the tokens it has just drafted, as a
self-overlapping copy does: the run's period continues. No model runs: a draft costs a
scan of the request's own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Drafts up to ``num_draft_tokens`` tokens by matching the last ``max_ngram`` down to
    ``min_ngram`` tokens against the earlier ones."""

    num_draft_tokens: int
    max_ngram: int = 4
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and "
                             f"{self.max_ngram}")

    def propose(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> list[int]:
        """The draft after ``tokens`` (prompt then output): at most ``limit`` (default
        ``num_draft_tokens``) tokens, empty when no tail of ``min_ngram`` tokens recurs."""
        budget = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        seq = np.asarray(tokens, dtype=np.int64)
        if budget <= 0 or len(seq) < self.min_ngram + 1:
            return []
        end = self._match_end(seq)
        # np.resize repeats the tokens after the match cyclically: the overlapping copy.
        return [] if end is None else np.resize(seq[end + 1:], budget).tolist()

    def _match_end(self, seq: np.ndarray) -> int | None:
        """Where the latest earlier occurrence of the longest tail of ``seq`` (``max_ngram``
        down to ``min_ngram`` tokens) ends, or None.

        The candidates are the earlier positions holding the last token; each step back
        keeps those whose run still matches the tail, so the scan costs a few vector
        operations over the candidates rather than one over every window for each length.
        """
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # each has a token after it
        if not len(ends):
            return None
        longest = min(self.max_ngram, len(seq) - 1)
        run = np.ones(len(ends), dtype=np.int64)  # tokens matched backwards from each end
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, longest):
            before = ends - back
            alive &= before >= 0
            alive[alive] = seq[before[alive]] == seq[-1 - back]
            run += alive
        for n in range(longest, self.min_ngram - 1, -1):
            hits = ends[run >= n]
            if len(hits):
                return int(hits[-1])
        return None
