"""Calibrating MoE experts (``framework/layers/quantization/calibration_experts.py``).

On tiny Qwen2-MoE and Mixtral checkpoints (transformers holding each layer's experts
stacked, Mixtral's named ``block_sparse_moe.experts.{e}.w1`` in the checkpoint and
``mlp.experts`` in the model), calibration must round every expert's projection onto its
grid near that very projection's float weight (a gate taken for an up, or one expert for
another, is far off), and the experts it rounds must bring the model's logits closer to
the float model's than the same experts rounded to nearest; learned rounding must move
them by at most one code step, through transformers' stacked parameters.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.cli_quantize import quantize_checkpoint
from framework.layers.quantization.calibration import CalibrationSettings, calibrate
from framework.layers.quantization.calibration_experts import (
    ExpertPlace,
    expert_weight,
    stacked_parameters,
)
from framework.layers.quantization.checkpoint import CheckpointQuantization
from framework.layers.quantization.checkpoint_writer import WriteFormat, is_expert, target_names
from framework.layers.quantization.grid import QuantGrid
from framework.model_executor.weight_loader import find_safetensors_files
from tests.model_fixtures import reference_model

FORMAT = WriteFormat("gptq", group_size=16, act_order=True)
TEXT = " ".join(["the quick brown fox", "hello world, this is a test", "def add(a, b):"] * 60)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calibration_text") / "text.txt"
    path.write_text(TEXT)
    return path


def _calibrate(model_dir: Path, text: Path, steps: int = 0, batch: int = 8
               ) -> dict[str, tuple[torch.Tensor, QuantGrid]]:
    def fit(name: str, weight: torch.Tensor, order: torch.Tensor) -> QuantGrid:
        return FORMAT.grid(name, weight, order)

    targets = target_names(find_safetensors_files(model_dir), FORMAT)
    return calibrate(model_dir, targets, fit,
                     CalibrationSettings((text,), samples=8, seq_len=48, batch=batch,
                                         rounding_steps=steps))


def _on_grid(weight: torch.Tensor, grid: QuantGrid) -> bool:
    return torch.equal(grid.values(grid.nearest(grid.codes(weight))), weight)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_every_expert_is_rounded_on_its_grid_near_its_own_weight(
        tiny_checkpoint: Callable[..., Path], text: Path, arch: str) -> None:
    model_dir = tiny_checkpoint(arch, seed=5)
    floats = load_file(str(model_dir / "model.safetensors"))
    result = _calibrate(model_dir, text)
    experts = [name for name in floats if is_expert(name)]
    assert experts and set(experts) <= set(result)
    for name in experts:
        rounded, grid = result[name]
        float_w = floats[name]
        assert _on_grid(rounded, grid), name
        # Measured 0.10-0.20 of the weight's norm (round to nearest: 0.09; compensation
        # moves weights to cancel the errors on the routed rows, the attention's by as
        # much); another projection of the same shape (a random one) lies 1.4 norms away.
        assert (rounded - float_w).norm() < 0.3 * float_w.norm(), name


def _experts_only(float_dir: Path, quant_dir: Path, out: Path) -> Any:
    """transformers' float64 model of ``float_dir`` with only its experts' weights taken,
    dequantized, from ``quant_dir``."""
    quantization = CheckpointQuantization.from_config(FORMAT.quantization_config())
    tensors = load_file(str(quant_dir / "model.safetensors"))
    weights = load_file(str(float_dir / "model.safetensors"))
    for name in weights:
        if is_expert(name):
            layer = name.removesuffix(".weight")
            own = {key.rpartition(".")[2]: value for key, value in tensors.items()
                   if key.rpartition(".")[0] == layer}
            weights[name] = quantization.build(own).dequantize()
    shutil.copytree(float_dir, out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return reference_model(out)


def test_calibrated_experts_bring_the_logits_closer_than_rounding_to_nearest(
        tiny_checkpoint: Callable[..., Path], text: Path, tmp_path: Path) -> None:
    float_dir = tiny_checkpoint("qwen2_moe", seed=5)
    settings = CalibrationSettings((text,), samples=8, seq_len=48)
    quantize_checkpoint(float_dir, tmp_path / "calibrated", "gptq", group_size=16,
                        act_order=True, calibration=settings)
    quantize_checkpoint(float_dir, tmp_path / "nearest", "gptq", group_size=16,
                        act_order=True)
    from framework.runtime.hf_tokenizer import load_tokenizer

    ids = torch.tensor([load_tokenizer(str(float_dir))(TEXT)["input_ids"][:200]])
    with torch.no_grad():
        expected = reference_model(float_dir)(ids).logits

        def error(name: str) -> float:
            model = _experts_only(float_dir, tmp_path / name, tmp_path / f"{name}_experts")
            return float((model(ids).logits - expected).square().mean())

        # Measured 0.17 of the error (Mixtral's experts: 0.40).
        assert error("calibrated") < 0.4 * error("nearest")


def test_learned_rounding_moves_the_experts_at_most_one_step(
        tiny_checkpoint: Callable[..., Path], text: Path) -> None:
    model_dir = tiny_checkpoint("mixtral", seed=5)
    before = _calibrate(model_dir, text, batch=2)
    # An offset moves by at most 0.02 steps a batch, decaying: 60 batches can carry one
    # past half a step, where its code changes.
    after = _calibrate(model_dir, text, steps=60, batch=2)
    experts = [name for name in before if is_expert(name)]
    moved = 0
    for name in experts:
        (old, grid), (new, _) = before[name], after[name]
        assert _on_grid(new, grid), name
        steps = (grid.codes(new) - grid.codes(old)).abs()
        assert steps.max() <= 1, name
        moved += int(steps.sum())
    assert moved > 0  # the offsets reached the experts through the stacked parameters


def test_stacked_parameters_place_each_expert_s_projection() -> None:
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.randn(3, 8, 5))
    module.down_proj = torch.nn.Parameter(torch.randn(3, 5, 4))
    model = torch.nn.Module()
    model.experts = module
    places = {"e1.up": ExpertPlace("experts", 1, "up"), "e2.down": ExpertPlace("experts", 2,
                                                                                "down")}
    up, down = torch.ones(4, 5), torch.full((5, 4), 2.0)
    params = stacked_parameters(model, {"e1.up": up, "e2.down": down, "norm.weight": up},
                                places)
    assert params["norm.weight"] is up
    gate_up, down_proj = module.gate_up_proj.detach().clone(), module.down_proj.detach().clone()
    gate_up[1, 4:] = up
    down_proj[2] = down
    assert torch.equal(params["experts.gate_up_proj"], gate_up)
    assert torch.equal(params["experts.down_proj"], down_proj)
    assert torch.equal(expert_weight(module, 1, "gate"), module.gate_up_proj[1, :4])
