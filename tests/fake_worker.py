"""A deterministic fake model worker, and a harness that drives a real Scheduler with it.

The fake model reads each request's tokens back from a fake KV cache (one
token id per KV slot, written at ``out_cache_loc`` and read through
``req_to_token``), so a wrong slot anywhere (a bad prefix match, a freed slot
reused too early, a row not rewritten) changes the next token. The next token
is a hash of the whole sequence; it is EOS now and then, so that requests can
end early. With one-hot logits, greedy and sampled choices agree.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch

from framework.comm.inproc import InprocTransport
from framework.config import PortArgs, ServerArgs
from framework.forward_batch import ForwardBatch
from framework.layers.sampler import Sampler, sample_step
from framework.mem_cache.memory_pool import KVCachePools
from framework.messages import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    PromptLogprobs,
    TokenizedGenerateReqInput,
)
from framework.runtime.scheduler import ModelWorker, Scheduler, StepResult, WorkerBatch
from framework.runtime.scheduler.speculation import WORKER_DRAFTS
from framework.sampling_params import SamplingParams
from framework.speculative.ngram import NgramIndex
from framework.speculative.verifier import DraftVerifier
from tests.model_fixtures import EOS_TOKEN_ID, TINY_VOCAB_SIZE, make_tiny_tokenizer

CPU = torch.device("cpu")


def next_token(tokens: list[int], vocab: int = TINY_VOCAB_SIZE) -> int:
    """The fake model's choice after ``tokens``: EOS about one time in 16."""
    digest = hashlib.blake2b(str(tokens).encode(), digest_size=4).digest()
    value = int.from_bytes(digest, "little")
    return EOS_TOKEN_ID if value % 16 == 0 else 3 + value % (vocab - 3)


@dataclass(frozen=True)
class FakeModelProposer:
    """Drafts what the fake model will answer for ``right`` tokens, then ``wrong`` tokens
    it will not: verify steps then accept some drafts and reject others."""

    right: int = 2
    wrong: int = 1

    def index(self) -> NgramIndex:
        """What the planner keeps of a request's tokens, as for the n-gram proposer."""
        return NgramIndex(max_ngram=1, min_ngram=1)

    def draft(self, index: NgramIndex, limit: int) -> list[int]:
        """The draft after the tokens ``index`` holds (the planner's call)."""
        return self.propose(index.tokens, limit)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        seq, draft = list(tokens), []
        for j in range(min(limit, self.right + self.wrong)):
            token = next_token(seq)
            if j >= self.right:
                token = 3 + (token - 2) % (TINY_VOCAB_SIZE - 3)  # any other token
            draft.append(token)
            seq.append(token)
        return draft


@dataclass
class ForwardCall:
    """What one forward step was given."""

    mode: str
    prefix_lens: list[int]
    extend_lens: list[int]
    #: Each request's LoRA adapter (None: the base model), when any request names one.
    lora_names: list[str | None] | None = None


