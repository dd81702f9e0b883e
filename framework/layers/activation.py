"""Gated activations for merged ``[gate | up]`` projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """``act(gate) * up`` for an input laid out as ``[..., gate | up]``.

    With ``cpu_ops`` bound (``bind_cpu_layer_ops``: float32 or bfloat16 on a CPU), SiLU rows
    run through the native kernel: one pass instead of a SiLU and a product.
    """

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self._act = _ACTIVATIONS[hidden_act]
        #: The native CPU kernels (``load_cpu_kernels``) when bound, else None (the torch
        #: operators).
        self.cpu_ops: Any = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[..., 2 * d] -> [..., d]``."""
        if (self.cpu_ops is not None and self.hidden_act == "silu" and gate_up.dim() == 2
                and gate_up.is_contiguous()):
            return self.cpu_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act


class SiluAndMul(GatedActivation):
    """``silu(gate) * up``, the SwiGLU of Llama-family MLPs."""

    def __init__(self) -> None:
        super().__init__("silu")
