"""Static KV cache scales a checkpoint carries, for ``--kv-cache-dtype fp8_e4m3``.

FP8 checkpoints quantized with their KV cache (llm-compressor's ``kv_cache_scheme``,
AutoFP8) store each attention layer's scales beside its projections:
``model.layers.<i>.self_attn.k_scale`` and ``.v_scale`` (one for the layer, or one per
key/value head), or the older single ``.kv_scale`` for both; ``k ≈ code * k_scale``. The
weight loader takes them out of the tensors the model loads (``CheckpointKVScales.take``),
so that any model loads such a checkpoint; an FP8 KV cache then starts from them
(``rank_scales``) instead of 1.0, and the other KV cache dtypes leave them unused (int8
scales each token by itself).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from framework.layers.linear import rank_kv_heads

#: A layer's KV scale in a checkpoint: its layer index and which scale (k, v or both).
KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k|v|kv)_scale$")

T = TypeVar("T")


@dataclass
class CheckpointKVScales:
    """The KV scales of a checkpoint, by layer index in the whole model: ``[1]`` (the
    layer's) or ``[total key/value heads]`` float32."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self, weights: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """``weights`` without the KV scales, which are kept here as they pass."""
        for name, tensor in weights:
            match = KV_SCALE_NAME.search(name)
            if match is None:
                yield name, tensor
                continue
            layer, which = int(match[1]), match[2]
            scale = torch.as_tensor(tensor[...]).float().reshape(-1)  # type: ignore[index]
            if which in ("k", "kv"):
                self.keys[layer] = scale
            if which in ("v", "kv"):
                self.values[layer] = scale

    def rank_scales(self, layer: int, total_kv_heads: int, tp_rank: int, tp_size: int
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer``'s key and value scales for this rank's key/value heads
        (``rank_kv_heads``, as ``QKVParallelLinear`` splits them); None where the checkpoint
        has none.

        Raises:
            ValueError: a scale that is neither one for the layer nor one per head.
        """
        first, local = rank_kv_heads(total_kv_heads, tp_rank, tp_size)
        found = []
        for which, scales in (("k", self.keys), ("v", self.values)):
            scale = scales.get(layer)
            if scale is not None and scale.numel() not in (1, total_kv_heads):
                raise ValueError(f"layer {layer}'s {which}_scale has {scale.numel()} values; "
                                 f"expected 1 or one per key/value head ({total_kv_heads})")
            if scale is not None:
                scale = scale.expand(total_kv_heads) if scale.numel() == 1 else scale
                scale = scale[first:first + local].clone()
            found.append(scale)
        return found[0], found[1]
