"""One scheduled step: which requests run, how many new tokens each, and its packed tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from framework.forward_batch import ForwardBatch, ForwardMode
from framework.runtime.request import Req


@dataclass
class ScheduledBatch:
    """The requests of one step and what the step does for each."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request (1 each for DECODE)
    #: EXTEND only: the last ``decode_tail`` requests are running ones decoding a token
    #: each, in the same step as the prefills before them (``--enable-mixed-chunk``).
    decode_tail: int = 0
    #: Speculative decoding: per request, the tokens drafted after its last one, which
    #: the step feeds after it for the model to verify (``extend_lens[i]`` is one more).
    drafts: list[list[int]] | None = None

    def subset(self, index: int) -> ScheduledBatch:
        """The same step for request ``index`` alone."""
        return self._keep([index])

    def without_finished(self) -> ScheduledBatch:
        """The same step without the requests that have ended since it was built."""
        keep = [i for i, req in enumerate(self.reqs) if not req.finished]
        if len(keep) == len(self.reqs):
            return self
        return self._keep(keep)

    def _keep(self, keep: list[int]) -> ScheduledBatch:
        return ScheduledBatch(self.mode, [self.reqs[i] for i in keep],
                              [self.extend_lens[i] for i in keep],
                              decode_tail=sum(self.decodes(i) for i in keep),
                              drafts=None if self.drafts is None
                              else [self.drafts[i] for i in keep])

    def decodes(self, index: int) -> bool:
        """Whether request ``index`` decodes in this step (rather than prefilling)."""
        return not self.mode.is_extend() or index >= len(self.reqs) - self.decode_tail

    def mixed_with(self, running: list[Req]) -> ScheduledBatch:
        """This prefill batch with one decode token for each of ``running`` after it."""
        return ScheduledBatch(ForwardMode.EXTEND, self.reqs + running,
                              self.extend_lens + [1] * len(running), decode_tail=len(running))

    @classmethod
    def decode(cls, running: list[Req]) -> ScheduledBatch:
        """A decode step of ``running``: one new token each."""
        return cls(ForwardMode.DECODE, list(running), [1] * len(running))

    @classmethod
    def verify(cls, running: list[Req], drafts: list[list[int]]) -> ScheduledBatch:
        """A decode step of ``running`` that also feeds each request's drafted tokens: an
        EXTEND over the KV so far, every request decoding."""
        return cls(ForwardMode.EXTEND, list(running), [1 + len(d) for d in drafts],
                   decode_tail=len(running), drafts=[list(d) for d in drafts])

    def drafted(self, index: int) -> list[int]:
        """The tokens drafted for request ``index`` (none outside speculative steps)."""
        return [] if self.drafts is None else self.drafts[index]

    @property
    def num_tokens(self) -> int:
        """New tokens of the whole step."""
        return sum(self.extend_lens)

    def prompt_logprob_spans(self) -> list[range]:
        """Per request, the prompt positions whose logprobs this step computes.

        The logprob of position ``p`` comes from the logits at ``p - 1``, so a step
        that computes positions ``[kv_len, kv_len + n)`` gives positions up to
        ``kv_len + n``. ``Req.prefix_limit`` keeps the first one missing in reach.
        """
        if not self.mode.is_extend():
            return [range(0)] * len(self.reqs)
        spans = []
        for req, n in zip(self.reqs, self.extend_lens):
            todo = req.prompt_logprobs_todo()
            if todo and todo.start <= req.kv_len:
                raise RuntimeError(f"the logprob of prompt position {todo.start} needs the "
                                   f"logits at {todo.start - 1}, which are not recomputed")
            spans.append(range(todo.start, min(todo.stop, req.kv_len + n + 1)))
        return spans

    def prompt_logprob_rows(self) -> list[int]:
        """Packed rows whose logits give the positions of ``prompt_logprob_spans``."""
        rows: list[int] = []
        offset = 0
        for req, n, span in zip(self.reqs, self.extend_lens, self.prompt_logprob_spans()):
            rows.extend(offset + p - 1 - req.kv_len for p in span)
            offset += n
        return rows

    def draft_rows(self) -> list[int]:
        """Packed rows whose logits verify drafted tokens: each request's rows but its last
        (whose logits are the step's next-token ones), in request order."""
        rows: list[int] = []
        offset = 0
        for i, n in enumerate(self.extend_lens):
            rows.extend(range(offset, offset + len(self.drafted(i))))
            offset += n
        return rows

    def to_forward_batch(
        self, req_to_token: torch.Tensor, out_cache_loc: torch.Tensor, device: torch.device
    ) -> ForwardBatch:
        """Pack the new tokens (no padding) and point each request's row at its new slots.

        ``out_cache_loc`` holds one freshly allocated KV slot per new token, request
        after request; they are written into ``req_to_token[req, kv_len:kv_len + n]``.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []  # each new token's row of req_to_token
        prefix_lens: list[int] = []
        seq_lens: list[int] = []
        extend = self.mode.is_extend()
        for i, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            start = req.kv_len
            if self.decodes(i):
                input_ids.append(req.last_token())
                input_ids.extend(self.drafted(i))
            else:
                input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            token_rows.extend([req.req_pool_idx] * n)
            prefix_lens.append(start)
            seq_lens.append(start + n)

        rows = [r.req_pool_idx for r in self.reqs]
        logprob_rows = self.prompt_logprob_rows() + self.draft_rows() if extend else []
        # The batch's index tensors as views of one, made by one call: a tensor made from a
        # list costs a few microseconds however short, and a step has up to eight.
        lists = [input_ids, positions, token_rows, rows, seq_lens]
        if extend:
            lists += [prefix_lens, self.extend_lens, logprob_rows]
        packed = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64,
                              device=device).split([len(values) for values in lists])
        input_ids_tensor, positions_tensor, token_rows_tensor, rows_tensor, seq_lens_tensor = \
            packed[:5]
        # One scatter for the whole batch (an indexed assignment per request costs more
        # than the rest of this function): each new slot at its request's row and position.
        req_to_token[token_rows_tensor.to(req_to_token.device),
                     positions_tensor.to(req_to_token.device)] = out_cache_loc.to(
                         req_to_token.device)

        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=len(self.reqs),
            input_ids=input_ids_tensor,
            positions=positions_tensor,
            req_pool_indices=rows_tensor,
            seq_lens=seq_lens_tensor,
            out_cache_loc=out_cache_loc.to(device),
            extend_prefix_lens=packed[5] if extend else None,
            extend_seq_lens=packed[6] if extend else None,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens if extend else None,
            extend_seq_lens_cpu=list(self.extend_lens) if extend else None,
            req_pool_indices_cpu=rows,
            prompt_logprob_rows=packed[7] if logprob_rows else None,
            decode_tail=self.decode_tail if extend else 0,
            lora_names=[r.lora_name for r in self.reqs]
            if any(r.lora_name is not None for r in self.reqs) else None,
        )
