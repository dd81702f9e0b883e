"""Qwen's Mixture-of-Experts decoders: Qwen2-MoE and Qwen3-MoE.

Qwen2-MoE has Qwen2's attention (q/k/v bias) and a shared expert in every sparse
block; Qwen3-MoE has Qwen3's attention (per-head q/k RMSNorm) and no shared
expert. Both renormalize the chosen experts' weights when ``norm_topk_prob``;
the layers, the block and the loading are ``framework.models.moe``'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from framework.models.llama import AttentionOptions
from framework.models.moe import MoeForCausalLM, MoeSpec


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: Qwen2's attention (q/k/v bias), a gated shared expert in every sparse block."""

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """Bias on q/k/v (``qkv_bias``, on by default), none on the output projection."""
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False,
                                qk_norm=False)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """Qwen's settings plus the shared expert of ``shared_expert_intermediate_size``."""
        return replace(super().moe_spec(config),
                       shared_intermediate_size=config.shared_expert_intermediate_size)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), no shared expert."""

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """Per-head q/k norm; bias on all four projections when ``attention_bias``."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
