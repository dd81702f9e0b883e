"""Calibrating a decoder layer's MoE experts (``framework quantize --calibration-data``).

transformers holds a layer's experts stacked, in one module (``gate_up_proj [E, 2I, H]``,
each expert's gate rows first, and ``down_proj [E, H, I]``), which the layer calls with
its token rows and each token's chosen experts. Each expert's projections are calibrated
as the dense ones are (``calibration.py``), on the rows routed to it: the rows of the
tokens the partly quantized layer routes to the expert (``Xq``) against the float layer's
rows of the same tokens (``Xf``). Every expert's gate and up projections (which read
those rows) are rounded first; then its down projection, which reads ``act(gate) * up``
of them: through the expert's rounded gate and up for ``Xq``, its float ones for ``Xf``.

A checkpoint names each expert's projections (``experts.{e}.gate_proj``, Mixtral's
``experts.{e}.w1``, ...) under a path that need not be the module's
(``block_sparse_moe`` against transformers' ``mlp``), so the module is found by what it
holds (``stacked_experts``), and each name placed in it by its expert and part
(``ExpertPlace``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from framework.layers.moe.experts import DOWN, GATE, UP, expert_weight_name
from framework.layers.quantization.error_compensation import GridFit, calibrated_rounding
from framework.layers.quantization.grid import QuantGrid
from framework.layers.quantization.layer_inputs import module_call


@dataclass(frozen=True)
class ExpertPlace:
    """Where one checkpoint projection lies in transformers' stacked experts."""

    module: str  # the experts module's name in the model
    expert: int
    part: str  # GATE, UP or DOWN


def expert_part(name: str) -> tuple[int, str] | None:
    """``(expert, part)`` of a checkpoint name of an expert's projection (relative to its
    layer, without ``.weight``); None for any other name."""
    target = expert_weight_name(f"{name}.weight")
    return None if target is None else (target.expert, target.part)


