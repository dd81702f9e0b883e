"""Running one of transformers' decoder layers, or only as far as one of its modules, to
read what that module is called with (calibration, ``calibration.py``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class Stop(Exception):
    """Raised by a hook once it holds what it came for, to skip the rest of a forward."""


def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]
              ) -> torch.Tensor:
    """The decoder layer's output hidden states (some versions return a tuple)."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def module_call(layer: torch.nn.Module, module: torch.nn.Module, hidden: torch.Tensor,
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``module`` (inside ``layer``) is first called
    with when ``layer`` runs on ``hidden``; the rest of the layer does not run.

    Raises:
        ValueError: the layer never calls the module.
    """
    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(_module: torch.nn.Module, args: tuple, call_kwargs: dict) -> None:
        got.append((args, call_kwargs))
        raise Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with contextlib.suppress(Stop):
            run_layer(layer, hidden, kwargs)
    finally:
        handle.remove()
    if not got:
        raise ValueError(f"calibration: the decoder layer never calls its {type(module).__name__}")
    return got[0]
