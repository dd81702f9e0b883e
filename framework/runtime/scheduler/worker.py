"""The model worker: the Scheduler's one seam to the model.

The Scheduler hands a worker a ``WorkerBatch`` (the step's packed ``ForwardBatch``
and how to sample it) and gets a ``StepResult`` back: each sampling row's new tokens,
their logprobs and the prompt logprobs asked for, or pooled embeddings. A result
may carry several tokens for a request (a worker that drafts and verifies them);
the plain worker gives one each. What runs behind the interface (the
``ModelRunner`` of this process and its ranks, a wrapper that runs another worker
on a thread of its own, the tests' fake model) is the worker's business: the
Scheduler reads only what is declared here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from framework.layers.sampler import SamplingRequest, StepSample, sample_step

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.mem_cache.memory_pool import KVCachePools
    from framework.model_executor.model_runner import ModelRunner
    from framework.speculative.verifier import DraftVerifier


@dataclass
class WorkerBatch:
    """One step as a worker runs it."""

    forward_batch: ForwardBatch
    #: Which rows sample and how; None for a step of an embedding model.
    sampling: SamplingRequest | None = None
    #: With overlap scheduling, the numbers under which the sampling rows' tokens are
    #: kept for the steps built before they exist (``OverlapWorker``).
    future_slots: list[int] | None = None
    #: Speculative decoding: per sampling row, the drafted tokens the step verifies
    #: (empty for a row without); None in a step that verifies nothing.
    drafts: list[list[int]] | None = None


@dataclass
class StepResult:
    """What one model step produced, before any request's state changes.

    ``next_ids[k]`` are the new tokens of the ``k``-th sampling row
    (``SamplingRequest.rows``), in order; ``logprobs[k]`` and the top alternatives
    go with them token by token when the step asked for logprobs (else they are
    empty). The prompt-logprob values follow ``SamplingRequest.prompt_targets``.
    """

    embeddings: torch.Tensor | None = None  # [B, hidden], for embedding models
    next_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    top_logprobs_val: list[list[list[float]]] = field(default_factory=list)
    top_logprobs_idx: list[list[list[int]]] = field(default_factory=list)
    prompt_values: list[float] = field(default_factory=list)
    prompt_top_values: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    #: Wall time of the model forward alone (device work included), for the step's
    #: breakdown; sampling and the worker's own bookkeeping are not in it.
    forward_seconds: float = 0.0

    @classmethod
    def one_token_each(cls, sample: StepSample, forward_seconds: float) -> StepResult:
        """The result of a plain step: one sampled token (and its logprobs) per row."""
        return cls(
            next_ids=[[token] for token in sample.next_ids],
            logprobs=[[value] for value in sample.logprobs],
            top_logprobs_val=[[values] for values in sample.top_logprobs_val],
            top_logprobs_idx=[[ids] for ids in sample.top_logprobs_idx],
            prompt_values=sample.prompt_values,
            prompt_top_values=sample.prompt_top_values,
            prompt_top_ids=sample.prompt_top_ids,
            forward_seconds=forward_seconds,
        )


class ModelWorker(ABC):
    """Runs the model one step at a time for the Scheduler.

    Besides its steps, a worker gives the Scheduler what it allocates from and how
    to build steps: the served model's facts, the request and KV slot pools, the
    device a ``ForwardBatch`` goes to and the one a step's sampling info is built on.
    """

    #: The served model's facts: context length, vocabulary size, EOS ids, whether it
    #: serves embeddings (a ``ModelConfig``).
    model_config: Any
    #: The request rows and KV slots the Scheduler allocates from.
    pools: KVCachePools
    #: Where a ``ForwardBatch``'s tensors go.
    device: torch.device
    #: Where a step's ``SamplingBatchInfo`` is built: the CPU when it travels to the
    #: rank that samples.
    sampling_device: torch.device

    @abstractmethod
    def forward_step(self, batch: WorkerBatch) -> StepResult:
        """Run one step; its new tokens' keys and values land in the KV cache.

        Raises whatever the step raised: the Scheduler then frees the step's slots and
        finds the request at fault.
        """

    @abstractmethod
    def update_weights_from_disk(self, model_path: str, load_format: str = "auto"
                                 ) -> tuple[bool, str]:
        """Load another checkpoint of the same shapes: ``(success, message)``; on failure
        the previous weights keep serving."""

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """Load LoRA adapter ``name`` from ``path``: ``(success, message)``."""
        return False, "this model worker serves no LoRA adapters"

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """Unload LoRA adapter ``name``: ``(success, message)``."""
        return False, "this model worker serves no LoRA adapters"

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Fields for ``/get_server_info``: ``attention_backend``, ``linear_backend``,
        ``device``, ``dtype``, and whatever else the worker reports of itself."""

    def close(self) -> None:  # noqa: B027 (most workers run nothing beside the Scheduler)
        """Stop whatever the worker runs beside the Scheduler (nothing, by default)."""


