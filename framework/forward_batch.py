"""What one model step consumes: ``ForwardMode`` and ``ForwardBatch``.

The scheduler builds a ``ForwardBatch`` for every step. Tokens of all requests
are packed one after another (no padding): ``input_ids`` and ``positions``
hold the new tokens only, and each request reaches its cached prefix through
its row of ``ReqToTokenPool.req_to_token``. Before the step the scheduler
allocates a KV slot for every new token, writes the slots into
``req_to_token[req_pool_idx, prefix_len:seq_len]`` and passes them again as
``out_cache_loc``; the attention backend writes the new keys and values there.

The batch carries indices only: the pools and the attention backend are built
once by the ``ModelRunner`` and reached from there, so that this module, which
everything may use, imports nothing from the layers or the KV cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    """The kind of step a batch runs."""

    # Prefill of new tokens on top of an optional cached prefix; requests in one
    # batch may have different prefix and new-token lengths (packed, no padding).
    EXTEND = enum.auto()
    # Exactly one new token per request.
    DECODE = enum.auto()

    def is_extend(self) -> bool:
        """True for a prefill step."""
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        """True for a one-token-per-request step."""
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """The inputs of one model step (see the module docstring for the layout)."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64: new tokens of all requests, concatenated
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each new token
    req_pool_indices: torch.Tensor  # [B] int64: each request's row in req_to_token
    seq_lens: torch.Tensor  # [B] int64: tokens in the KV cache after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    extend_prefix_lens: torch.Tensor | None = None  # [B] int64, EXTEND only
    extend_seq_lens: torch.Tensor | None = None  # [B] int64, EXTEND only
    # Host copies, so that the torch backend and the scheduler avoid device syncs.
    seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    req_pool_indices_cpu: list[int] | None = None
    # [m] int64, EXTEND only: packed rows whose logits are wanted as well, for the
    # logprobs of prompt tokens, then for verifying drafted tokens (speculative decoding);
    # the model returns them after the B last-token rows.
    prompt_logprob_rows: torch.Tensor | None = None
    # EXTEND only: the last ``decode_tail`` requests are running requests decoding one
    # token each, in the same step as the prefills before them (a mixed step).
    decode_tail: int = 0
    # With pipeline parallelism, which micro-batch of its step this is
    # (``framework.distributed.micro_batch``): a request stays in the same one from
    # step to step unless the balance moves it.
    micro_batch: int = 0
    # With pipeline parallelism, the micro-batch of each request of a whole step, as rank
    # 0 planned it (``MicroBatchPlanner``): every rank cuts the step alike.
    micro_batch_plan: list[int] | None = None
    # Each request's LoRA adapter (None: the base model); None when no request has one.
    lora_names: list[str | None] | None = None
    # The directory of each adapter named there, set by rank 0 before it announces the
    # step: the other ranks load an adapter loaded at run time from it.
    lora_dirs: dict[str, str] | None = None
    # The adapters of requests holding KV outside this batch (they step again soon):
    # none of them is evicted to load one this batch needs.
    lora_in_use: list[str] | None = None

    @property
    def num_tokens(self) -> int:
        """Number of new tokens in the batch."""
        return int(self.input_ids.shape[0])

    def last_token_rows(self) -> torch.Tensor | None:
        """Row of each request's last new token in the packed batch (``None``: every row)."""
        if self.forward_mode.is_decode():
            return None
        if self.extend_seq_lens is None:
            raise ValueError("an EXTEND batch needs extend_seq_lens")
        return torch.cumsum(self.extend_seq_lens, dim=0) - 1

    def logits_rows(self) -> torch.Tensor | None:
        """Rows a causal LM turns into logits: the last-token rows, then ``prompt_logprob_rows``."""
        rows = self.last_token_rows()
        if rows is None or self.prompt_logprob_rows is None:
            return rows
        return torch.cat([rows, self.prompt_logprob_rows])

    def fill_cpu_lengths(self) -> None:
        """Fill the host copies of the lengths that are still ``None`` (one sync each)."""
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.tolist()
        if self.req_pool_indices_cpu is None:
            self.req_pool_indices_cpu = self.req_pool_indices.tolist()
        if self.forward_mode.is_extend():
            if self.extend_seq_lens is None or self.extend_prefix_lens is None:
                raise ValueError("an EXTEND batch needs extend_seq_lens and extend_prefix_lens")
            if self.extend_seq_lens_cpu is None:
                self.extend_seq_lens_cpu = self.extend_seq_lens.tolist()
            if self.extend_prefix_lens_cpu is None:
                self.extend_prefix_lens_cpu = self.extend_prefix_lens.tolist()