def stacked_experts(layer: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The name (relative to ``layer``) and module of the layer's experts: the one module
    holding three-dimensional ``gate_up_proj`` and ``down_proj``.

    Raises:
        ValueError: no such module, or more than one.
    """
    found = [(name, module) for name, module in layer.named_modules()
             if all(isinstance(getattr(module, attr, None), torch.Tensor)
                    and getattr(module, attr).dim() == 3
                    for attr in ("gate_up_proj", "down_proj"))]
    if len(found) != 1:
        raise ValueError("calibration: the checkpoint names experts, but the decoder layer "
                         f"holds {len(found)} modules of stacked experts (gate_up_proj "
                         "[E, 2I, H], down_proj [E, H, I]), not one")
    return found[0]


def expert_weight(module: torch.nn.Module, expert: int, part: str) -> torch.Tensor:
    """Expert ``expert``'s ``part`` projection in ``module``'s stacked weights (a view:
    ``[I, H]`` for gate and up, ``[H, I]`` for down)."""
    if part == DOWN:
        return module.down_proj[expert]
    size = module.down_proj.shape[2]
    start = 0 if part == GATE else size
    return module.gate_up_proj[expert, start:start + size]


@dataclass
class _Routed:
    """One batch's rows entering the experts, float and quantized, and the experts the
    quantized layer chose for each row."""

    float_x: torch.Tensor  # [T, H], in the model's dtype
    quant_x: torch.Tensor  # [T, H]
    choices: torch.Tensor  # [T, k]

    def rows(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The float and quantized rows (float64) of the tokens routed to ``expert``."""
        tokens = (self.choices == expert).any(dim=1)
        return self.float_x[tokens].double(), self.quant_x[tokens].double()


def _experts_call(layer: torch.nn.Module, path: str, hidden: torch.Tensor,
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[T, H]`` the layer's experts module ``path`` is called with on
    ``hidden``, and each row's chosen experts ``[T, k]`` (the module's ``hidden_states``
    and ``top_k_index``)."""
    args, call_kwargs = module_call(layer, layer.get_submodule(path), hidden, kwargs)
    values = dict(zip(("hidden_states", "top_k_index"), args, strict=False)) | call_kwargs
    rows = values["hidden_states"].reshape(-1, values["hidden_states"].shape[-1])
    return rows, values["top_k_index"].reshape(len(rows), -1)


def _routed(layer: torch.nn.Module, quant_layer: torch.nn.Module, path: str,
            batch: Any) -> _Routed:
    """The rows reaching the experts module ``path`` of both layers, for one batch."""
    float_x, _ = _experts_call(layer, path, batch.float_x, batch.kwargs)
    quant_x, choices = _experts_call(quant_layer, path, batch.quant_x, batch.kwargs)
    return _Routed(float_x, quant_x, choices)


def _gram(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``Xq^T Xq`` and ``Xq^T Xf`` summed over ``(Xf, Xq)`` pairs of rows."""
    hessian = cross = torch.zeros((), dtype=torch.float64)  # broadcasts to [in, in]
    for xf, xq in pairs:
        hessian = hessian + xq.t() @ xq
        cross = cross + xq.t() @ xf
    return hessian, cross


def _gated(module: torch.nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``act(x gate^T) * (x up^T)``: what expert ``expert``'s down projection reads."""
    gate = x @ expert_weight(module, expert, GATE).double().t()
    return module.act_fn(gate) * (x @ expert_weight(module, expert, UP).double().t())


def calibrate_experts(layer: torch.nn.Module, quant_layer: torch.nn.Module,
                      names: dict[str, tuple[int, str]], batches: list[Any], fit: GridFit,
                      damp: float, prefix: str) -> dict[str, tuple[torch.Tensor, QuantGrid]]:
    """Each expert projection of ``names`` (relative checkpoint names, without
    ``.weight``, with their ``(expert, part)``) rounded on its grid, by full checkpoint
    name (``prefix`` + name + ``.weight``); ``quant_layer``'s experts hold them after.

    ``batches`` hold the hidden states entering both layers (``calibration._Batch``).
    """
    path, _ = stacked_experts(layer)
    float_experts, quant_experts = layer.get_submodule(path), quant_layer.get_submodule(path)
    routed = [_routed(layer, quant_layer, path, batch) for batch in batches]
    by_expert: dict[int, dict[str, str]] = {}
    for name, (expert, part) in names.items():
        by_expert.setdefault(expert, {})[part] = name
    result: dict[str, tuple[torch.Tensor, QuantGrid]] = {}

    def round_group(expert: int, parts: tuple[str, ...],
                    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        hessian, cross = _gram(pairs)
        for part in parts:
            if part not in by_expert[expert]:
                continue
            full = f"{prefix}{by_expert[expert][part]}.weight"
            rounded, grid = calibrated_rounding(full, expert_weight(float_experts, expert, part),
                                                hessian, cross, fit, damp)
            expert_weight(quant_experts, expert, part).copy_(rounded)
            result[full] = (rounded, grid)

    for expert in sorted(by_expert):
        round_group(expert, (GATE, UP), (item.rows(expert) for item in routed))
    for expert in sorted(by_expert):
        pairs = ((_gated(float_experts, expert, xf), _gated(quant_experts, expert, xq))
                 for xf, xq in (item.rows(expert) for item in routed))
        round_group(expert, (DOWN,), pairs)
    return result


def expert_places(layer_name: str, layer: torch.nn.Module, names: dict[str, tuple[int, str]]
                  ) -> dict[str, ExpertPlace]:
    """Where each expert projection of ``names`` (as ``calibrate_experts`` takes them) lies
    in the model, by full checkpoint name; ``layer_name`` is the layer's in the model."""
    path, _ = stacked_experts(layer)
    return {f"{layer_name}.{name}.weight": ExpertPlace(f"{layer_name}.{path}", expert, part)
            for name, (expert, part) in names.items()}


def stacked_parameters(model: torch.nn.Module, weights: dict[str, torch.Tensor],
                       places: dict[str, ExpertPlace]) -> dict[str, torch.Tensor]:
    """``weights`` (by checkpoint name) as the model's parameters: each experts module's
    ``gate_up_proj`` and ``down_proj`` stacked from its experts' weights in ``weights``
    (the model's own for an expert not in them); other names are parameter names already.
    """
    params = {name: w for name, w in weights.items() if name not in places}
    by_module: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, place in places.items():
        if name in weights:
            by_module.setdefault(place.module, {})[place.expert, place.part] = weights[name]
    for module_name, held in by_module.items():
        module = model.get_submodule(module_name)

        def weight(expert: int, part: str, module: torch.nn.Module = module,
                   held: dict = held) -> torch.Tensor:
            return held.get((expert, part), expert_weight(module, expert, part))

        count = module.down_proj.shape[0]
        params[f"{module_name}.gate_up_proj"] = torch.stack(
            [torch.cat([weight(e, GATE), weight(e, UP)]) for e in range(count)])
        params[f"{module_name}.down_proj"] = torch.stack([weight(e, DOWN) for e in range(count)])
    return params
