"""Triton kernels for framework's LoRA registry (segmented shrink/expand)."""
