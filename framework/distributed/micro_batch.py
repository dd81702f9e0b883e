"""Micro-batches of a pipeline-parallel step, so that the stages overlap.

With ``--pp-size`` above 1, a step's requests are split into
``MICRO_BATCHES`` micro-batches that go through the stages one after the
other: while stage ``k + 1`` computes the first, stage ``k`` computes the
second, instead of every stage waiting for the whole batch in turn.

``MicroBatchPlanner`` (rank 0's) decides which micro-batch each request runs
in: a step of two or more requests always fills every micro-batch, balanced
by new tokens (a prefill counts its prompt's tokens, a decode one). A request
keeps its micro-batch from step to step, because an attention backend may
keep per-micro-batch state across steps (the torch backend's kept decode
keys and values, ``ForwardBatch.micro_batch``); it moves only when the
balance needs it (the others of its micro-batch finished, say), and then
that state is rebuilt for it once. The plan travels with the step
(``ForwardBatch.micro_batch_plan``), so every rank cuts the step alike.

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


def balanced_parts(tokens: list[int], homes: list[int | None],
                   count: int = MICRO_BATCHES) -> list[int]:
    """The micro-batch of each request, given its new ``tokens`` and its ``homes``.

    A request with a home (its micro-batch of the step before, when it keeps
    state there) starts in it; the others go, largest first, to the lightest
    micro-batch. Then, while moving one request from a micro-batch to the
    lightest lowers the heavier's load, the request that best evens the two
    moves. So no micro-batch stays empty while another holds two requests,
    and a request leaves its home only for the balance.
    """
    parts: list[int] = [-1] * len(tokens)
    load, size = [0] * count, [0] * count
    for i, home in enumerate(homes):
        if home is not None:
            parts[i] = home
            load[home] += tokens[i]
            size[home] += 1
    for i in sorted((i for i in range(len(tokens)) if parts[i] < 0), key=lambda i: -tokens[i]):
        parts[i] = min(range(count), key=lambda p: (load[p], size[p]))
        load[parts[i]] += tokens[i]
        size[parts[i]] += 1
    while (move := _best_move(tokens, parts, load)) is not None:
        i, target = move
        load[parts[i]] -= tokens[i]
        load[target] += tokens[i]
        parts[i] = target
    return parts


def _best_move(tokens: list[int], parts: list[int], load: list[int]) -> tuple[int, int] | None:
    """The request whose move to the lightest micro-batch evens the loads most, if any helps.

    Moving ``t`` tokens from a micro-batch of load ``a`` to one of ``b`` lowers the
    larger of the two only when ``t < a - b``; each such move makes the loads strictly
    more even (their sum of squares drops), so moves end.
    """
    light = min(range(len(load)), key=lambda p: load[p])
    best: tuple[int, int] | None = None  # (how uneven the pair is after the move, request)
    for i, part in enumerate(parts):
        gap = load[part] - load[light]
        if part != light and tokens[i] < gap:
            uneven = abs(gap - 2 * tokens[i])
            if best is None or uneven < best[0]:
                best = (uneven, i)
    return None if best is None else (best[1], light)


class MicroBatchPlanner:
    """Plans each step's micro-batches, remembering each request's from step to step.

    Requests are known by their request-pool row. A row's next request starts
    with a prefill, which rebuilds what a backend keeps for it, so a prefill
    takes no home: only decoding requests (a decode step's, a mixed step's
    decode tail) keep theirs.
    """

    def __init__(self, count: int = MICRO_BATCHES) -> None:
        self.count = count
        self._home: dict[int, int] = {}  # request-pool row -> micro-batch of its last step

    def plan(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with its ``micro_batch_plan``: the micro-batch of each request."""
        batch.fill_cpu_lengths()
        rows = batch.req_pool_indices_cpu or []
        if batch.forward_mode.is_extend():
            tokens = list(batch.extend_seq_lens_cpu or [])
            decoding = range(batch.batch_size - batch.decode_tail, batch.batch_size)
        else:
            tokens = [1] * batch.batch_size
            decoding = range(batch.batch_size)
        homes = [self._home.get(row) if i in decoding else None for i, row in enumerate(rows)]
        parts = balanced_parts(tokens, homes, self.count)
        self._home.update(zip(rows, parts, strict=True))
        return dataclasses.replace(batch, micro_batch_plan=parts)


def split_micro_batches(batch: ForwardBatch) -> list[MicroBatch]:
    """The non-empty micro-batches of ``batch``, as its ``micro_batch_plan`` says."""
    batch.fill_cpu_lengths()
    plan = batch.micro_batch_plan
    if plan is None or len(plan) != batch.batch_size:
        raise ValueError("a pipeline step needs a micro_batch_plan with one entry per request")
    members: dict[int, list[int]] = {}
    for i, part in enumerate(plan):
        members.setdefault(part, []).append(i)
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
        "micro_batch_plan": None,
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
