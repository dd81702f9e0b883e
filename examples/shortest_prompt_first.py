"""A Scheduler subclass that admits the shortest waiting prompts first.

Run it with the server (the module must be importable, hence PYTHONPATH):

    PYTHONPATH=examples framework serve --model-path DIR \
        --scheduler-class shortest_prompt_first.ShortestPromptFirstScheduler

Short prompts then overtake long ones in the waiting queue, which lowers the
average time to first token when prompts differ a lot in length.
"""

from __future__ import annotations

from framework.runtime.scheduler import ScheduledBatch, Scheduler


class ShortestPromptFirstScheduler(Scheduler):
    """Reorders the waiting queue by prompt length before each prefill selection."""

    def select_prefill_requests(self) -> ScheduledBatch | None:
        # A request that already holds KV slots (a prompt being prefilled in chunks) keeps
        # its place at the front; only the requests that have not started are reordered.
        started = [r for r in self.waiting if r.req_pool_idx is not None]
        fresh = sorted((r for r in self.waiting if r.req_pool_idx is None),
                       key=lambda r: len(r.origin_input_ids))
        self.waiting.clear()
        self.waiting.extend(started + fresh)
        return super().select_prefill_requests()
