"""The reference MoE kernel in torch: tokens sorted by expert, one grouped matmul each.

The loop runs over the experts that received tokens, never over tokens: each
expert multiplies the block of rows routed to it at once.
"""

from __future__ import annotations

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
    choices, experts, tokens = sort_by_expert(ids, first_expert, w13.shape[0])
    rows = x.index_select(0, tokens)
    out_rows = torch.empty_like(rows)
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        block = rows[start:start + count]
        hidden = act(block @ w13[expert].t())
        out_rows[start:start + count] = hidden @ w2[expert].t()
        start += count
    scale = weights.reshape(-1).index_select(0, choices).unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, (out_rows.float() * scale).to(x.dtype))
    return out


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
