"""Expert parallelism: the ranks of the tensor-parallel group split a layer's experts.

Each rank holds ``E / P`` whole experts. The activations entering the layer are
replicated over the group, so the work is split by tokens too: rank ``r`` takes
its contiguous share of the tokens (``token_share``) and

1. sends each of its (token, choice) rows to the rank holding the chosen expert
   (an all-to-all, after one that exchanges how many rows go where);
2. runs its own experts on the rows it received (``FusedMoE.local_experts``);
3. gets its rows' outputs back by the reverse all-to-all, and sums each token's
   weighted outputs;
4. all-gathers the shares, so that every rank ends with every token's output.

The layer's output is then complete on every rank: no all-reduce follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from framework.layers.linear import TensorParallelGroup


def token_share(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """The tokens ``[start, end)`` rank ``rank`` of ``size`` exchanges: an even split, the
    first ranks taking one more when it does not divide (none when there are too few)."""
    base, extra = divmod(num_tokens, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class LocalExperts:
    """This rank's experts: how many, and ``apply(x, weights, ids)``, their weighted
    outputs ``[n, H]`` for the choices ``ids`` (``[n, k]``) they hold."""

    local: int
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def count(self) -> int:
        """Experts this rank holds (every rank holds as many)."""
        return self.local

    def run(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each row through the one expert it names, unweighted: ``[R, H]``."""
        ones = torch.ones(len(rows), 1, dtype=torch.float32, device=rows.device)
        return self.apply(rows, ones, expert_ids.unsqueeze(1))


def expert_parallel_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        experts: LocalExperts, group: TensorParallelGroup, rank: int,
                        size: int) -> torch.Tensor:
    """``[n, H]``: every token's weighted expert outputs, on every rank of ``group``.

    ``x``, ``weights`` and ``ids`` (``[n, H]``, ``[n, k]``, ``[n, k]``) must be the same on
    every rank; ``rank`` is this rank's index in ``group`` of ``size``.
    """
    num_tokens = len(x)
    if num_tokens == 0:  # every rank sees it, so every rank skips the collectives alike
        return torch.zeros_like(x)
    start, end = token_share(num_tokens, rank, size)
    mine = _exchange(x[start:end], weights[start:end], ids[start:end], experts, group, size)
    return _gather_shares(mine, num_tokens, group, size)


def _exchange(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts: LocalExperts, group: TensorParallelGroup, size: int) -> torch.Tensor:
    """This rank's tokens' outputs ``[m, H]``, their rows run by the ranks holding the
    chosen experts."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    owners = torch.div(flat_ids, experts.count, rounding_mode="floor")
    order = torch.argsort(owners, stable=True)  # the rows in the order of their owners
    send_counts = torch.bincount(owners, minlength=size)
    recv_counts = group.all_to_all_single(send_counts, [1] * size, [1] * size)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    tokens = torch.div(order, top_k, rounding_mode="floor")
    rows = group.all_to_all_single(x.index_select(0, tokens), sends, recvs)
    row_experts = group.all_to_all_single(flat_ids.index_select(0, order), sends, recvs)
    outputs = group.all_to_all_single(experts.run(rows, row_experts), recvs, sends)
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, (outputs.float() * scale).to(x.dtype))
    return out


def _gather_shares(mine: torch.Tensor, num_tokens: int, group: TensorParallelGroup,
                   size: int) -> torch.Tensor:
    """Every rank's share, in token order; the shares differ by at most one row, so each is
    padded to the first (largest) one's size for the all-gather."""
    largest = token_share(num_tokens, 0, size)[1]
    padded = torch.zeros(largest, *mine.shape[1:], dtype=mine.dtype, device=mine.device)
    padded[:len(mine)] = mine
    gathered = group.all_gather(padded, dim=0)
    return torch.cat([gathered[r * largest:r * largest + _share_len(num_tokens, r, size)]
                      for r in range(size)])


def _share_len(num_tokens: int, rank: int, size: int) -> int:
    start, end = token_share(num_tokens, rank, size)
    return end - start
