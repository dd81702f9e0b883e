"""Writing the shards of a quantized copy of a float checkpoint (``framework quantize``).

Every weight a linear layer loads (the q/k/v/o, gate/up/down projections, MoE experts'
included) is put on its format's grid (``WriteFormat.grid``), rounded to nearest or, when
calibrated (``calibration.py``), with its errors compensated, and stored in the layout
the hub's checkpoints of that format use, one output shard per input shard; every other
tensor is copied as it is. ``quantization_config`` is what ``config.json`` then says.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from framework.layers.moe.experts import expert_weight_name
from framework.layers.quantization.awq import awq_grid, quantize_awq
from framework.layers.quantization.fp8 import (
    fp8_block_grid,
    fp8_grid,
    quantize_fp8,
    quantize_fp8_block,
)
from framework.layers.quantization.gptq import gptq_grid, quantize_gptq
from framework.layers.quantization.grid import QuantGrid
from framework.layers.quantization.int8 import int8_grid, quantize_int8

#: The formats ``framework quantize`` writes.
WRITE_FORMATS = ("gptq", "awq", "fp8", "int8")
#: The checkpoint projections that load into linear layers, hence the ones quantized
#: (``qkv_proj`` and ``gate_up_proj``: Phi-3's fused ones).
TARGET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj", "qkv_proj", "gate_up_proj")
#: Projections that read one input and load stacked (q/k/v, gate/up, an expert's gate/up):
#: with act-order they share one row order, as the calibrated layers' shared input gives
#: them, so that their ``g_idx`` agree.
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                "gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}
#: The shards' index, written when the source has one.
INDEX_FILE = "model.safetensors.index.json"


def is_expert(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is one MoE expert's projection weight."""
    return expert_weight_name(name) is not None


def is_target(name: str, tensor: torch.Tensor) -> bool:
    """Whether checkpoint tensor ``name`` is a linear layer's or an MoE expert's weight to
    quantize."""
    parts = name.split(".")
    projection = len(parts) >= 2 and parts[-1] == "weight" and (
        is_expert(name) if "experts" in parts else parts[-2] in TARGET_PROJECTIONS)
    return projection and tensor.dim() == 2 and tensor.is_floating_point()


def _input_key(name: str) -> str:
    """Projections of one layer that read the same input share a key (see SHARED_INPUT)."""
    layer, projection = name.rsplit(".", 2)[:2]
    return f"{layer}.{SHARED_INPUT.get(projection, projection)}"


def _read(files: list[Path]) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """Each shard file with its tensors."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            yield file, {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def act_orders(files: list[Path]) -> dict[str, torch.Tensor]:
    """For each group of projections sharing an input, its act-order row order: input rows
    by descending norm over all of the group's output rows (one pass over the files)."""
    squares: dict[str, torch.Tensor] = {}
    for _, tensors in _read(files):
        for name, tensor in tensors.items():
            if is_target(name, tensor):
                key = _input_key(name)
                squares[key] = squares.get(key, 0) + tensor.float().square().sum(dim=0)
    return {key: total.argsort(descending=True, stable=True) for key, total in squares.items()}


