"""LoRA adapters served many per batch: loading and checking PEFT adapters
(``adapter``), each forward's per-row slots (``batch``), the batched kernels
(``ops``), the wrapped linear layers (``layers``) and the slot cache (``slots``)."""

import importlib
from typing import Any

# Imported on first use: the server's own process reads ``framework.lora.names``
# without loading torch.
_HOMES = {"LoraAdapter": "adapter", "ModelLoraSpec": "adapter", "NO_SLOT": "batch",
          "LoraBatch": "batch", "LoraLinear": "layers", "LoraModel": "layers",
          "apply_lora": "layers", "LoraSlots": "slots"}

__all__ = ["NO_SLOT", "LoraAdapter", "LoraBatch", "LoraLinear", "LoraModel", "LoraSlots",
           "ModelLoraSpec", "apply_lora"]


def __getattr__(name: str) -> Any:
    """The public names, from their modules on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'framework.lora' has no attribute {name!r}")
    return getattr(importlib.import_module(f"framework.lora.{_HOMES[name]}"), name)
