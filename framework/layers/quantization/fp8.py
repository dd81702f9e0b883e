"""FP8 (E4M3) weights, as the hub's FP8 checkpoints store them (compressed-tensors, fbgemm).

A layer ``[out, in]`` is stored as ``weight`` ``torch.float8_e4m3fn`` ``[out, in]`` and
``weight_scale``: one float for the tensor (a scalar, or ``[1]``) or one per output channel
(``[out, 1]``). ``w = weight.float() * weight_scale``. Checkpoints quantized for FP8
activations also carry an ``input_scale``; weight-only kernels leave it unused.

The writer quantizes per channel: ``weight_scale = amax / 448`` (448 is E4M3's largest
finite value) and ``weight = (w / weight_scale)`` rounded to E4M3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from framework.layers.quantization.weights import QuantizedWeight, require_tensors

#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: The smallest scale written, so an all-zero row still divides.
MIN_SCALE = 2.0**-30


@dataclass
class Fp8Weight(QuantizedWeight):
    """An FP8 checkpoint's ``weight`` and ``weight_scale`` (and any ``input_scale``)."""

    format: ClassVar[str] = "fp8"

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        """Check a layer's checkpoint tensors and wrap them.

        Raises:
            ValueError: a missing tensor, a weight that is not E4M3, or a scale that is
                neither per tensor nor per output channel.
        """
        require_tensors(tensors, ("weight", "weight_scale"), "FP8")
        weight, scale = tensors["weight"], tensors["weight_scale"]
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"FP8 weight must be a 2-D float8_e4m3fn, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if scale.numel() != 1 and tuple(scale.shape) != (weight.shape[0], 1):
            raise ValueError(f"FP8 weight_scale must be per tensor or [{weight.shape[0]}, 1], "
                             f"got {tuple(scale.shape)}")
        return cls(dict(tensors), (weight.shape[0], weight.shape[1]))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Fp8Weight:
        """Quantize a float ``[out, in]`` weight online (``quantize_fp8``) and wrap the result."""
        return cls.from_checkpoint(quantize_fp8(weight))

    def channel_scales(self) -> torch.Tensor:
        """The scale of each output channel as float32 ``[out]`` (a per-tensor one repeated)."""
        return self.tensors["weight_scale"].float().reshape(-1).expand(self.out_features)

    def dequantize(self) -> torch.Tensor:
        """``weight * weight_scale`` as float32 ``[out, in]``."""
        return self.tensors["weight"].float() * self.channel_scales()[:, None]


def quantize_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to E4M3 with a float32 scale per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    fp8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": fp8, "weight_scale": scale}
