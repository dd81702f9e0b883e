"""The router of a Mixture-of-Experts layer: each token's top-k experts and their weights."""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts: float32 weights ``[n, top_k]`` and int64 ids.

    The weights are the softmax of the router's logits (in float32) at the chosen
    experts; ``renormalize`` (Mixtral always, Qwen's ``norm_topk_prob``) scales each
    token's weights to sum to one.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
