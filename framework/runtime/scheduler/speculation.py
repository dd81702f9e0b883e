"""Which tokens each decode step drafts (speculative decoding, ``--speculative-algorithm``).

A decode step of the running requests becomes a verify step: each request that can take
drafts feeds its last token and the proposer's draft, and the model's logits at every fed
position decide how many of them it keeps (``framework.speculative.verifier``). Drafts
fit the request's remaining token budget and context, and the KV slots free beyond one a
request (which the plain decode step needs), so speculation never retracts a request.

With ``ngram`` the planner drafts itself. With ``draft`` the draft model runs in the model
worker (``framework.speculative.draft_worker``), which owns both models: the planner only
sizes each request's draft and the step carries ``WORKER_DRAFTS`` in its places.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.runtime.request import Req
from framework.runtime.scheduler.batch import ScheduledBatch
from framework.speculative.ngram import DraftLength, NgramIndex, NgramProposer

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.mem_cache.prefix_cache import PrefixCache

#: The token a verify step carries in a draft's place until the worker drafts it.
WORKER_DRAFTS = -1


@dataclass
class _Lookup:
    """What the planner keeps of one running request for prompt lookup: its n-gram index,
    its draft length, and its last draft's size with the request's verify steps and
    accepted drafts counted then (so that the next step reads how that draft fared)."""

    index: NgramIndex
    length: DraftLength
    drafted: int = 0
    verify_ct: int = 0
    accepted: int = 0

    def learn(self, req: Req) -> None:
        """Take in the outcome of the request's last draft, if one step verified it."""
        if self.drafted and req.spec_verify_ct == self.verify_ct + 1:
            self.length.update(self.drafted, req.spec_accepted_tokens - self.accepted)
        self.drafted = 0

    def drafting(self, req: Req, count: int) -> None:
        """Note that the request drafts ``count`` tokens at this step."""
        self.drafted, self.verify_ct, self.accepted = \
            count, req.spec_verify_ct, req.spec_accepted_tokens


class DraftPlanner:
    """Turns a decode step into a verify step with each request's draft."""

    def __init__(self, proposer: NgramProposer | None, num_draft_tokens: int,
                 tree_cache: PrefixCache, context_len: int,
                 disable_by_batch_size: int | None = None) -> None:
        #: The n-gram proposer; None when the worker drafts (``draft``).
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        #: Above this many running requests, decode steps draft nothing.
        self.disable_by_batch_size = disable_by_batch_size
        self.tree_cache = tree_cache
        self.context_len = context_len
        # Each running request's n-gram index and draft length (``ngram``), by request id.
        self._lookups: dict[str, _Lookup] = {}

    @classmethod
    def create(cls, server_args: ServerArgs, tree_cache: PrefixCache,
               context_len: int) -> DraftPlanner | None:
        """The planner ``--speculative-algorithm`` asks for; None without speculation."""
        if server_args.speculative_algorithm is None:
            return None
        k = server_args.resolved_num_draft_tokens()
        proposer = NgramProposer(num_draft_tokens=k, max_ngram=server_args.speculative_ngram_max) \
            if server_args.speculative_algorithm == "ngram" else None
        return cls(proposer, k, tree_cache, context_len,
                   server_args.speculative_disable_by_batch_size)

    def decode_step(self, running: list[Req]) -> ScheduledBatch:
        """The step for ``running``: a verify step when any request has a draft."""
        limit = self.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return ScheduledBatch.decode(running)
        spare = self.tree_cache.available_size() - len(running)
        drafts = []
        for req in running:
            draft = self.draft(req, spare) if spare > 0 else []
            spare -= len(draft)
            drafts.append(draft)
        if len(self._lookups) > len(running):  # requests that ended or left the batch
            ids = {req.rid for req in running}
            self._lookups = {rid: kept for rid, kept in self._lookups.items() if rid in ids}
        if not any(drafts):
            return ScheduledBatch.decode(running)
        return ScheduledBatch.verify(running, drafts)

    def draft(self, req: Req, spare: int) -> list[int]:
        """``req``'s draft: none where its sampler changes from position to position."""
        if not req.steady_sampling:
            return []
        # The step always adds the target's own token after the accepted drafts.
        room = min(req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                   self.context_len - req.seq_len - 1, spare)
        if room <= 0:
            return []
        if self.proposer is None:
            return [WORKER_DRAFTS] * min(room, self.num_draft_tokens)
        lookup = self._lookups.get(req.rid)
        if lookup is None:
            lookup = self._lookups[req.rid] = _Lookup(self.proposer.index(),
                                                      DraftLength(self.num_draft_tokens))
        lookup.learn(req)
        lookup.index.sync(req.origin_input_ids, req.output_ids)
        draft = self.proposer.draft(lookup.index, min(room, lookup.length.current))
        lookup.drafting(req, len(draft))
        return draft
