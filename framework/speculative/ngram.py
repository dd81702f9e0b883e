"""Prompt-lookup drafting: the tokens that followed the last time the context's tail appeared.

A request that re-emits parts of its prompt (code edited in place, a quoted document, a
JSON object filled from the prompt) repeats long runs of tokens. The proposer looks for the
most recent earlier occurrence of the sequence's last ``n`` tokens, longest ``n`` first,
and drafts the ``k`` tokens that followed it. When fewer than ``k`` follow before the
sequence ends, the match lies inside a run that repeats itself (a loop of a few tokens,
a list of like items), and the copy goes on through the tokens it has just drafted, as a
self-overlapping copy does: the run's period continues. No model runs.

A request's ``DraftLength`` sets how far it drafts, from how its last draft fared, and its
``NgramIndex`` keeps where each of its n-grams last ended and is brought up
to date with the tokens a step adds, so that a draft costs a few dictionary reads rather
than a scan of all the request's tokens (a scan took about 100 us for 250 tokens, 8% of
a decode step of the default model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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

    def index(self) -> NgramIndex:
        """An empty index for one request's tokens (``NgramIndex.sync`` fills it)."""
        return NgramIndex(self.max_ngram, self.min_ngram)

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """The draft after ``tokens`` (prompt then output), indexed anew."""
        index = self.index()
        index.sync(tokens, ())
        return self.draft(index, limit)

    def draft(self, index: NgramIndex, limit: int | None = None) -> list[int]:
        """The draft after ``index``'s tokens: at most ``limit`` (default
        ``num_draft_tokens``) tokens, empty when no tail of ``min_ngram`` tokens recurs."""
        budget = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        if budget <= 0:
            return []
        end = index.match_end()
        if end is None:
            return []
        # The tokens after the match, repeated from its end: the overlapping copy.
        tokens = index.tokens
        period = len(tokens) - 1 - end
        return [tokens[end + 1 + i % period] for i in range(budget)]


#: The draft length a request starts from, and the least it falls to (``DraftLength``).
DRAFT_LENGTH_FLOOR = 4


@dataclass
class DraftLength:
    """How many tokens one request drafts at its next step, from how its last draft fared.

    A prompt-lookup draft costs no forward, only its rows in the verify step, so its length
    can follow the request: it starts at ``DRAFT_LENGTH_FLOOR``; after a step that accepted
    the whole draft, the next is twice as long, up to ``most``; after one that did not, one
    token longer than the part accepted, and never under the floor. A request re-emitting
    a long run drafts far ahead while it lasts, one writing new text drafts a few tokens.
    """

    most: int
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.current = min(DRAFT_LENGTH_FLOOR, self.most)

    def update(self, drafted: int, accepted: int) -> None:
        """Take in the outcome of a step that drafted ``drafted`` tokens and kept
        ``accepted`` of them."""
        wanted = 2 * drafted if accepted >= drafted else accepted + 1
        self.current = min(self.most, max(DRAFT_LENGTH_FLOOR, wanted))


class NgramIndex:
    """Where the latest occurrence of each n-gram (``min_ngram`` to ``max_ngram`` tokens) of
    a growing sequence ends, among those ending before its last token."""

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        #: The sequence so far.
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Take in the tokens of ``prompt`` then ``output`` not yet indexed (a request's
        output only grows; a shorter sequence than the one indexed is indexed anew)."""
        known = len(self.tokens)
        if known > len(prompt) + len(output):
            self.tokens, self._latest, known = [], {}, 0
        if known < len(prompt):
            self.tokens.extend(prompt[known:])
            self.tokens.extend(output)
        else:
            self.tokens.extend(output[known - len(prompt):])
        # The n-grams ending at each position that has a token after it, newly so.
        tokens, latest = self.tokens, self._latest
        for end in range(max(known - 1, 0), len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                latest[tuple(tokens[end + 1 - n:end + 1])] = end

    def match_end(self) -> int | None:
        """Where the latest earlier occurrence of the longest tail (``max_ngram`` tokens down
        to ``min_ngram``) ends, or None."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self._latest.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return end
        return None
