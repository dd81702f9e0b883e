"""Mixtral: Mistral's attention with a sparse MoE block in every layer.

Every layer routes each token to its top ``num_experts_per_tok`` of
``num_local_experts`` experts, whose weights are always renormalized to sum to
one; each expert is a gated MLP of ``intermediate_size``; there is no shared
expert. Attention is Mistral's: no bias, every layer within ``sliding_window``
when set.

The hub's checkpoints name the block ``block_sparse_moe`` and the experts'
projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down); transformers 5 names
the block ``mlp`` and may hold its experts stacked. All of these load. The
model-class contract, parallelism and loading are those of
``framework.models.moe.MoeForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from framework.models.llama import AttentionOptions
from framework.models.moe import MoeForCausalLM, MoeSpec


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral with its language-model head."""

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """No bias, no q/k norm (Mistral's attention)."""
        return AttentionOptions(qkv_bias=False, o_bias=False, qk_norm=False)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """``num_local_experts`` experts of ``intermediate_size``, always renormalized."""
        return MoeSpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, renormalize=True)

    @classmethod
    def is_sparse_layer(cls, config: Any, layer_id: int) -> bool:
        """Every Mixtral layer is sparse."""
        return True

    def _parameter_name(self, checkpoint_name: str) -> str | None:
        """The hub's ``block_sparse_moe`` is the model's ``mlp``; otherwise as Llama's."""
        name = super()._parameter_name(checkpoint_name)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")