class ModelRunnerWorker(ModelWorker):
    """The plain worker: a ``ModelRunner`` in this process, one step at a time.

    With tensor or pipeline parallelism it is the runner of global rank 0, which
    announces each step to the other ranks; with pipeline parallelism the last stage
    samples, so the step's sampling request travels with it (built on the CPU) and the
    sample comes back instead of the logits.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model_config = runner.model_config
        self.pools = runner.pools
        self.device = runner.device
        self._samples_remotely = runner.samples_at_last_stage
        self.sampling_device = torch.device("cpu") if self._samples_remotely else runner.device
        self._verifier: DraftVerifier | None = None

    def forward_step(self, batch: WorkerBatch) -> StepResult:
        """The runner's forward, then its sampler on the logits (or the last stage's sample)."""
        runner = self.runner
        started = time.perf_counter()
        output = runner.forward(batch.forward_batch,
                                batch.sampling if self._samples_remotely else None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sampler would wait anyway
        forward_seconds = time.perf_counter() - started
        if output.embeddings is not None:
            return StepResult(embeddings=output.embeddings, forward_seconds=forward_seconds)
        assert batch.sampling is not None, "a generation step comes with its sampling request"
        sample = output.sample or sample_step(runner.sample, output.next_token_logits,
                                              output.prompt_logits, batch.sampling)
        if batch.drafts is None:
            return StepResult.one_token_each(sample, forward_seconds)
        assert output.next_token_logits is not None, "a verify step samples where it runs"
        if self._verifier is None:
            from framework.speculative.verifier import DraftVerifier

            self._verifier = DraftVerifier(runner.sampler.argmax)
        return self._verifier.result(output.next_token_logits, output.prompt_logits,
                                     batch.sampling, batch.drafts, sample, forward_seconds)

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto"
                                 ) -> tuple[bool, str]:
        """``ModelRunner.update_weights_from_disk`` (all ranks or none)."""
        return self.runner.update_weights_from_disk(model_path, load_format)

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """Load and check the adapter here, on rank 0; the other ranks load it from the
        path that the first step naming it carries (``LoraServing.describe``)."""
        return _lora_call(self.runner, lambda lora: lora.load(name, path),
                          f"loaded LoRA adapter {name!r}")

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """Free the adapter's slot here; the other ranks' copies are never named again."""
        return _lora_call(self.runner, lambda lora: lora.unload(name),
                          f"unloaded LoRA adapter {name!r}")

    def info(self) -> dict[str, Any]:
        """The runner's backends, device, dtype and KV cache dtype, each rank's pid and bytes
        of weights and KV cache, and the pipeline micro-batches run so far (rank 0's)."""
        runner = self.runner
        return {
            **runner.ranks_info(),
            "pp_micro_batches": runner.micro_batches,
            "attention_backend": runner.attention_backend,
            "linear_backend": runner.linear_backend,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": runner.pools.token_to_kv_pool.kv_cache_dtype,
        }


def _lora_call(runner: ModelRunner, action: Any, done: str) -> tuple[bool, str]:
    """``action(runner.lora)`` as ``(success, message)``, the error's message on failure."""
    if runner.lora is None:
        return False, "LoRA is not enabled: start with --lora-paths or --max-loaded-loras"
    try:
        action(runner.lora)
    except (KeyError, ValueError, RuntimeError, OSError) as exc:
        return False, str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)
    return True, done
