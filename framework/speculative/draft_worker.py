"""Draft-model speculation: a smaller model drafts, the served model verifies.

``DraftModelWorker`` is a model worker holding two ``ModelRunner``s: the target (the
served model) and the draft. The draft's KV cache has buffers of its own but the target's
request rows and KV slots (``KVCachePools.beside``), so a slot the Scheduler allocates,
caches in the radix tree or frees holds the draft's keys and values as well as the
target's, under one discipline:

- every prefill step the target runs (a mixed one too), the draft runs over the same new
  tokens (its KV only), so a prompt in the radix cache has the draft's KV as well;
- a plain decode step (no request could draft, or too many decode: see
  ``--speculative-disable-by-batch-size``) runs the target alone: the worker notes each
  request's token as owed to the draft, and the draft's next forward for the request
  feeds the tokens it owes first;
- a verify step arrives with placeholders (``speculation.WORKER_DRAFTS``) where each
  request's drafts go (the planner sized them) and its slots allocated. The draft runs
  first: one forward over the request's last token, which yields the first draft, then
  one per further draft, each writing its token's KV into the slot the target will
  verify it in. The drafts go into the step, and the target verifies them
  (``DraftVerifier``);
- drafting writes the draft KV of every fed token but the last draft. When the target
  accepts all of a request's drafts, that token's draft KV is missing: it is owed too;
- drafting forwards run through the draft's ``DraftDecodePlan`` where its model has one
  (the modules' kernel calls, made in one native call), prefills through its modules.

Drafts are the draft model's greedy tokens, a deterministic proposal: rejection
sampling then keeps the target's distribution exactly, as with n-gram drafts. A slot
cached by the radix tree while its request still owed the draft its KV (the request
ended before drafting again) keeps whatever it held: a later request sharing that prefix
drafts worse there, and its outputs stay the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from framework.config import ServerArgs
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.mem_cache.memory_pool import kv_cache_bytes_per_token
from framework.model_executor.model_config import ModelConfig
from framework.model_executor.model_runner import ModelRunner, resolve_device
from framework.runtime.scheduler.worker import (
    ModelRunnerWorker,
    ModelWorker,
    StepResult,
    WorkerBatch,
)
from framework.speculative.draft_decode import DraftDecodePlan


class DraftModelWorker(ModelWorker):
    """The served model's worker, with a draft model that drafts its verify steps."""

    def __init__(self, target: ModelRunnerWorker, draft: ModelRunner) -> None:
        self.target = target
        self.draft = draft
        self.model_config = target.model_config
        self.pools = target.pools
        self.device = target.device
        self.sampling_device = target.sampling_device
        self._req_to_token = self.pools.req_to_token_pool.req_to_token
        # Per request row: the tokens whose target KV is written and whose draft KV is not,
        # at the positions just before the row's next one.
        self._owed: dict[int, list[int]] = {}
        #: Draft model forwards run so far.
        self.draft_forwards = 0
        # The draft's decode forwards without its module tree, where its model allows.
        self._plan = DraftDecodePlan.build(draft)

    @classmethod
    def build(cls, server_args: ServerArgs, model_path: str) -> DraftModelWorker:
        """The target ``model_path`` and the draft of ``--speculative-draft-model-path``,
        the target's KV pool sized to leave room for the draft's."""
        draft_path = server_args.resolved_draft_model_path()
        assert draft_path is not None, "the draft algorithm comes with a draft model path"
        draft_args = server_args.replace(
            model_path=draft_path, tokenizer_path=None, quantization=None, lora_paths=(),
            max_loaded_loras=None, speculative_algorithm=None,
            speculative_draft_model_path=None)
        draft_config = ModelConfig.from_pretrained(
            draft_path, dtype=server_args.dtype, device=resolve_device(server_args.device, 0))
        beside = kv_cache_bytes_per_token(draft_config.num_kv_heads, draft_config.head_dim,
                                          draft_config.num_layers, draft_config.dtype,
                                          server_args.kv_cache_dtype)
        target = ModelRunner(server_args, model_path, kv_bytes_beside=beside)
        _check_pair(target.model_config, draft_config, draft_path)
        draft = ModelRunner(draft_args.replace(context_length=target.model_config.context_len),
                            draft_path, shared_slots=target.pools)
        return cls(ModelRunnerWorker(target), draft)

    def forward_step(self, batch: WorkerBatch) -> StepResult:
        """A prefill, run by both models; a plain decode step, by the target alone (its
        tokens owed to the draft); a verify step, drafted then verified."""
        forward = batch.forward_batch
        forward.fill_cpu_lengths()  # the host copies below are then all set
        if batch.drafts is None and forward.forward_mode.is_decode():
            result = self.target.forward_step(batch)
            for row, token in zip(forward.req_pool_indices_cpu or [], forward.input_ids.tolist(),
                                  strict=True):
                self._owed.setdefault(row, []).append(token)
            return result
        if batch.drafts is None:
            self._catch_up(forward)
            return self.target.forward_step(batch)
        assert len(batch.drafts) == forward.batch_size, "every request of a verify step samples"
        lengths = [len(drafted) for drafted in batch.drafts]
        drafts = self._draft(forward, lengths)
        result = self.target.forward_step(dataclasses.replace(batch, drafts=drafts))
        rows = forward.req_pool_indices_cpu or []
        for row, drafted, tokens in zip(rows, drafts, result.next_ids, strict=True):
            # All accepted: the last draft's KV was never written by the draft model.
            self._owed[row] = drafted[-1:] if drafted and len(tokens) == len(drafted) + 1 \
                else []
        return result

    def _catch_up(self, forward: ForwardBatch) -> None:
        """Write the draft KV of a prefill step's tokens (and of those its decoding requests
        owe)."""
        rows = forward.req_pool_indices_cpu or []
        first_decoding = forward.batch_size - forward.decode_tail
        owed = []
        for i, row in enumerate(rows):
            held = self._owed.pop(row, [])
            # A prefilling request owes nothing: what its row held was its predecessor's.
            owed.append(held if i >= first_decoding else [])
        if not any(owed):
            self._forward_draft(dataclasses.replace(
                forward, prompt_logprob_rows=None, lora_names=None, lora_in_use=None))
            return
        ids = forward.input_ids.tolist()
        lengths = forward.extend_seq_lens_cpu or []
        starts = list(forward.seq_lens_cpu or [])
        tokens, offset = [], 0
        for i, n in enumerate(lengths):
            tokens.append(owed[i] + ids[offset:offset + n])
            offset += n
            starts[i] -= len(tokens[i])
        self._forward_draft(self._packed(rows, starts, tokens))

    def _draft(self, forward: ForwardBatch, lengths: list[int]) -> list[list[int]]:
        """Each request's ``lengths[i]`` greedy drafts, written into ``forward.input_ids``."""
        rows = forward.req_pool_indices_cpu or []
        prefix = forward.extend_prefix_lens_cpu or []
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n + 1)
        fed = forward.input_ids.tolist()
        # First forward: the tokens owed, then the last one; its logits give draft one.
        owed = [self._owed.pop(row, []) for row in rows]
        tokens = [owed[i] + [fed[offset]] for i, offset in enumerate(offsets[:-1])]
        starts = [prefix[i] - len(owed[i]) for i in range(len(rows))]
        nexts = dict(enumerate(self._run_draft(rows, starts, tokens)))
        drafts: list[list[int]] = [[] for _ in rows]
        for step in range(max(lengths, default=0)):
            active = [i for i, n in enumerate(lengths) if n > step]
            for i in active:
                drafts[i].append(nexts[i])
            further = [i for i in active if lengths[i] > step + 1]
            if not further:
                break
            found = self._run_draft([rows[i] for i in further],
                                    [prefix[i] + step + 1 for i in further],
                                    [[drafts[i][-1]] for i in further])
            nexts = dict(zip(further, found, strict=True))
        places = [offsets[i] + 1 + j for i, n in enumerate(lengths) for j in range(n)]
        if places:
            device = forward.input_ids.device
            forward.input_ids[torch.tensor(places, device=device)] = torch.tensor(
                [token for drafted in drafts for token in drafted], device=device)
        return drafts

    def _packed(self, rows: list[int], starts: list[int], tokens: list[list[int]]
                ) -> ForwardBatch:
        """A draft forward of ``tokens[i]`` at positions ``starts[i]...`` of row ``rows[i]``,
        into the slots the request row already holds there."""
        device = self._req_to_token.device
        lengths = [len(t) for t in tokens]
        token_rows = [row for row, n in zip(rows, lengths, strict=True) for _ in range(n)]
        positions = [p for start, n in zip(starts, lengths, strict=True)
                     for p in range(start, start + n)]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        positions_tensor = tensor(positions)
        seq_lens = [start + n for start, n in zip(starts, lengths, strict=True)]
        decode = all(n == 1 for n in lengths)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=tensor([t for chunk in tokens for t in chunk]),
            positions=positions_tensor,
            req_pool_indices=tensor(rows),
            seq_lens=tensor(seq_lens),
            out_cache_loc=self._req_to_token[tensor(token_rows), positions_tensor],
            extend_prefix_lens=None if decode else tensor(starts),
            extend_seq_lens=None if decode else tensor(lengths),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=None if decode else list(starts),
            extend_seq_lens_cpu=None if decode else lengths,
            req_pool_indices_cpu=list(rows),
        )

    def _run_draft(self, rows: list[int], starts: list[int], tokens: list[list[int]]
                   ) -> list[int]:
        """One draft forward of ``tokens[i]`` at positions ``starts[i]...`` of row
        ``rows[i]``; each request's greedy next token (through the decode plan where the
        draft model has one)."""
        if self._plan is None or not self._plan.fits(sum(len(fed) for fed in tokens)):
            return self._forward_draft(self._packed(rows, starts, tokens))
        self.draft_forwards += 1
        return self._plan.greedy(rows, starts, tokens)

    def _forward_draft(self, forward: ForwardBatch) -> list[int]:
        """One draft forward through the draft model's modules; each request's greedy next
        token."""
        self.draft_forwards += 1
        logits = self.draft.forward(forward).next_token_logits
        assert logits is not None, "the draft model runs on one rank"
        return logits.argmax(dim=-1).tolist()

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto"
                                 ) -> tuple[bool, str]:
        """The target's new weights; the draft keeps its own (drafts may then be accepted
        less often; outputs are the new target's)."""
        return self.target.update_weights_from_disk(model_path, load_format)

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """The target's adapter; the draft drafts for the base model."""
        return self.target.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """Unload the target's adapter."""
        return self.target.unload_lora_adapter(name)

    def info(self) -> dict[str, Any]:
        """The target's fields, the draft model's path and KV bytes, and its forwards."""
        return {**self.target.info(), "speculative_draft_model_path": self.draft.model_path,
                "draft_kv_cache_bytes": self.draft.pools.token_to_kv_pool.nbytes,
                "draft_forwards": self.draft_forwards}


def _check_pair(target: ModelConfig, draft: ModelConfig, draft_path: str) -> None:
    """Refuse a draft model that cannot draft for the target."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {draft_path} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the served model {target.vocab_size}: a draft model shares "
                         "the served model's tokenizer")
    if draft.context_len < target.context_len:
        raise ValueError(f"the draft model {draft_path} holds {draft.context_len} positions, "
                         f"fewer than the served model's context length {target.context_len}; "
                         f"pass --context-length {draft.context_len} or less")
    if draft.is_embedding:
        raise ValueError(f"the draft model {draft_path} is an embedding model")
