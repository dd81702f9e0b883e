"""Rotary position embeddings (RoPE) with the default, "linear" and "llama3" frequency schemes.

Frequencies are computed in float32 from the absolute position of every packed
token, so any mix of prefill and decode tokens is rotated in one call. The
rotation follows the Hugging Face "rotate half" layout (the two halves of the
head dimension form the pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.layers.attention.native_build import KERNEL_DTYPES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE settings of a model, read from its Hugging Face config."""

    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    # "llama3" only:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> RopeConfig:
        """Read ``rope_parameters`` (transformers 5) or ``rope_scaling``/``rope_theta`` (older)."""
        params = getattr(hf_config, "rope_parameters", None) or getattr(
            hf_config, "rope_scaling", None
        ) or {}
        if any(isinstance(value, dict) for value in params.values()):
            raise ValueError("per-layer RoPE parameters are not supported")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        partial = params.get(
            "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)
        )
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None)
        kwargs: dict[str, Any] = {
            "rope_type": rope_type,
            "theta": float(theta or DEFAULT_ROPE_THETA),
        }
        if rope_type != "default":
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
            kwargs["original_max_position_embeddings"] = int(
                params.get("original_max_position_embeddings")
                or hf_config.max_position_embeddings
            )
        return cls(**kwargs)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """The ``head_dim // 2`` inverse frequencies (float32) of the given RoPE scheme."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the
    # band in between blends the two smoothly (Llama 3.1's context extension).
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their absolute positions.

    With ``cpu_ops`` bound (``bind_cpu_layer_ops``: float32 or bfloat16 on a CPU),
    the rotation runs in the native kernel: one pass, with the same roundings.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.rope = rope
        self.inv_freq: torch.Tensor
        # float32 whatever the model dtype; derived, so not a checkpoint weight.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        #: The native CPU kernels (``load_cpu_kernels``) when bound, else None (the torch
        #: operators).
        self.cpu_ops: Any = None
        # The last positions tensor seen (and its version: an in-place change counts as
        # new positions), the dtype, cos and sin: the layers that share this module
        # rotate by the same positions within a step.
        self._last: tuple[torch.Tensor, int | None, torch.dtype, torch.Tensor,
                          torch.Tensor] | None = None

    def rebuild_buffers(self, device: torch.device) -> None:
        """Compute ``inv_freq`` again on ``device`` (the module was built on the meta
        device, which holds no values)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[n, head_dim // 2]`` of each position's angles, in ``dtype``.

        Both halves of a head turn by the same angles, so half the table is enough.
        Asked again for the same positions tensor (the next layer of the step), it
        returns what it computed (holding the tensor keeps its identity unique).
        """
        # A tensor made in inference mode keeps no version counter.
        version = None if positions.is_inference() else positions._version
        last = self._last
        if last is not None and last[0] is positions and last[1] == version and last[2] == dtype:
            return last[3], last[4]
        # One product per angle, as the broadcast form's: the same values, in fewer ops.
        angles = torch.outer(positions.float(), self.inv_freq)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self._last = (positions, version, dtype, cos, sin)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[n, heads * head_dim]`` and ``k`` ``[n, kv_heads * head_dim]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        if self.cpu_ops is not None and _rows_of_features(q) and _rows_of_features(k):
            return (self.cpu_ops.rotary(q, cos, sin, self.head_dim),
                    self.cpu_ops.rotary(k, cos, sin, self.head_dim))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` per head, into a new tensor.

        The same products and sums, in the same order, as the "rotate half" form
        ``x * cos + rotate_half(x) * sin``, so the result is bit for bit the
        same; but written half by half into one output, without the
        concatenated copies and full-width temporaries that form makes (several
        times slower on a prefill's thousands of rows).
        """
        heads = x.view(x.shape[0], -1, self.head_dim)  # a view even of a column slice of qkv
        half = self.head_dim // 2
        x1, x2 = heads[..., :half], heads[..., half:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = torch.empty(heads.shape, dtype=x.dtype, device=x.device)
        first, second = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=first).sub_(x2 * sin)
        torch.mul(x2, cos, out=second).add_(x1 * sin)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope={self.rope}"


def _rows_of_features(x: torch.Tensor) -> bool:
    """Whether the native kernel reads ``x`` as it is: float32 or bfloat16 rows of contiguous
    features."""
    return x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.stride(1) == 1
