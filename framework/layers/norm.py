"""RMS normalization, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    The statistics are taken in float32 and the result is cast back to the
    input dtype before the weight is applied, as Hugging Face's Llama does, so
    that half-precision outputs round the same way.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x``; with ``residual``, normalize ``x + residual`` and return the sum too.

        The second form is the pre-norm transformer step: it returns
        ``(norm(x + residual), x + residual)``.
        """
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
