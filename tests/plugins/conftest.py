"""Run the Triton kernels in Triton's CPU interpreter where there is no GPU.

Triton decides between compiling and interpreting when a kernel is defined,
so the variable is set here, before any test module imports the kernels.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_interpreter_overflow_checks() -> None:
    """Turn off the interpreter's int32 overflow checks.

    The interpreter checks every int32 add, sub and mul for overflow (an int64 copy
    of the operation and an assert each), which costs about a third of a kernel's run;
    the tests' shapes stay far below 2**31, so the checks can never fire here.
    """
    try:
        from triton.runtime.interpreter import interpreter_builder
    except ImportError:  # a Triton without the interpreter: nothing to turn off
        return
    options = getattr(interpreter_builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_interpreter_overflow_checks()
