"""BERT encoder for sentence embeddings over packed batches.

One forward step takes the tokens of several whole sequences concatenated without padding (an
EXTEND batch with no cached prefix). Every linear layer runs on the packed tokens; attention is
bidirectional and stays within each sequence. An encoder keeps no KV cache, so it holds no
``RadixAttention`` layer and uses neither the attention backend nor the KV pools. The output is
one pooled embedding per sequence, pooled and normalized as the checkpoint's
sentence-transformers configuration says.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from framework.layers.pooler import Pooler, PoolingConfig, load_pooling_config

if TYPE_CHECKING:
    from transformers import BertConfig

    from framework.forward_batch import ForwardBatch

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Checkpoint names of the separate query/key/value projections, which load into one fused matrix.
_QKV_NAME = re.compile(
    r"^(encoder\.layer\.\d+\.attention)\.self\.(query|key|value)\.(weight|bias)$"
)
_QKV_SHARDS = {"query": 0, "key": 1, "value": 2}
# Buffers some checkpoints store next to the weights; they are derived, not loaded.
_IGNORED_BUFFERS = frozenset({"embeddings.position_ids", "embeddings.token_type_ids"})
# Old TensorFlow-converted checkpoints name LayerNorm parameters gamma and beta.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


@dataclass(frozen=True)
class PackedAttentionLayout:
    """Where the packed tokens sit in a [batch, max_len] grid for batched attention.

    Attention runs on the sequences laid out in a padded grid so that one SDPA call serves the
    whole batch; the key mask keeps each query on the real tokens of its own sequence. Linear
    layers never see the padding. When all sequences have the same length the grid is the packed
    tensor itself, so no index and no mask are needed.
    """

    batch_size: int
    max_len: int
    token_index: torch.Tensor | None  # [num_tokens]: flat grid slot of each packed token
    key_mask: torch.Tensor | None  # [batch, 1, 1, max_len] bool: True on real tokens

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device) -> PackedAttentionLayout:
        """Lay out sequences of the given lengths (all positive), packed in order."""
        batch_size, max_len = len(seq_lens), max(seq_lens)
        if min(seq_lens) == max_len:
            return cls(batch_size, max_len, None, None)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.cumsum(lens, dim=0) - lens
        sequence_ids = torch.repeat_interleave(torch.arange(batch_size), lens)
        offsets = torch.arange(int(lens.sum())) - starts[sequence_ids]
        token_index = sequence_ids * max_len + offsets
        key_mask = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)
        return cls(
            batch_size,
            max_len,
            token_index.to(device),
            key_mask.view(batch_size, 1, 1, max_len).to(device),
        )

    def to_grid(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[num_tokens, heads * head_dim] -> [batch, heads, max_len, head_dim]."""
        head_dim = x.shape[-1] // num_heads
        x = x.reshape(-1, num_heads, head_dim)
        if self.token_index is not None:
            grid = x.new_zeros(self.batch_size * self.max_len, num_heads, head_dim)
            x = grid.index_copy_(0, self.token_index, x)
        return x.view(self.batch_size, self.max_len, num_heads, head_dim).transpose(1, 2)

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, max_len, head_dim] -> [num_tokens, heads * head_dim]."""
        batch_size, num_heads, max_len, head_dim = x.shape
        x = x.transpose(1, 2).reshape(batch_size * max_len, num_heads * head_dim)
        return x if self.token_index is None else x[self.token_index]


def bidirectional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    layout: PackedAttentionLayout,
) -> torch.Tensor:
    """Full (non-causal) attention of packed tokens within their own sequences."""
    out = F.scaled_dot_product_attention(
        layout.to_grid(q, num_heads),
        layout.to_grid(k, num_heads),
        layout.to_grid(v, num_heads),
        attn_mask=layout.key_mask,
    )
    return layout.from_grid(out)


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type (always type 0) embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        factory = {"dtype": dtype, "device": device}
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, **factory)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, **factory)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, **factory)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, **factory)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden]."""
        # Every token has type 0, so its type embedding is one row added to all tokens.
        embeddings = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings.weight[0]
            + self.position_embeddings(positions)
        )
        return self.LayerNorm(embeddings)


