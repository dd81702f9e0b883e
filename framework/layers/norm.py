"""RMS normalization, computed in float32 like the reference implementations."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    The statistics are taken in float32 and the result is cast back to the
    input dtype before the weight is applied, as Hugging Face's Llama does, so
    that half-precision outputs round the same way.

    With ``cpu_ops`` bound (``bind_cpu_layer_ops``: float32 or bfloat16 on a CPU),
    rows run through the native kernel instead, the residual add fused in: one pass
    over the activations instead of six (in bfloat16, rounded where these operators
    round).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        #: The native CPU kernels (``load_cpu_kernels``) when bound, else None (the torch
        #: operators).
        self.cpu_ops: Any = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x``; with ``residual``, normalize ``x + residual`` and return the sum too.

        The second form is the pre-norm transformer step: it returns
        ``(norm(x + residual), x + residual)``.
        """
        if self.cpu_ops is not None and _plain_rows(x) and x.dtype == self.weight.dtype:
            if residual is None:
                return self.cpu_ops.rms_norm(x, self.weight, self.eps)
            if _plain_rows(residual):
                normed, summed = self.cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
                return normed, summed
        if residual is None:
            return self._normalize(x)
        summed = x + residual
        return self._normalize(summed), summed

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _plain_rows(x: torch.Tensor) -> bool:
    """Whether the native kernels take ``x`` as it is: contiguous ``[rows, features]``."""
    return x.dim() == 2 and x.is_contiguous()
