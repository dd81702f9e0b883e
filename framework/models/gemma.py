"""Gemma 2 and Gemma 3 (text) decoders.

Both are Llama-shaped decoders (grouped-query attention, RoPE, a gated MLP)
with Gemma's particulars, computed as Hugging Face transformers does:

* the token embedding is scaled by ``sqrt(hidden_size)``, the factor rounded to
  the activation dtype;
* every RMSNorm scales by ``1 + w``, in float32, before casting back;
* the MLP is GeGLU (``hidden_activation``, tanh-approximated GELU);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* "sandwich" norms: each block's attention and MLP outputs are normalized
  again before they join the residual stream;
* layers alternate between sliding-window and full attention (``layer_types``);
* the final logits are soft-capped, ``c * tanh(logits / c)``, when
  ``final_logit_softcapping`` is set;
* the embedding table is the output head (tied embeddings).

Gemma 2 soft-caps the attention scores too (``attn_logit_softcapping``).
Gemma 3 instead normalizes each query and key head (RMSNorm, ``1 + w``) before
RoPE, and rotates sliding-window layers with a local RoPE base and full ones
with a global base (``rope_parameters`` per layer type).

The model-class contract, the weight loading, tensor and pipeline parallelism
are those of ``framework.models.llama``, whose classes these extend.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.layers.embedding import VocabParallelEmbedding
from framework.layers.norm import RMSNorm
from framework.layers.rotary import RopeConfig, RotaryEmbedding
from framework.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    attend,
    head_dim_of,
    sliding_window_of,
)

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch

#: The layer type of a config without ``layer_types``: every layer attends to all its keys.
FULL_ATTENTION = "full_attention"


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32, then cast to the input dtype.

    The checkpoint stores ``weight`` centred on 0. Unlike ``RMSNorm`` (Llama),
    the weight is applied before the cast back, so half-precision outputs
    round once, as in transformers. With ``cpu_ops`` bound, float32 rows run
    through the native kernel with ``1 + weight`` as its weight: in float32
    the two orders of the cast are the same.
    """

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x``; with ``residual``, normalize ``x + residual`` and return the sum too."""
        # 1 + w in float32: in bfloat16 the sum would round away most of w.
        scale = self.weight.float() + 1.0
        if self.cpu_ops is not None and x.dtype == torch.float32 and _rows(x):
            if residual is None:
                return self.cpu_ops.rms_norm(x, scale, self.eps)
            if _rows(residual):
                normed, summed = self.cpu_ops.add_rms_norm(x, residual, scale, self.eps)
                return normed, summed
        if residual is None:
            return self._scaled(x, scale)
        summed = x + residual
        return self._scaled(summed, scale), summed

    def _scaled(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)


def _rows(x: torch.Tensor) -> bool:
    """Whether the native kernels take ``x`` as it is: contiguous ``[rows, features]``."""
    return x.dim() == 2 and x.is_contiguous()


class GemmaEmbedding(VocabParallelEmbedding):
    """The token embedding, scaled by ``sqrt(embedding_dim)`` on lookup.

    The factor is rounded to the table's dtype first (transformers casts it to
    the weight dtype: in bfloat16, ``sqrt(3072)`` is 55.5). Used as the output
    head (``compute_logits``), the table is not scaled.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank=tp_rank, tp_size=tp_size)
        # float32 as transformers' buffer, whatever the default dtype; on the host, since the
        # model may be built on the meta device, which holds no values.
        normalizer = torch.tensor(math.sqrt(embedding_dim), dtype=torch.float32, device="cpu")
        self.normalizer = float(normalizer.to(self.weight.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids and scale them."""
        return super().forward(input_ids) * self.normalizer


def rope_config_of(config: Any, layer_type: str) -> RopeConfig:
    """The RoPE settings of the layers of ``layer_type``.

    Gemma 3 lists them per layer type (``rope_parameters[layer_type]``: the
    local base for sliding-window layers, the global base and its scaling for
    full ones); Gemma 2 has one set for all layers.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        # The per-type settings, seen as a config of their own.
        config = SimpleNamespace(rope_parameters=params[layer_type],
                                 max_position_embeddings=config.max_position_embeddings)
    return RopeConfig.from_hf_config(config)


def _layer_type(config: Any, layer_id: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_id] if layer_types is not None else FULL_ATTENTION


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's score scaling, soft-capping and (Gemma 3) q/k norms."""

    def __init__(
        self, config: Any, layer_id: int, stage_layer_id: int, *, tp_rank: int, tp_size: int,
        rotary_emb: RotaryEmbedding, qk_norm: bool, logit_cap: float | None,
    ) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        window = sliding_window_of(config, layer_id)
        # The q/k norms are Gemma's own (below), not Llama's.
        options = AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)
        super().__init__(config, stage_layer_id, options, tp_rank=tp_rank, tp_size=tp_size,
                         rotary_emb=rotary_emb, sliding_window=window,
                         scaling=config.query_pre_attn_scalar**-0.5, logit_cap=logit_cap)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block.

    ``h = x + post_attn_norm(attn(input_norm(x)))``, then
    ``h + post_ff_norm(mlp(pre_ff_norm(h)))``.
    """

    def __init__(self, attention: GemmaAttention, config: Any, *, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = LlamaMLP(config, tp_rank=tp_rank, tp_size=tp_size,
                            activation=config.hidden_activation)  # GeGLU
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's MLP output (normalized) and the residual stream, kept apart.

        As in ``LlamaDecoderLayer``: the next norm adds the two, and with
        ``output_rows`` only those rows go on past the attention's keys and values.
        """
        attn_out, residual = attend(self, positions, hidden_states, forward_batch, residual,
                                    output_rows)
        normed, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(attn_out), residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class GemmaModel(LlamaModel):
    """Scaled embedding, Gemma decoder layers and the final norm (of one pipeline stage).

    Built here rather than by ``LlamaModel.__init__`` (which makes Llama layers);
    the stage layout, ``holds`` and ``forward`` are Llama's.
    """

    def __init__(
        self, config: Any, *, qk_norm: bool, logit_cap: float | None, tp_rank: int,
        tp_size: int, pp_rank: int = 0, pp_size: int = 1,
    ) -> None:
        nn.Module.__init__(self)
        self.set_stage(config, pp_rank, pp_size)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage:
            self.embed_tokens = GemmaEmbedding(
                config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        # One rotary embedding per layer type, shared by its layers (angles once per step).
        layer_types = {_layer_type(config, i) for i in range(config.num_hidden_layers)}
        ropes = {kind: RotaryEmbedding(head_dim_of(config), rope_config_of(config, kind))
                 for kind in layer_types}

        def layer(layer_id: int) -> nn.Module:
            if not self.start_layer <= layer_id < self.end_layer:
                return nn.Identity()  # another stage's: keeps the checkpoint's layer numbers
            attention = GemmaAttention(
                config, layer_id, layer_id - self.start_layer, tp_rank=tp_rank, tp_size=tp_size,
                rotary_emb=ropes[_layer_type(config, layer_id)], qk_norm=qk_norm,
                logit_cap=logit_cap)
            return GemmaDecoderLayer(attention, config, tp_rank=tp_rank, tp_size=tp_size)

        self.layers = nn.ModuleList(layer(i) for i in range(config.num_hidden_layers))
        self.norm: RMSNorm | None = None
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: attention soft-capping, no q/k norms."""

    #: Whether each query and key head is RMS-normalized before RoPE.
    qk_norm = False

    @classmethod
    def attention_logit_cap(cls, config: Any) -> float | None:
        """Gemma 2 soft-caps attention scores at ``attn_logit_softcapping``."""
        return getattr(config, "attn_logit_softcapping", None)

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device, *,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__(config, dtype, device, tp_rank=tp_rank, tp_size=tp_size,
                         pp_rank=pp_rank, pp_size=pp_size)
        self.final_logit_cap: float | None = getattr(config, "final_logit_softcapping", None)

    def build_model(self, config: Any, *, tp_rank: int, tp_size: int, pp_rank: int,
                    pp_size: int) -> GemmaModel:
        """Gemma's decoder stack: scaled embedding, sandwich-normed layers, (1 + w) norms."""
        return GemmaModel(config, qk_norm=self.qk_norm, logit_cap=self.attention_logit_cap(config),
                          tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        get_embedding: bool = False,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaForCausalLM.forward``; the float32 logits are soft-capped when set."""
        out = super().forward(input_ids, positions, forward_batch, get_embedding, intermediate)
        if isinstance(out, tuple) or get_embedding or self.final_logit_cap is None:
            return out
        cap = self.final_logit_cap
        return torch.tanh(out / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): q/k norms, two RoPE bases, no attention soft-capping."""

    qk_norm = True

    @classmethod
    def attention_logit_cap(cls, config: Any) -> float | None:
        """Gemma 3 does not soft-cap attention scores (transformers ignores the setting)."""
        return None

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device, *,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported "
                             "(only causal attention is served)")
        super().__init__(config, dtype, device, tp_rank=tp_rank, tp_size=tp_size,
                         pp_rank=pp_rank, pp_size=pp_size)
