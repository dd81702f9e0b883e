"""Micro-batches of a pipeline-parallel step, so that the stages overlap.

With ``--pp-size`` above 1, a step's requests are split into
``MICRO_BATCHES`` micro-batches that go through the stages one after the
other: while stage ``k + 1`` computes the first, stage ``k`` computes the
second, instead of every stage waiting for the whole batch in turn. A
request's micro-batch is fixed by its request-pool row (``req_pool_idx %
MICRO_BATCHES``), so it stays in the same one from step to step and an
attention backend can keep per-micro-batch state (``ForwardBatch.micro_batch``).

``split_micro_batches`` cuts a ``ForwardBatch`` into its micro-batches
(packed tokens, per-request lengths, prompt-logprob rows and the decode tail
of a mixed step); ``MicroBatch.logits_rows`` says where each one's logits go
in the whole batch's ``[B + m, vocab]`` (``merge_logits``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from framework.forward_batch import ForwardBatch

MICRO_BATCHES = 2


@dataclass
class MicroBatch:
    """Some requests of a step, as a batch of their own."""

    batch: ForwardBatch
    #: Rows of the whole batch's logits that this batch's logits fill, in order: its
    #: requests' last-token rows, then its prompt-logprob rows.
    logits_rows: list[int]


def split_micro_batches(batch: ForwardBatch, count: int = MICRO_BATCHES) -> list[MicroBatch]:
    """The non-empty micro-batches of ``batch``, by request-pool row modulo ``count``."""
    batch.fill_cpu_lengths()
    indices = batch.req_pool_indices_cpu
    assert indices is not None  # filled above
    members: dict[int, list[int]] = {}
    for i, idx in enumerate(indices):
        members.setdefault(idx % count, []).append(i)
    return [_select(batch, requests, part) for part, requests in sorted(members.items())]


def merge_logits(parts: list[tuple[MicroBatch, torch.Tensor]], rows: int) -> torch.Tensor:
    """The whole batch's ``[rows, vocab]`` logits from each micro-batch's."""
    first = parts[0][1]
    out = first.new_empty(rows, first.shape[1])
    for part, logits in parts:
        out[torch.tensor(part.logits_rows, device=logits.device)] = logits
    return out


def _select(batch: ForwardBatch, requests: list[int], part: int) -> MicroBatch:
    """The batch of ``requests`` (indices into ``batch``, ascending) alone."""
    extend = batch.forward_mode.is_extend()
    seq_lens = batch.seq_lens_cpu or []
    new_lens = batch.extend_seq_lens_cpu if extend else [1] * batch.batch_size
    assert new_lens is not None  # filled by fill_cpu_lengths
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    tokens = [t for i in requests for t in range(starts[i], starts[i + 1])]
    device = batch.input_ids.device
    token_index = torch.tensor(tokens, dtype=torch.int64, device=device)
    request_index = torch.tensor(requests, dtype=torch.int64, device=device)
    # Prompt-logprob rows are packed token rows of the whole batch; they follow the B
    # last-token rows in its logits.
    new_place = {t: k for k, t in enumerate(tokens)}
    prompt_rows = [] if batch.prompt_logprob_rows is None else batch.prompt_logprob_rows.tolist()
    mine = [(k, row) for k, row in enumerate(prompt_rows) if row in new_place]
    first_tail = batch.batch_size - batch.decode_tail
    changes = {
        "batch_size": len(requests),
        "input_ids": batch.input_ids[token_index],
        "positions": batch.positions[token_index],
        "req_pool_indices": batch.req_pool_indices[request_index],
        "seq_lens": batch.seq_lens[request_index],
        "out_cache_loc": batch.out_cache_loc[token_index],
        "seq_lens_cpu": [seq_lens[i] for i in requests],
        "req_pool_indices_cpu": [(batch.req_pool_indices_cpu or [])[i] for i in requests],
        "prompt_logprob_rows": torch.tensor([new_place[row] for _, row in mine],
                                            dtype=torch.int64, device=device) if mine else None,
        "decode_tail": sum(i >= first_tail for i in requests) if extend else 0,
        "micro_batch": part,
    }
    if extend:
        assert batch.extend_prefix_lens is not None and batch.extend_seq_lens is not None
        changes |= {
            "extend_prefix_lens": batch.extend_prefix_lens[request_index],
            "extend_seq_lens": batch.extend_seq_lens[request_index],
            "extend_prefix_lens_cpu": [(batch.extend_prefix_lens_cpu or [])[i] for i in requests],
            "extend_seq_lens_cpu": [new_lens[i] for i in requests],
        }
    rows = requests + [batch.batch_size + k for k, _ in mine]
    return MicroBatch(dataclasses.replace(batch, **changes), rows)
