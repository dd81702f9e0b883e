"""Overlap scheduling: the model computes step N on a thread of its own while the
Scheduler applies step N-1's result and builds step N+1.

Step N+1 is built before step N's tokens are known. A request decoding in both
feeds step N+1 a placeholder (a negative id) for the token step N samples for it;
``OverlapWorker`` runs steps in order on its thread and, just before a step
runs, replaces each placeholder with the token the step before it wrote under
that number. Everything else step N+1 needs is known when it is built: each
request's KV length is counted forward as a step is launched (``PreparedStep``),
and a request that can take no further token by length is left out of the decode
batch.

What a step cannot be built without is applied first (``Scheduler`` settles the
step in flight): a request in flight whose sampling reads its output so far
(penalties, ``min_new_tokens``, a grammar mask, a seeded stream), one that wants
its prompt's logprobs, a retraction, and any RPC.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from framework.runtime.scheduler.worker import ModelWorker, StepResult, WorkerBatch

if TYPE_CHECKING:
    from framework.config import ServerArgs


def overlap_enabled(server_args: ServerArgs, device: torch.device, is_embedding: bool) -> bool:
    """Whether steps overlap: ``--overlap-schedule`` (``auto``: on CUDA devices only),
    never with ``--disable-overlap-schedule``, speculative decoding, nor for embedding
    models (their steps sample nothing a next step would wait for)."""
    if server_args.disable_overlap_schedule or is_embedding:
        return False
    if server_args.speculative_algorithm is not None:
        return False  # a verify step's tokens decide the next step's inputs and slots
    if server_args.overlap_schedule == "auto":
        return device.type == "cuda"
    return server_args.overlap_schedule == "on"


class OverlapWorker(ModelWorker):
    """Runs another worker's steps, in order, on one thread of its own.

    ``launch`` returns at once with the step's future; ``forward_step`` waits for
    it. ``reserve`` numbers the tokens a step will sample, so that a later step can
    name them before they exist (``placeholder``).
    """

    def __init__(self, inner: ModelWorker, *, ring_size: int) -> None:
        self.inner = inner
        self.model_config = inner.model_config
        self.pools = inner.pools
        self.device = inner.device
        self.sampling_device = inner.sampling_device
        # The tokens steps sampled, under the numbers ``reserve`` handed out; a number
        # is reused ``ring_size`` tokens later, long after the step that read it ran.
        self._ring = torch.zeros(ring_size, dtype=torch.int64, device=inner.device)
        self._next = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker")

    def reserve(self, count: int) -> list[int]:
        """``count`` fresh token numbers (ring positions) for a step's sampling rows (called
        on the Scheduler's thread only)."""
        start = self._next
        self._next = (start + count) % self._ring.numel()
        return [(start + k) % self._ring.numel() for k in range(count)]

    @staticmethod
    def placeholder(number: int) -> int:
        """The input id that stands for the token under ``number`` until it exists."""
        return -number - 1

    def launch(self, batch: WorkerBatch) -> Future[StepResult]:
        """Queue ``batch`` on the worker's thread; its result (or error) comes in the future."""
        return self._thread.submit(self._run, batch)

    def forward_step(self, batch: WorkerBatch) -> StepResult:
        """Run ``batch`` after the steps queued before it, and wait for it."""
        return self.launch(batch).result()

    def _run(self, batch: WorkerBatch) -> StepResult:
        ids = batch.forward_batch.input_ids
        pending = ids < 0
        if bool(pending.any()):
            ids[pending] = self._ring[-ids[pending] - 1]
        result = self.inner.forward_step(batch)
        if batch.future_slots:
            last = [tokens[-1] for tokens in result.next_ids]
            self._ring[torch.tensor(batch.future_slots, device=self._ring.device)] = \
                torch.tensor(last, dtype=torch.int64, device=self._ring.device)
        return result

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """The inner worker's, between its steps (on its thread)."""
        return self._thread.submit(self.inner.load_lora_adapter, name, path).result()

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """The inner worker's, between its steps (on its thread)."""
        return self._thread.submit(self.inner.unload_lora_adapter, name).result()

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto"
                                 ) -> tuple[bool, str]:
        """The inner worker's update, on the worker's thread (after the steps queued)."""
        return self._thread.submit(self.inner.update_weights_from_disk, model_path,
                                   load_format).result()

    def info(self) -> dict[str, Any]:
        """The inner worker's fields."""
        return self.inner.info()

    def close(self) -> None:
        """Let the steps queued finish, stop the thread, and close the inner worker."""
        self._thread.shutdown(wait=True)
        self.inner.close()
