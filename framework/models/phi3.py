"""Phi-3: the Llama decoder, with q/k/v and gate/up fused in its checkpoints.

A Phi-3 layer computes what a Llama layer without biases computes: pre-norm
blocks, grouped-query attention with RoPE and a SwiGLU MLP. Only the
checkpoint differs: ``self_attn.qkv_proj`` holds ``[q | k | v]`` and
``mlp.gate_up_proj`` holds ``[gate | up]``, stacked along the output rows.
The model's stacked parameters bear the same names, but a rank holds only its
heads of q, k and v and its rows of gate and up, so each fused tensor is cut
into its parts (still unread) and every part goes to the layer's shard loader,
which reads only this rank's rows of it.

``sliding_window`` applies to every layer, as in transformers, which masks
all of Phi-3's layers with one sliding-window mask. The RoPE settings of
long-context Phi-3 checkpoints (``rope_type`` ``"longrope"``/``"su"`` with
short and long factors) and ``partial_rotary_factor`` below 1 are refused
when the model is built (``RopeConfig.from_hf_config`` raises ``ValueError``
naming the setting).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from framework.layers.linear import CheckpointWeight
from framework.layers.quantization.weights import QuantizedWeight
from framework.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of

# A fused projection's parts in checkpoint order: (name of the part as LlamaForCausalLM
# loads it, its number of output rows).
FusedParts = tuple[tuple[str, int], ...]


class RowSlice:
    """Rows ``start .. start + rows - 1`` of a checkpoint weight, read only when indexed.

    A ``CheckpointWeight`` itself, so that the layers' shard loaders take it as
    they take a whole tensor: they narrow it to their rank's rows, and only
    those are read from the file.
    """

    def __init__(self, whole: CheckpointWeight, start: int, rows: int) -> None:
        self._whole = whole
        self._start = start
        self._rows = rows

    @property
    def shape(self) -> torch.Size:
        """``(rows, *trailing shape of the whole weight)``."""
        return torch.Size((self._rows, *self._whole.shape[1:]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``length`` entries from ``start`` along ``dim`` of the slice."""
        if dim % len(self.shape) == 0:
            return self._whole.narrow(0, self._start + start, length)
        return self._all_rows().narrow(dim, start, length)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The slice's entries at ``index`` (``[...]``: all of them)."""
        return self._all_rows()[index]

    def _all_rows(self) -> torch.Tensor:
        return self._whole.narrow(0, self._start, self._rows)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 with its language-model head; loads the fused ``qkv_proj`` and ``gate_up_proj``."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointWeight]]) -> None:
        """Copy Hugging Face-named Phi-3 weights into the model.

        Each fused tensor is loaded as its parts (q, k, v; gate, up), each rank
        reading only its rows of every part.

        Raises:
            ValueError: a fused tensor has the wrong shape, a weight matches no
                parameter or has the wrong shape, or a parameter got no weight
                (a missing fused tensor leaves all of its parts without one).
        """
        super().load_weights(self._split_fused(weights))

    def fused_parts(self) -> dict[str, FusedParts]:
        """Each fused projection of the checkpoint and its parts, from the config."""
        config = self.config
        head_dim = head_dim_of(config)
        q_rows = config.num_attention_heads * head_dim
        kv_rows = num_kv_heads_of(config) * head_dim
        mlp_rows = config.intermediate_size
        return {
            "qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)),
            "gate_up_proj": (("gate_proj", mlp_rows), ("up_proj", mlp_rows)),
        }

    def _split_fused(
        self, weights: Iterable[tuple[str, CheckpointWeight | QuantizedWeight]]
    ) -> Iterator[tuple[str, CheckpointWeight | QuantizedWeight]]:
        """The checkpoint's weights with each fused tensor replaced by its named parts (a
        quantized one's by its output rows, ``narrow_out``)."""
        fused = self.fused_parts()
        for name, weight in weights:
            projection = next((p for p in fused if f".{p}." in name), None)
            if projection is None:
                yield name, weight
                continue
            parts = fused[projection]
            self._check_fused_shape(name, weight, sum(rows for _, rows in parts))
            start = 0
            for part, rows in parts:
                piece = weight.narrow_out(start, rows) if isinstance(weight, QuantizedWeight) \
                    else RowSlice(weight, start, rows)
                yield name.replace(f".{projection}.", f".{part}."), piece
                start += rows

    def _check_fused_shape(self, name: str, weight: CheckpointWeight | QuantizedWeight,
                           rows: int) -> None:
        # Checked whole, so that a wrong size is reported under the checkpoint's own name
        # rather than under the name of one of its parts.
        expected = (rows, self.config.hidden_size) if name.endswith(".weight") else (rows,)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"checkpoint weight {name!r} has shape {tuple(weight.shape)}, expected {expected}"
            )
