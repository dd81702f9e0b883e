"""Llama-family decoders: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

All four share one pre-norm transformer with grouped-query attention, RoPE
and a SwiGLU MLP; the differences are a few switches (``AttentionOptions``).
The model runs on packed batches over the paged KV cache: ``forward`` takes
the new tokens of every request and returns one row per request, the
next-token logits or, when served as an embedding model, the last token's
L2-normalized hidden state.

Model-class contract (shared with the other models): ``cls(config, dtype,
device, *, tp_rank=0, tp_size=1)``, ``forward(input_ids, positions,
forward_batch, get_embedding=False)`` and ``load_weights(weights)``.

Pipeline parallelism (``pp_rank``, ``pp_size``): a stage builds and loads only
its layers (the embedding on the first stage, the final norm and the head on
the last); a stage but the last returns its ``(hidden, residual)`` for the
next one, which passes them in as ``intermediate``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from framework.distributed.config import stage_layers
from framework.layers.activation import GatedActivation
from framework.layers.attention.radix_attention import RadixAttention
from framework.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from framework.layers.linear import (
    CheckpointWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_dtype,
    default_weight_loader,
)
from framework.layers.norm import RMSNorm
from framework.layers.rotary import RopeConfig, RotaryEmbedding

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch

# Checkpoint projections that load into one stacked parameter:
# (name in the checkpoint, name of the stacked parameter, shard id).
_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
_SHARDS_OF_STACKED: dict[str, tuple[str | int, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "gate_up_proj": (0, 1),
}


@dataclass(frozen=True)
class AttentionOptions:
    """The per-family switches of the attention block."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def head_dim_of(config: Any) -> int:
    """The attention head size: ``config.head_dim`` when set, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_embedding_of(config: Any) -> RotaryEmbedding:
    """The model's rotary embedding, from its head size and RoPE settings."""
    return RotaryEmbedding(head_dim_of(config), RopeConfig.from_hf_config(config))


