"""A Mixture-of-Experts layer's experts, held as two stacked weights.

``w13 [E, 2I, H]`` holds each expert's gate and up projections (gate rows first),
``w2 [E, H, I]`` its down projection. Under tensor parallelism (``tp_size``) each
rank holds every expert's slice of the intermediate size, and the outputs are
partial sums over ranks (``output_is_partial``: the caller sums them over the
group); under expert parallelism (``ep_size``, equal to ``tp_size``) each rank holds
whole experts, its share of them (``expert_range``), and the layer exchanges the
tokens with the other ranks of its group (``expert_parallel``), its output complete
on every rank. Each expert's checkpoint tensors (``experts.{e}.gate_proj``,
Mixtral's ``w1``/``w3``/``w2``; the models cut transformers' stacked tensors into
them) load into them; a rank reads only its slices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.layers.activation import GatedActivation
from framework.layers.linear import (
    CheckpointWeight,
    TensorParallelGroup,
    bound_tp_group,
    divide,
)
from framework.layers.linear_kernel import pack_weight
from framework.layers.moe.expert_parallel import LocalExperts, expert_parallel_moe
from framework.registry import MOE_BACKENDS

#: Shard ids of the per-expert tensors: which part of the stacked weights each fills.
GATE, UP, DOWN = "gate", "up", "down"


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """The experts ``[start, end)`` that rank ``ep_rank`` of ``ep_size`` holds."""
    per_rank = divide(num_experts, ep_size, "experts")
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def pack_expert_weights(modules: list[FusedMoE]) -> None:
    """Pack (again) every expert's weights of ``modules`` for oneDNN (after every load, as
    ``pack_linear_weights`` does for the linear layers)."""
    for module in modules:
        module.packed = ([pack_weight(w) for w in module.w13], [pack_weight(w) for w in module.w2])


class FusedMoE(nn.Module):
    """The experts of one MoE layer; ``forward(x, weights, ids)`` applies them.

    With ``ep_size`` above 1 the layer needs its tensor-parallel group (``bind_tp_group``),
    whose ranks are the expert-parallel ones: rank ``ep_rank`` of it holds
    ``expert_range(num_experts, ep_rank, ep_size)``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", tp_rank: int = 0, tp_size: int = 1,
                 ep_rank: int = 0, ep_size: int = 1, backend: str = "cpu") -> None:
        super().__init__()
        if ep_size > 1 and tp_size > 1 and (ep_size != tp_size or ep_rank != tp_rank):
            # The experts' ranks are those of the tensor-parallel group, in its order.
            raise ValueError(f"expert parallelism needs ep_size ({ep_size}) and ep_rank "
                             f"({ep_rank}) equal to tp_size ({tp_size}) and tp_rank "
                             f"({tp_rank})")
        self.num_experts = num_experts
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.first_expert, end = expert_range(num_experts, ep_rank, ep_size)
        # Expert parallelism replaces the tensor split: each rank holds whole experts.
        self.split = 1 if ep_size > 1 else tp_size
        self.split_rank = 0 if ep_size > 1 else tp_rank
        self.intermediate = divide(intermediate_size, self.split, "moe intermediate size")
        local = end - self.first_expert
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, self.intermediate),
                               requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.act = GatedActivation(activation)
        #: The MoE kernel (a ``MOE_BACKENDS`` entry; ``--moe-backend`` rebinds it): the
        #: ``cpu`` one hands blocks off a CPU to the torch reference.
        self.moe_kernel = MOE_BACKENDS.get(backend)
        #: Each expert's ``w13`` and ``w2`` in the linear backend's packed layout (oneDNN's,
        #: ``pack_expert_weights``), or None: the kernels multiply the weights as they are.
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.tp_group: TensorParallelGroup | None = None

    @property
    def output_is_partial(self) -> bool:
        """Whether ``forward``'s output is this rank's part of a sum over the tensor-parallel
        group (the caller all-reduces it): under tensor parallelism, not expert parallelism."""
        return self.split > 1

    def holds(self, expert: int) -> bool:
        """Whether this rank holds expert ``expert``."""
        return self.first_expert <= expert < self.first_expert + self.w13.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[n, H]``: the tokens' weighted expert outputs (``weights``, ``ids``: ``[n, k]``).

        Under tensor parallelism, over this rank's slice of every expert (a partial sum,
        ``output_is_partial``); under expert parallelism, complete: the tokens go to the
        ranks holding their experts and come back (``x`` must be the same on every rank).
        """
        if self.ep_size == 1:
            return self.moe_kernel(x, self.w13, self.w2, weights, ids, self.act,
                                   self.first_expert, packed=self.packed)
        experts = LocalExperts(self.w13, self.w2, self.act, self.moe_kernel, self.first_expert,
                               self.packed)
        return expert_parallel_moe(x, weights, ids, experts, bound_tp_group(self),
                                   self.ep_rank, self.ep_size)

    # ------------------------------------------------------------------ loading

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointWeight,
                      shard_id: tuple[int, str]) -> None:
        """Copy this rank's part of one expert's projection: ``shard_id`` is
        ``(expert, GATE | UP | DOWN)``, ``loaded`` its ``[I, H]`` or ``[H, I]`` matrix.
        An expert another rank holds is skipped unread."""
        expert, part = shard_id
        if self.holds(expert):
            self._load_one(param, loaded, expert, part)

    def _load_one(self, param: nn.Parameter, loaded: Any, expert: int, part: str) -> None:
        """One expert's gate, up or down projection, this rank's slice of it."""
        local = expert - self.first_expert
        size, hidden = self.intermediate, self.w13.shape[2]
        if part == DOWN:
            expected = (hidden, size * self.split)
            _check(loaded, expected, f"expert {expert} down projection")
            param.data[local].copy_(loaded.narrow(1, self.split_rank * size, size))
            return
        expected = (size * self.split, hidden)
        _check(loaded, expected, f"expert {expert} {part} projection")
        offset = 0 if part == GATE else size
        param.data[local, offset:offset + size].copy_(
            loaded.narrow(0, self.split_rank * size, size))


def _check(loaded: Any, expected: tuple[int, int], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {expected}")
