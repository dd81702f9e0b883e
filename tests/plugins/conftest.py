"""Run the Triton kernels in Triton's CPU interpreter where there is no GPU.

Triton decides between compiling and interpreting when a kernel is defined,
so the variable is set here, before any test module imports the kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