class FakeModelWorker(ModelWorker):
    """A ``ModelWorker`` whose model reads each request's tokens back from a fake KV cache.

    ``fail_if(tokens)`` returning True for a request's sequence makes any step
    that holds it raise.
    """

    def __init__(self, *, max_total_tokens: int = 512, max_requests: int = 8,
                 context_len: int = 256, fail_if: Callable[[list[int]], bool] | None = None
                 ) -> None:
        self.model_config = SimpleNamespace(
            context_len=context_len, vocab_size=TINY_VOCAB_SIZE, eos_token_ids=[EOS_TOKEN_ID],
            is_embedding=False)
        self.device = self.sampling_device = CPU
        self.pools = KVCachePools.build(
            max_total_tokens=max_total_tokens, max_requests=max_requests,
            context_len=context_len, dtype=torch.float32, num_kv_heads=1, head_dim=1,
            num_layers=1, device=CPU)
        self.slot_tokens = torch.full((max_total_tokens + 1,), -1, dtype=torch.int64)
        self.fail_if = fail_if
        self.calls: list[ForwardCall] = []
        self.sampler = Sampler()
        self.verifier = DraftVerifier()
        #: Fills the drafts of verify steps planned for a drafting worker
        #: (``--speculative-algorithm draft``), as a draft model would.
        self.drafter = FakeModelProposer(right=1, wrong=8)

    def forward_step(self, batch: WorkerBatch) -> StepResult:
        assert batch.sampling is not None, "the fake model generates text"
        if batch.drafts is not None and any(WORKER_DRAFTS in d for d in batch.drafts):
            batch = self._drafted(batch)
        started = time.perf_counter()
        logits, prompt_logits = self.forward(batch.forward_batch)
        forward_seconds = time.perf_counter() - started
        sample = sample_step(self.sampler, logits, prompt_logits, batch.sampling)
        if batch.drafts is not None:  # a verify step: the logits at the drafts decide
            return self.verifier.result(logits, prompt_logits, batch.sampling, batch.drafts,
                                        sample, forward_seconds)
        return StepResult.one_token_each(sample, forward_seconds)

    def _drafted(self, batch: WorkerBatch) -> WorkerBatch:
        """``batch`` with its drafts in the placeholders' places, drafted from each request's
        tokens (read back from the fake KV cache) and its last one."""
        forward = batch.forward_batch
        forward.fill_cpu_lengths()
        assert batch.drafts is not None and forward.extend_prefix_lens_cpu is not None
        req_to_token = self.pools.req_to_token_pool.req_to_token
        drafts, offset = [], 0
        for i, placeholders in enumerate(batch.drafts):
            row, prefix = int(forward.req_pool_indices[i]), forward.extend_prefix_lens_cpu[i]
            tokens = self.slot_tokens[req_to_token[row, :prefix]].tolist()
            tokens.append(int(forward.input_ids[offset]))
            drafted = self.drafter.propose(tokens, len(placeholders))
            assert len(drafted) == len(placeholders)
            forward.input_ids[offset + 1:offset + 1 + len(drafted)] = torch.tensor(drafted)
            drafts.append(drafted)
            offset += 1 + len(drafted)
        return replace(batch, drafts=drafts)

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """Nothing to load: the fake model answers alike under every adapter."""
        return True, f"loaded LoRA adapter {name!r}"

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """Nothing to free."""
        return True, f"unloaded LoRA adapter {name!r}"

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next-token logits of each request, and those at its prompt-logprob rows (and
        a verify step's draft rows)."""
        batch.fill_cpu_lengths()
        req_to_token = self.pools.req_to_token_pool.req_to_token
        self.slot_tokens[batch.out_cache_loc] = batch.input_ids
        extend = batch.forward_mode.is_extend()
        new_lens = batch.extend_seq_lens_cpu if extend else [1] * batch.batch_size
        prefix_lens = batch.extend_prefix_lens_cpu if extend else [
            n - 1 for n in batch.seq_lens_cpu or []]
        self.calls.append(ForwardCall(batch.forward_mode.name.lower(), list(prefix_lens or []),
                                      list(new_lens or []), batch.lora_names))
        logits = torch.full((batch.batch_size, TINY_VOCAB_SIZE), -30.0)
        for i, seq_len in enumerate(batch.seq_lens_cpu or []):
            row = int(batch.req_pool_indices[i])
            tokens = self.slot_tokens[req_to_token[row, :seq_len]].tolist()
            if self.fail_if is not None and self.fail_if(tokens):
                raise RuntimeError("the fake model failed on this request")
            logits[i, next_token(tokens)] = 30.0
        return logits, self._prompt_logits(batch)

    def _prompt_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        """One-hot logits at each of ``prompt_logprob_rows``, read from the fake KV cache."""
        if batch.prompt_logprob_rows is None:
            return None
        starts = [0]
        for n in batch.extend_seq_lens_cpu or []:
            starts.append(starts[-1] + n)
        rows = batch.prompt_logprob_rows.tolist()
        logits = torch.full((len(rows), TINY_VOCAB_SIZE), -30.0)
        req_to_token = self.pools.req_to_token_pool.req_to_token
        for k, packed in enumerate(rows):
            i = max(j for j, start in enumerate(starts[:-1]) if start <= packed)
            position = (batch.extend_prefix_lens_cpu or [])[i] + packed - starts[i]
            pool_row = int(batch.req_pool_indices[i])
            tokens = self.slot_tokens[req_to_token[pool_row, :position + 1]].tolist()
            logits[k, next_token(tokens)] = 30.0
        return logits

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto"
                                 ) -> tuple[bool, str]:
        return True, "fake weights updated"

    def info(self) -> dict[str, Any]:
        return {"attention_backend": "none (fake model worker)",
                "linear_backend": "none (fake model worker)", "device": "cpu",
                "dtype": "float32"}


