"""Random PEFT LoRA adapters for a model directory, for serving benchmarks.

Each adapter is written as PEFT saves one (``adapter_config.json`` and
``adapter_model.safetensors``) with random ``lora_A``/``lora_B`` matrices of the
model's shapes, read from its ``config.json``; no base weights are needed, so the
model may be served with ``--load-format dummy``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

#: The attention projections, the usual LoRA targets.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection of a Llama-shaped config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_random_adapters(model_dir: Path, out_dir: Path, count: int, rank: int = 16,
                          targets: Sequence[str] = ATTENTION_TARGETS, seed: int = 0
                          ) -> dict[str, Path]:
    """Write ``count`` adapters ``lora0 ..`` under ``out_dir``; returns their directories."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    written = {}
    for index in range(count):
        directory = out_dir / f"lora{index}"
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module in targets:
                in_features, out_features = shapes[module]
                block = "self_attn" if module in ATTENTION_TARGETS else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(
                    rank, in_features, generator=generator) / in_features ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(
                    out_features, rank, generator=generator) / rank ** 0.5
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
            "target_modules": list(targets), "bias": "none",
            "base_model_name_or_path": str(model_dir)}), encoding="utf-8")
        written[f"lora{index}"] = directory
    return written
