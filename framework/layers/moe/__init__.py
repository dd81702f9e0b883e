"""Mixture-of-Experts layers: the router, the experts held as stacked weights, and the
kernels that run them (``MOE_BACKENDS``)."""

from framework.layers.moe.experts import FusedMoE, expert_range
from framework.layers.moe.router import select_experts

__all__ = ["FusedMoE", "expert_range", "select_experts"]
