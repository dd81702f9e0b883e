"""LoRA adapters served many per batch: loading and checking PEFT adapters
(``adapter``), each forward's per-row slots (``batch``), the batched kernels
(``ops``), the wrapped linear layers (``layers``) and the slot cache (``slots``)."""

from framework.lora.adapter import LoraAdapter, ModelLoraSpec
from framework.lora.batch import NO_SLOT, LoraBatch
from framework.lora.layers import LoraLinear, LoraModel, apply_lora
from framework.lora.slots import LoraSlots

__all__ = ["NO_SLOT", "LoraAdapter", "LoraBatch", "LoraLinear", "LoraModel", "LoraSlots",
           "ModelLoraSpec", "apply_lora"]
