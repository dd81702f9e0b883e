"""The reference MoE kernel in torch: tokens sorted by expert, one grouped matmul each.

The loop runs over the experts that received tokens, never over tokens: each
expert multiplies the block of rows routed to it at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from framework.layers.activation import GatedActivation


def torch_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, act: GatedActivation,
                        first_expert: int = 0, packed: object = None) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for each token ``t``.

    ``w13 [E, 2I, H]`` holds each expert's gate and up rows, ``w2 [E, H, I]`` its down
    projection, for experts ``first_expert .. first_expert + E - 1``; a choice of an
    expert outside them adds nothing (another rank holds it). Returns ``[n, H]`` in
    ``x``'s dtype. ``packed`` (the experts' weights in a backend's layout, which a kernel
    may use) is not read here: the reference multiplies the weights as they are.
    """
    def mlp(expert: int, block: torch.Tensor) -> torch.Tensor:
        return act(block @ w13[expert].t()) @ w2[expert].t()

    return run_experts(x, weights, ids, first_expert, w13.shape[0], mlp)


#: One expert's MLP on its block of rows: ``mlp(local_expert, rows [m, H]) -> [m, H]``.
ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                first_expert: int, num_local: int, mlp: ExpertMLP) -> torch.Tensor:
    """``sum_k weights[t, k] * mlp(ids[t, k], x[t])`` over the choices of the ``num_local``
    experts held from ``first_expert`` on, ``[n, H]`` in ``x``'s dtype.

    The (token, choice) rows are sorted by expert and each expert's block goes through
    ``mlp`` at once; each token's weighted outputs are summed in float32.
    """
    choices, experts, tokens = sort_by_expert(ids, first_expert, num_local)
    rows = x.index_select(0, tokens)
    out_rows = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    counts = torch.bincount(experts, minlength=num_local).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out_rows[start:start + count] = mlp(expert, rows[start:start + count])
            start += count
    scale = weights.reshape(-1).index_select(0, choices).unsqueeze(1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, out_rows.mul_(scale))
    return out.to(x.dtype)


def sort_by_expert(ids: torch.Tensor, first_expert: int,
                   num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs that name one of the ``num_local`` experts held from
    ``first_expert`` on, sorted by expert (stable: by token within one).

    Returns their flat indices into ``ids`` ``[n, top_k]``, their local expert and their
    token, each ``[R]``.
    """
    local = ids.reshape(-1) - first_expert
    held = (local >= 0) & (local < num_local)
    choices = torch.nonzero(held).squeeze(1)
    experts = local[choices]
    order = torch.argsort(experts, stable=True)
    choices, experts = choices[order], experts[order]
    return choices, experts, choices // ids.shape[1]
