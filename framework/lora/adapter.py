"""A PEFT LoRA adapter read from disk, and its check against a model.

PEFT saves an adapter as ``adapter_config.json`` plus ``adapter_model.safetensors``
whose keys name Hugging Face modules, e.g.
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``). The adapter's product for one module is
``scaling * B @ A @ x`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
under rsLoRA).

This project fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``;
``FUSED_MODULE_OF`` maps each Hugging Face module onto its fused layer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

#: Hugging Face projection name -> the fused layer of ``framework/models/llama.py`` holding it.
FUSED_MODULE_OF: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# The decoder-layer block each projection sits in, as Hugging Face names it.
_BLOCK_OF = {module: "self_attn" if module[0] in "qkvo" else "mlp" for module in FUSED_MODULE_OF}
_REFUSED_FIELDS = ("rank_pattern", "alpha_pattern", "modules_to_save")


@dataclass(frozen=True)
class ModelLoraSpec:
    """What a model offers to adapters: its layers, the modules that take a LoRA delta
    (Hugging Face names -> full ``(in_features, out_features)``) and the largest rank."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    max_rank: int


@dataclass(frozen=True)
class LoraWeights:
    """One module's adapter matrices: ``a`` ``[r, in]`` and ``b`` ``[out, r]``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded LoRA adapter: its rank, scaling and per-(layer, module) matrices."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], LoraWeights]

    @classmethod
    def load(cls, path: str | Path, name: str) -> LoraAdapter:
        """Read a PEFT adapter directory.

        Raises:
            ValueError: the config asks for what is not supported (per-module ranks
                or alphas, trained biases, fully trained modules), or the weights
                name a module or layout that is not a decoder layer's projection.
        """
        directory = Path(path)
        config = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
        rank, scaling = _rank_and_scaling(name, config)
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        weights = _pair_weights(name, tensors)
        _check_targets(name, config.get("target_modules"), set(weights))
        return cls(name=name, rank=rank, scaling=scaling, weights=weights)

    @property
    def modules(self) -> set[str]:
        """The Hugging Face module names this adapter changes."""
        return {module for _, module in self.weights}

    def check(self, spec: ModelLoraSpec) -> None:
        """Raise ``ValueError`` naming this adapter, the module and the mismatch unless
        every matrix fits the model described by ``spec``."""
        if self.rank > spec.max_rank:
            raise ValueError(f"LoRA adapter {self.name!r}: rank {self.rank} exceeds the "
                             f"maximum LoRA rank {spec.max_rank}")
        for (layer, module), pair in sorted(self.weights.items()):
            where = f"LoRA adapter {self.name!r}: layer {layer} {module}"
            if layer >= spec.num_layers:
                raise ValueError(f"{where}: the model has {spec.num_layers} layers")
            if module not in spec.shapes:
                raise ValueError(f"{where}: the model has no LoRA target {module!r} "
                                 f"(targets: {', '.join(sorted(spec.shapes))})")
            in_features, out_features = spec.shapes[module]
            expected_a, expected_b = (self.rank, in_features), (out_features, self.rank)
            if tuple(pair.a.shape) != expected_a or tuple(pair.b.shape) != expected_b:
                raise ValueError(
                    f"{where}: lora_A {tuple(pair.a.shape)} and lora_B {tuple(pair.b.shape)} "
                    f"do not match the module: expected {expected_a} and {expected_b}")


def _rank_and_scaling(name: str, config: dict[str, Any]) -> tuple[int, float]:
    """The adapter's rank and scaling, refusing what the batched kernels cannot serve."""
    for field in _REFUSED_FIELDS:
        if config.get(field):
            raise ValueError(f"LoRA adapter {name!r}: {field} is not supported "
                             f"(got {config[field]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported, "
                         "only 'none'")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _pair_weights(name: str, tensors: dict[str, torch.Tensor]
                  ) -> dict[tuple[int, str], LoraWeights]:
    """Group ``lora_A``/``lora_B`` tensors by (layer, module); each needs both."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in FUSED_MODULE_OF:
            raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks "
                             f"lora_{'B' if 'A' in pair else 'A'}")
        weights[(layer, module)] = LoraWeights(pair["A"], pair["B"])
    return weights


def _check_targets(name: str, targets: Any, present: set[tuple[int, str]]) -> None:
    """The weights must be of modules ``target_modules`` names: a list of module names,
    or a regex string that PEFT matches against whole module names."""
    if targets is None:
        return
    if isinstance(targets, str):
        pattern = re.compile(targets)
        stray = {module for layer, module in present
                 if not pattern.fullmatch(f"model.layers.{layer}.{_BLOCK_OF[module]}.{module}")}
    else:
        stray = {module for _, module in present} - set(targets)
    if stray:
        raise ValueError(f"LoRA adapter {name!r}: weights for {sorted(stray)} are not in "
                         f"target_modules {targets!r}")
