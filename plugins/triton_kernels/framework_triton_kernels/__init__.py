"""Triton kernels for framework's MoE, quantized-linear and LoRA registries."""