class BertResidualOutput(nn.Module):
    """Projection, residual add and LayerNorm closing BERT's attention and MLP blocks."""

    def __init__(
        self, config: BertConfig, in_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense = nn.Linear(in_features, hidden, dtype=dtype, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """LayerNorm(dense(x) + residual)."""
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention with one fused query/key/value projection."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.output = BertResidualOutput(config, hidden, dtype, device)

    def forward(self, hidden_states: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]."""
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        context = bidirectional_attention(q, k, v, self.num_heads, layout)
        return self.output(context, hidden_states)


class BertIntermediate(nn.Module):
    """The MLP's up projection and activation."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dense = nn.Linear(
            config.hidden_size, config.intermediate_size, dtype=dtype, device=device
        )
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, intermediate]."""
        return self.activation(self.dense(hidden_states))


class BertLayer(nn.Module):
    """One post-LayerNorm transformer encoder layer."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.attention = BertAttention(config, dtype, device)
        self.intermediate = BertIntermediate(config, dtype, device)
        self.output = BertResidualOutput(config, config.intermediate_size, dtype, device)

    def forward(self, hidden_states: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]."""
        attended = self.attention(hidden_states, layout)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """The stack of encoder layers."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, dtype, device) for _ in range(config.num_hidden_layers)
        )

    def forward(self, hidden_states: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]."""
        for layer in self.layer:
            hidden_states = layer(hidden_states, layout)
        return hidden_states


class BertModel(nn.Module):
    """BERT sentence-embedding model: packed token ids in, one pooled embedding per sequence out.

    Args:
        config: the checkpoint's `transformers.BertConfig`.
        dtype: parameter and activation dtype (pooling and normalization run in float32).
        device: where the parameters live.
        pooling_config: how to pool; when None it is read from `model_dir`
            (see `load_pooling_config`), which defaults to mean pooling with L2 normalization.
        model_dir: the checkpoint directory holding the sentence-transformers files.

    Raises:
        ValueError: the configuration is one this model does not implement, or both
            `pooling_config` and `model_dir` are given.
    """

    #: An embedding model: its forward returns one pooled embedding per sequence.
    is_embedding_model: ClassVar[bool] = True

    def __init__(
        self,
        config: BertConfig,
        dtype: torch.dtype,
        device: torch.device,
        *,
        pooling_config: PoolingConfig | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        super().__init__()
        _check_supported(config)
        if pooling_config is not None and model_dir is not None:
            raise ValueError("give either pooling_config or model_dir, not both")
        if pooling_config is None:
            pooling_config = (
                load_pooling_config(model_dir) if model_dir is not None else PoolingConfig()
            )
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype, device)
        self.encoder = BertEncoder(config, dtype, device)
        self.pooler = Pooler(pooling_config)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Embed the packed sequences of an EXTEND batch: returns [batch_size, hidden] float32."""
        seq_lens = _packed_seq_lens(forward_batch)
        layout = PackedAttentionLayout.build(seq_lens, input_ids.device)
        hidden_states = self.encoder(self.embeddings(input_ids, positions), layout)
        return self.pooler(hidden_states, seq_lens)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face BERT weights into the model.

        Names may carry a `bert.` prefix; task heads (pooler, MLM, classifiers) are skipped.

        Raises:
            ValueError: an encoder weight has an unknown name or the wrong shape, or a
                parameter of the model got no weight.
        """
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size
        expected = {(name, shard) for name in params for shard in _shards_of(name)}
        loaded: set[tuple[str, int]] = set()
        for checkpoint_name, tensor in weights:
            name = _normalize_checkpoint_name(checkpoint_name)
            if name is None:
                continue
            param_name, shard = _param_name_and_shard(name)
            if param_name not in params:
                raise ValueError(f"checkpoint weight {checkpoint_name!r} matches no parameter")
            target = params[param_name]
            if shard is not None:
                target = target[shard * hidden : (shard + 1) * hidden]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint weight {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add((param_name, shard or 0))
        missing = sorted(name for name, _ in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint has no weights for {missing}")


def _check_supported(config: BertConfig) -> None:
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type {position_type!r} is not supported")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act {config.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not a multiple of "
            f"num_attention_heads {config.num_attention_heads}"
        )


def _packed_seq_lens(forward_batch: ForwardBatch) -> list[int]:
    if not forward_batch.forward_mode.is_extend():
        raise ValueError("an encoder model only runs EXTEND batches")
    if forward_batch.extend_seq_lens_cpu is None:
        raise ValueError("extend_seq_lens_cpu must give the length of each packed sequence")
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    if prefix_lens is not None and any(prefix_lens):
        raise ValueError("an encoder model embeds whole sequences; cached prefixes are not allowed")
    return list(forward_batch.extend_seq_lens_cpu)


def _normalize_checkpoint_name(name: str) -> str | None:
    """The name relative to the encoder, or None for weights this model does not use."""
    name = name.removeprefix("bert.")
    if name in _IGNORED_BUFFERS or not name.startswith(("embeddings.", "encoder.")):
        return None
    for legacy, current in _LEGACY_SUFFIXES.items():
        if name.endswith(legacy):
            return name.removesuffix(legacy) + current
    return name


def _param_name_and_shard(name: str) -> tuple[str, int | None]:
    """Map a checkpoint name to a parameter name and, for query/key/value, its fused shard."""
    match = _QKV_NAME.match(name)
    if match is None:
        return name, None
    prefix, projection, kind = match.groups()
    return f"{prefix}.qkv_proj.{kind}", _QKV_SHARDS[projection]


def _shards_of(param_name: str) -> range:
    return range(3) if ".qkv_proj." in param_name else range(1)