@contextmanager
def _naming(name: str, weight: torch.Tensor, fmt: str) -> Iterator[None]:
    """A shape error of a format's writer, raised again naming the checkpoint tensor."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"cannot quantize {name} {tuple(weight.shape)} to {fmt}: {exc}") \
            from None


@dataclass(frozen=True)
class WriteFormat:
    """A format ``framework quantize`` writes, with its options.

    Attributes:
        name: ``gptq``, ``awq``, ``fp8`` or ``int8``.
        group_size: input features per scale, GPTQ and AWQ (-1: one group).
        act_order: GPTQ's ``desc_act``.
        block: FP8: one scale per ``block x block`` block of a weight
            (``weight_block_size``) instead of one per output channel.
    """

    name: str
    group_size: int = 128
    act_order: bool = False
    block: int | None = None

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` the hub's checkpoints of this format carry."""
        if self.name == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size,
                    "desc_act": self.act_order, "sym": True, "checkpoint_format": "gptq"}
        if self.name == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        if self.name == "fp8":
            config: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
            if self.block is not None:
                config["weight_block_size"] = [self.block, self.block]
            return config
        return {"quant_method": "int8"}

    def grid(self, name: str, weight: torch.Tensor, perm: torch.Tensor | None) -> QuantGrid:
        """The grid this format gives checkpoint tensor ``name`` (act-order rows ``perm``,
        GPTQ).

        Raises:
            ValueError: a shape the format cannot hold (e.g. a group size that does not
                divide the input features), naming the tensor.
        """
        with _naming(name, weight, self.name):
            if self.name == "gptq":
                return gptq_grid(weight, self.group_size, act_order=perm is not None,
                                 perm=perm)
            if self.name == "awq":
                return awq_grid(weight, self.group_size)
            if self.name == "fp8":
                return fp8_grid(weight) if self.block is None \
                    else fp8_block_grid(weight, self.block)
            return int8_grid(weight)

    def encode(self, name: str, weight: torch.Tensor, grid: QuantGrid
               ) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (full names) of one linear layer's weight on ``grid``.

        Raises:
            ValueError: a shape the format cannot pack (e.g. output rows not a multiple of
                eight), naming the tensor.
        """
        layer = name.removesuffix(".weight")
        with _naming(name, weight, self.name):
            if self.name == "gptq":
                parts = quantize_gptq(weight, grid=grid)
            elif self.name == "awq":
                parts = quantize_awq(weight, grid=grid)
            elif self.name == "fp8":
                parts = quantize_fp8(weight, grid) if self.block is None \
                    else quantize_fp8_block(weight, self.block, grid)
            else:
                int8 = quantize_int8(weight, grid)
                parts = {"weight": int8["qweight"], "weight_scale": int8["scale"]}
        return {f"{layer}.{part}": tensor.contiguous() for part, tensor in parts.items()}

    def quantize(self, name: str, weight: torch.Tensor, perm: torch.Tensor | None
                 ) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (full names) of one linear layer's weight, rounded to
        nearest.

        Raises:
            ValueError: a shape the format cannot hold, naming the tensor.
        """
        return self.encode(name, weight, self.grid(name, weight, perm))


def target_names(files: list[Path], fmt: WriteFormat) -> list[str]:
    """The names of the weights ``framework quantize`` quantizes, in checkpoint order.

    Raises:
        ValueError: a weight ``fmt`` cannot hold or pack, naming it (found before any
            calibration runs: each is rounded to nearest once).
    """
    names = []
    for _, tensors in _read(files):
        for name, tensor in tensors.items():
            if is_target(name, tensor):
                fmt.quantize(name, tensor, None)
                names.append(name)
    return names


def write_quantized_shards(files: list[Path], dst: Path, fmt: WriteFormat, *, index: bool,
                           calibrated: dict[str, tuple[torch.Tensor, QuantGrid]] | None = None
                           ) -> int:
    """Write each of ``files`` (a float checkpoint's shards, in order) to ``dst`` under its
    own name, its linear layers' weights in ``fmt``, and with ``index`` the shards'
    ``model.safetensors.index.json``; returns how many weights were quantized.

    ``calibrated`` holds weights already rounded onto their grids (``calibration.py``);
    the others are rounded to nearest.

    Raises:
        ValueError: a weight ``fmt`` cannot hold (``WriteFormat.quantize``).
    """
    calibrated = calibrated or {}
    orders = act_orders(files) if fmt.act_order and not calibrated else {}
    weight_map: dict[str, str] = {}
    total_size = count = 0
    for file, tensors in _read(files):
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name in calibrated:
                rounded, grid = calibrated[name]
                out.update(fmt.encode(name, rounded, grid))
                count += 1
            elif is_target(name, tensor):
                out.update(fmt.quantize(name, tensor, orders.get(_input_key(name))))
                count += 1
            else:
                out[name] = tensor.contiguous()
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
        total_size += sum(t.numel() * t.element_size() for t in out.values())
    if index:
        contents = {"metadata": {"total_size": total_size},
                    "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(contents, indent=2), encoding="utf-8")
    return count
