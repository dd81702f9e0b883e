"""Quantized weight formats (GPTQ, AWQ, FP8 per channel or block-wise, int8) and the
kernels that multiply by them.

Each format module unpacks a checkpoint's tensors into a ``QuantizedWeight`` and writes
them from a float weight; ``torch_kernels`` (the reference) and ``cpu_kernels`` are the
``QUANT_LINEAR_BACKENDS`` of ``framework.registry``.
"""

from framework.layers.quantization.awq import AwqWeight, quantize_awq
from framework.layers.quantization.fp8 import (
    Fp8BlockWeight,
    Fp8Weight,
    quantize_fp8,
    quantize_fp8_block,
)
from framework.layers.quantization.gptq import GptqWeight, quantize_gptq
from framework.layers.quantization.int8 import Int8Weight, quantize_int8
from framework.layers.quantization.weights import QuantizedWeight

__all__ = ["AwqWeight", "Fp8BlockWeight", "Fp8Weight", "GptqWeight", "Int8Weight",
           "QuantizedWeight", "quantize_awq", "quantize_fp8", "quantize_fp8_block",
           "quantize_gptq", "quantize_int8"]
