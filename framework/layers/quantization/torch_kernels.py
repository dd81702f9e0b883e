"""The reference quantized-linear kernel: dequantize, then a float32 product.

It runs any device and every format, at the cost of a float32 copy of the weight per
call; the faster kernels are checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from framework.layers.quantization.weights import QuantizedWeight

#: The checkpoint formats this kernel multiplies by.
SUPPORTED_FORMATS = ("gptq", "awq", "fp8", "fp8_block", "int8")


def check_format(kernel: str, weight: QuantizedWeight, formats: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``weight``'s format is one of ``formats``."""
    if weight.format not in formats:
        raise ValueError(f"the {kernel} quantized-linear kernel does not support "
                         f"{weight.format!r} weights (it supports {', '.join(formats)})")


class TorchQuantLinear:
    """``y = x @ dequantize(w).T + bias``, computed in float32 and returned in ``x``'s dtype."""

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The weight unchanged: the reference reads the checkpoint layout as it is."""
        check_format("torch", weight, SUPPORTED_FORMATS)
        return weight

    def apply(self, weight: QuantizedWeight, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """Multiply ``x`` ``[n, in]`` by the weight: ``[n, out]``."""
        check_format("torch", weight, SUPPORTED_FORMATS)
        w = weight.dequantize().to(x.device)
        y = F.linear(x.float(), w, None if bias is None else bias.float())
        return y.to(x.dtype)