def sliding_window_of(config: Any, layer_id: int) -> int | None:
    """The sliding window of layer ``layer_id`` (``None``: full attention).

    A config that lists ``layer_types`` gives the window to its
    ``"sliding_attention"`` layers only (Gemma, Qwen); one without gives it to
    every layer (Mistral).
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or layer_types is None:
        return window
    return window if layer_types[layer_id] == "sliding_attention" else None


def num_kv_heads_of(config: Any) -> int:
    """Key/value heads (``num_key_value_heads``, falling back to the attention heads)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE over the paged KV cache."""

    def __init__(
        self,
        config: Any,
        layer_id: int,
        options: AttentionOptions,
        *,
        tp_rank: int,
        tp_size: int,
        rotary_emb: RotaryEmbedding | None = None,
        sliding_window: int | None = None,
        scaling: float | None = None,
        logit_cap: float | None = None,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            num_kv_heads_of(config),
            bias=options.qkv_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=options.o_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        # One module for all layers (LlamaModel passes it): the angles of a step's
        # positions are then computed once, not once per layer.
        self.rotary_emb = rotary_emb or rotary_embedding_of(config)
        self.attn = RadixAttention(
            self.num_heads, head_dim, scaling or head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window=sliding_window, logit_cap=logit_cap,
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[n, hidden] -> [n, hidden]`` for the batch's new tokens.

        With ``output_rows``, ``[len(output_rows), hidden]``: every new token's keys
        and values are cached, but only those rows are attended for and projected.
        """
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self._per_head(self.q_norm, q)
            k = self._per_head(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch, rows=output_rows))

    def _per_head(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view(x.shape)


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up stacked in one matrix."""

    def __init__(self, config: Any, *, tp_rank: int, tp_size: int,
                 activation: str | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        # ``activation``: a family that names it in another field (Gemma's
        # ``hidden_activation``).
        self.act_fn = GatedActivation(activation or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(
        self, config: Any, layer_id: int, options: AttentionOptions, *, tp_rank: int, tp_size: int,
        rotary_emb: RotaryEmbedding | None = None, sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, options, tp_rank=tp_rank, tp_size=tp_size,
                                        rotary_emb=rotary_emb, sliding_window=sliding_window)
        self.mlp = LlamaMLP(config, tp_rank=tp_rank, tp_size=tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the running residual stream separately.

        Keeping the residual apart lets the next norm add it (``RMSNorm(x, residual)``).
        With ``output_rows``, every row's keys and values are still cached, but
        only those rows go through the rest (attention's queries, the output
        projection, the MLP) and are returned.
        """
        attn_out, residual = attend(self, positions, hidden_states, forward_batch, residual,
                                    output_rows)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(normed), residual


def attend(layer: nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor,
           forward_batch: ForwardBatch, residual: torch.Tensor | None,
           output_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's first half: ``layer.input_layernorm`` (adding the residual
    stream), then ``layer.self_attn``; returns the attention output and the residual, both
    at ``output_rows`` when given."""
    if residual is None:
        residual = hidden_states
        normed = layer.input_layernorm(hidden_states)
    else:
        normed, residual = layer.input_layernorm(hidden_states, residual)
    attn_out = layer.self_attn(positions, normed, forward_batch, output_rows)
    if output_rows is not None:
        residual = residual.index_select(0, output_rows)
    return attn_out, residual


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm (of one pipeline stage: its share)."""

    def __init__(
        self, config: Any, options: AttentionOptions, *, tp_rank: int, tp_size: int,
        pp_rank: int = 0, pp_size: int = 1,
    ) -> None:
        super().__init__()
        self.set_stage(config, pp_rank, pp_size)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
            )
        # Layers of other stages are empty placeholders, so that parameter names keep the
        # checkpoint's layer numbers; a layer's KV lives in this stage's pool at its index
        # among the stage's layers.
        rotary_emb = rotary_embedding_of(config)
        self.layers = nn.ModuleList(
            self.make_layer(config, layer_id, options, tp_rank=tp_rank, tp_size=tp_size,
                            rotary_emb=rotary_emb)
            if self.start_layer <= layer_id < self.end_layer else nn.Identity()
            for layer_id in range(config.num_hidden_layers)
        )
        self.norm: RMSNorm | None = None
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_layer(self, config: Any, layer_id: int, options: AttentionOptions, *,
                   tp_rank: int, tp_size: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        """Decoder layer ``layer_id`` of the checkpoint, one this stage holds (a family
        with other layers, or other MLPs, builds its own)."""
        return LlamaDecoderLayer(config, layer_id - self.start_layer, options, tp_rank=tp_rank,
                                 tp_size=tp_size, rotary_emb=rotary_emb,
                                 sliding_window=sliding_window_of(config, layer_id))

    def set_stage(self, config: Any, pp_rank: int, pp_size: int) -> None:
        """Which layers this pipeline stage holds, and whether it is the first or the last."""
        self.is_first_stage = pp_rank == 0
        self.is_last_stage = pp_rank == pp_size - 1
        self.start_layer, self.end_layer = (0, config.num_hidden_layers) if pp_size == 1 \
            else stage_layers(config.num_hidden_layers, pp_rank, pp_size)

    def holds(self, name: str) -> bool:
        """Whether the parameter ``name`` (relative to this module) belongs to this stage."""
        head, _, rest = name.partition(".")
        if head == "layers":
            return self.start_layer <= int(rest.partition(".")[0]) < self.end_layer
        if head == "embed_tokens":
            return self.is_first_stage
        return self.is_last_stage if head == "norm" else True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states ``[n, hidden]`` of the batch's new tokens.

        With ``output_rows`` (on the last stage), only those rows' final hidden
        states, in that order: the last layer computes the rest of its block
        (attention's queries, output projection, MLP) for them alone. In a
        prefill, where only each prompt's last token makes a token, that is most
        of the last layer's work.

        A stage but the last returns ``(hidden, residual)`` after its layers; a
        stage but the first starts from the previous one's (``intermediate``).
        """
        residual: torch.Tensor | None = None
        if intermediate is not None:
            hidden_states, residual = intermediate
        else:
            assert self.embed_tokens is not None  # the first stage holds the embedding
            hidden_states = self.embed_tokens(input_ids)
        last = self.end_layer - 1
        for index in range(self.start_layer, self.end_layer):
            rows = output_rows if index == last and self.is_last_stage else None
            hidden_states, residual = self.layers[index](
                positions, hidden_states, forward_batch, residual, rows)
        if not self.is_last_stage:
            assert residual is not None  # every stage holds at least one layer
            return hidden_states, residual
        assert self.norm is not None
        if residual is None:  # a model without layers
            if output_rows is not None:
                hidden_states = hidden_states.index_select(0, output_rows)
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama decoder with its language-model head."""

    #: ``load_weights`` takes unread checkpoint slices: each layer's loader reads only this
    #: rank's part, and tensors of other pipeline stages are skipped unread.
    loads_checkpoint_slices = True
    #: A generation model: its forward returns logits (``--is-embedding`` pools its hidden
    #: states instead, with ``get_embedding=True``).
    is_embedding_model: ClassVar[bool] = False

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """Llama: bias on all four projections when ``attention_bias``, no q/k norm."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device(device), default_dtype(dtype):
            self.model = self.build_model(config, tp_rank=tp_rank, tp_size=tp_size,
                                          pp_rank=pp_rank, pp_size=pp_size)
            # Only the last stage projects onto the vocabulary: a first stage that is not
            # also the last holds no head (tied or not), so none is packed or counted there.
            self.lm_head: VocabParallelEmbedding | None = None
            if self.model.is_last_stage and self.tie_word_embeddings \
                    and self.model.embed_tokens is not None:
                self.lm_head = self.model.embed_tokens
            elif self.model.is_last_stage:
                # Untied, or tied on a last stage without the embedding: a head of its own
                # (then loaded from the embedding table).
                self.lm_head = ParallelLMHead(
                    config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
                )

    def build_model(self, config: Any, *, tp_rank: int, tp_size: int, pp_rank: int,
                    pp_size: int) -> LlamaModel:
        """The decoder stack of this rank (a family with other layers builds its own)."""
        return LlamaModel(config, self.attention_options(config), tp_rank=tp_rank,
                          tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        get_embedding: bool = False,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One row per request: float32 next-token logits ``[B, vocab]``.

        When the batch asks for prompt logprobs, the logits of its
        ``prompt_logprob_rows`` follow (``[B + m, vocab]``). With
        ``get_embedding``, the L2-normalized final hidden state of each
        request's last token ``[B, hidden]`` instead (last-token pooling).
        A pipeline stage but the last returns ``(hidden, residual)`` instead.
        """
        rows = order = None
        if self.model.is_last_stage:
            rows = forward_batch.last_token_rows() if get_embedding else forward_batch.logits_rows()
            if rows is not None and rows.shape[0] == input_ids.shape[0]:
                # Every row makes logits (a verify step's): the last layer runs them all,
                # and they are put in order after it, rather than picked row by row inside
                # (LoRA's output rows follow the same rule: lora/serving.py _output_rows).
                rows, order = None, rows
        hidden_states = self.model(input_ids, positions, forward_batch, intermediate, rows)
        if isinstance(hidden_states, tuple):
            return hidden_states
        if order is not None:
            hidden_states = hidden_states.index_select(0, order)
        if get_embedding:
            return F.normalize(hidden_states.float(), p=2.0, dim=-1)
        assert self.lm_head is not None  # the last stage holds the head
        return self.lm_head.compute_logits(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, CheckpointWeight]]) -> None:
        """Copy Hugging Face-named weights into the model, stacking q/k/v and gate/up.

        Each weight is read by its parameter's loader, which reads only this
        rank's part of it; weights of other pipeline stages are not read at all.

        Raises:
            ValueError: a weight matches no parameter or has the wrong shape, or a
                parameter got no weight.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | int | None]] = set()
        for checkpoint_name, tensor in weights:
            name = self._parameter_name(checkpoint_name)
            if name is None:
                continue
            param_name, shard_id = self._stacked_target(name)
            param = params.get(param_name)
            if param is None and not self._held_by_this_stage(param_name):
                continue  # another pipeline stage loads it
            if param is None:
                raise ValueError(f"checkpoint weight {checkpoint_name!r} matches no parameter")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(f"checkpoint weight {checkpoint_name!r}: {exc}") from None
            loaded.add((param_name, shard_id))
        missing = sorted(
            name if shard is None else f"{name}[{shard}]"
            for name, shard in self._expected_loads(params) - loaded
        )
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint has no weights for {len(missing)} parameters: {shown}")

    def _parameter_name(self, checkpoint_name: str) -> str | None:
        """The model-side name of a checkpoint weight, or None for weights to skip."""
        if "rotary_emb.inv_freq" in checkpoint_name:
            return None  # derived buffer some old checkpoints store
        if self.tie_word_embeddings and checkpoint_name == "lm_head.weight":
            return None  # tied: the head is the embedding table
        if (self.tie_word_embeddings and checkpoint_name == "model.embed_tokens.weight"
                and self.model.embed_tokens is None and self.lm_head is not None):
            return "lm_head.weight"  # a last stage's own copy of the tied table
        return checkpoint_name

    def _held_by_this_stage(self, name: str) -> bool:
        if name.startswith("model."):
            return self.model.holds(name.removeprefix("model."))
        return self.lm_head is not None

    @staticmethod
    def _stacked_target(name: str) -> tuple[str, str | int | None]:
        for checkpoint_part, param_part, shard_id in _STACKED_PARAMS:
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{param_part}."), shard_id
        return name, None

    @staticmethod
    def _expected_loads(params: dict[str, nn.Parameter]) -> set[tuple[str, str | int | None]]:
        expected: set[tuple[str, str | int | None]] = set()
        for name in params:
            stacked = name.split(".")[-2]
            for shard_id in _SHARDS_OF_STACKED.get(stacked, (None,)):
                expected.add((name, shard_id))
        return expected


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture, every layer attending within its sliding window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on the q/k/v projections, none on the output projection."""

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """Qwen2 always has q/k/v bias."""
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm over each query and key head before RoPE."""

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        """Per-head q/k norm; bias on all four projections when ``attention_bias``."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