@dataclass
class Outcome:
    """Everything one request produced, as the Detokenizer would have received it."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    finished_reason: Any = None
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    messages: int = 0
    prompt_logprobs: PromptLogprobs | None = None


class SchedulerHarness:
    """A real Scheduler on a model worker (the fake one by default), over the inproc
    transport, stepped by hand."""

    def __init__(self, worker: ModelWorker | None = None, scheduler_class: type = Scheduler,
                 **server_args: Any) -> None:
        self.worker = worker or FakeModelWorker()
        self.transport = InprocTransport()
        self.port_args = PortArgs.create(self.transport)
        server_args.setdefault("transport", "inproc")
        self.server_args = ServerArgs(**server_args)
        self.scheduler = _with_tiny_tokenizer(scheduler_class)(
            self.server_args, self.port_args, self.transport, model_worker=self.worker)
        codec = self.scheduler.recv_from_tokenizer.codec
        self.to_scheduler = self.transport.sender(self.port_args.scheduler_input, codec)
        self.from_scheduler = self.transport.receiver(self.port_args.detokenizer_input, codec)
        self.embeddings = self.transport.receiver(self.port_args.embedding_output, codec)
        self.metrics = self.transport.receiver(self.port_args.metrics, codec)
        self.outcomes: dict[str, Outcome] = {}
        # Outputs name requests by handle, as the TokenizerManager numbers them.
        self.rid_of_handle: dict[int, str] = {}

    def submit(self, rid: str, input_ids: list[int], **params: Any) -> None:
        """Send one generation request (it is taken in at the next step)."""
        logprob_options = {key: params.pop(key) for key in (
            "return_logprob", "top_logprobs_num", "logprob_start_len", "lora_name")
            if key in params}
        self.outcomes[rid] = Outcome()
        handle = len(self.rid_of_handle) + 1
        self.rid_of_handle[handle] = rid
        self.to_scheduler.send_nowait(TokenizedGenerateReqInput(
            rid=rid, handle=handle, input_text="", input_ids=input_ids,
            sampling_params=SamplingParams(**params), **logprob_options))

    def send(self, msg: Any) -> None:
        """Send any message to the Scheduler's request channel."""
        self.to_scheduler.send_nowait(msg)

    def step(self) -> None:
        """One Scheduler step, then collect what it sent."""
        self.scheduler.step()
        self.collect()

    def collect(self) -> None:
        """Apply every output the Scheduler has sent so far."""
        for msg in self.from_scheduler.drain():
            assert isinstance(msg, BatchTokenIDOutput)
            reasons = msg.finished_reason_list()
            new = msg.new_constants_by_index()
            prompts = dict(zip(msg.prompt_logprob_indices, msg.prompt_logprobs))
            for i, handle in enumerate(msg.handles.tolist()):
                rid = self.rid_of_handle[handle]
                outcome = self.outcomes.setdefault(rid, Outcome())
                assert outcome.finished_reason is None, f"{rid} got output after it finished"
                # Constants come with the first output, and only with it.
                assert (i in new) == (outcome.messages == 0), f"{rid}: constants misplaced"
                if i in new:
                    outcome.cached_tokens = new[i].cached_tokens
                    outcome.queue_seconds = new[i].queue_seconds
                # The prompt's logprobs come with the first output, and only with it.
                assert i not in prompts or i in new, f"{rid}: prompt logprobs misplaced"
                outcome.prompt_logprobs = prompts.get(i, outcome.prompt_logprobs)
                outcome.output_ids.extend(msg.ids_of(i))
                outcome.logprobs.extend(msg.logprobs_of(i))
                outcome.top_logprobs.extend(msg.top_logprobs_of(i)[0])
                outcome.finished_reason = reasons[i]
                outcome.messages += 1
        for msg in self.embeddings.drain():
            assert isinstance(msg, BatchEmbeddingOutput)

    def run(self, max_steps: int = 10_000) -> dict[str, Outcome]:
        """Step until every submitted request has finished and no step is in flight (a
        bounded loop, never a hang)."""
        for _ in range(max_steps):
            self.step()
            if (all(o.finished_reason is not None for o in self.outcomes.values())
                    and self.scheduler.in_flight is None):
                return self.outcomes
        unfinished = [r for r, o in self.outcomes.items() if o.finished_reason is None]
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {unfinished}")

    def assert_idle_invariant(self) -> None:
        """Nothing in flight, free + evictable == pool, nothing locked, every row free."""
        scheduler = self.scheduler
        allocator, cache = scheduler.allocator, scheduler.tree_cache
        assert not scheduler.all_requests()
        assert cache.protected_size() == 0
        assert allocator.available_size() + cache.evictable_size() == allocator.size
        pool = scheduler.req_to_token_pool
        assert pool.available_size() == pool.size
        assert scheduler.memory_is_free()
        self.assert_slots_accounted()

    def assert_slots_accounted(self) -> None:
        """Between steps: each KV slot is free, held by the prefix cache, or owned by
        exactly one live request; each request row is free or held by exactly one."""
        problem = self.scheduler.slot_accounting_problem()
        assert problem is None, problem

    def close(self) -> None:
        self.scheduler.close()
        self.port_args.cleanup()


def _with_tiny_tokenizer(scheduler_class: type) -> type:
    """``scheduler_class`` with the tiny test tokenizer instead of one read from disk."""

    class TinyTokenizerScheduler(scheduler_class):  # type: ignore[misc, valid-type]
        def load_tokenizer(self) -> Any:
            return make_tiny_tokenizer()

    return TinyTokenizerScheduler


def reference_output(prompt: list[int], max_new_tokens: int, ignore_eos: bool = False
                     ) -> list[int]:
    """The fake model's greedy output computed directly, without the runtime."""
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = next_token(tokens)
        out.append(token)
        tokens.append(token)
        if token == EOS_TOKEN_ID and not ignore_eos:
            break
    return out


def prompt(seed: int, length: int) -> list[int]:
    """A deterministic prompt of ``length`` ids in [3, 500)."""
    return [3 + (seed * 131 + i * 17) % 497 for i in range(length)]
