"""A Scheduler subclass that admits the shortest waiting prompts first.

Run it with the server (the module must be importable, hence PYTHONPATH):

    PYTHONPATH=examples framework serve --model-path DIR \
        --scheduler-class shortest_prompt_first.ShortestPromptFirstScheduler

Short prompts then overtake long ones in the waiting queue, which lowers the
average time to first token when prompts differ a lot in length.
"""

from __future__ import annotations

from framework.runtime.scheduler import Scheduler
from framework.runtime.scheduler.batch import ScheduledBatch


class ShortestPromptFirstScheduler(Scheduler):
    """Reorders the waiting queue by prompt length before each prefill selection."""

    def select_prefill_requests(self) -> ScheduledBatch | None:
        # Waiting requests hold no KV (a prompt being prefilled in chunks is kept apart, in
        # self.chunked_req, and goes on first), so the whole queue can be reordered.
        shortest_first = sorted(self.waiting, key=lambda r: len(r.origin_input_ids))
        self.waiting.clear()
        self.waiting.extend(shortest_first)
        return super().select_prefill_requests()
