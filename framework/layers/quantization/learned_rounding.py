"""Learned rounding (``framework quantize --rounding-steps``): after error compensation,
each weight may move to a neighbouring code where that brings the whole quantized model's
next-token distributions closer to the float model's.

Each weight's codes carry an offset in ``[-1, 1]`` code steps; the quantized weight is
``values(nearest(codes + offset * step))``, differentiated as if rounding were the
identity (the straight-through estimator). Signed gradient descent on the KL divergence
from the float model's distributions, over batches of calibration windows, moves every
offset by the same amount per step with a linearly decaying rate: AutoRound's method, run
end to end rather than block by block, since a whole small model fits one backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from framework.layers.quantization.calibration_experts import ExpertPlace, stacked_parameters
from framework.layers.quantization.grid import QuantGrid

#: The first step's move of every offset, in code steps; it decays linearly to zero.
LEARNING_RATE = 0.02


class RoundingOffsets:
    """One weight's codes on its grid and a learnable offset of each, in code steps."""

    def __init__(self, rounded: torch.Tensor, grid: QuantGrid) -> None:
        self.grid = grid
        self.codes = grid.codes(rounded)
        self.step = grid.code_step(self.codes)
        self.offset = torch.zeros_like(self.codes, requires_grad=True)

    def _moved(self) -> torch.Tensor:
        """The codes moved by their offsets, not yet rounded."""
        return self.codes + self.offset * self.step

    def weight(self) -> torch.Tensor:
        """The weight the offsets give, its gradient passed straight through rounding."""
        moved = self._moved()
        return self.grid.values(moved + (self.grid.nearest(moved) - moved).detach())

    def rounded(self) -> torch.Tensor:
        """The weight the offsets give, on the grid."""
        with torch.no_grad():
            return self.grid.values(self.grid.nearest(self._moved()))

    def descend(self, rate: float) -> None:
        """One signed gradient step of ``rate`` code steps, offsets kept within one step."""
        with torch.no_grad():
            assert self.offset.grad is not None
            self.offset.sub_(rate * self.offset.grad.sign()).clamp_(-1.0, 1.0)
            self.offset.grad = None


def divergence(model: torch.nn.Module, weights: dict[str, torch.Tensor],
               ids: torch.Tensor) -> torch.Tensor:
    """The mean per-token KL divergence of ``model`` with ``weights`` (by parameter name)
    in place of its own from ``model`` itself, on token windows ``ids``."""
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.log_softmax(-1)
    quantized = functional_call(model, weights, (ids,), {"use_cache": False})
    return F.kl_div(quantized.logits.log_softmax(-1), reference, log_target=True,
                    reduction="sum") / ids.numel()


def learn_rounding(model: torch.nn.Module,
                   calibrated: dict[str, tuple[torch.Tensor, QuantGrid]],
                   windows: torch.Tensor, steps: int, batch: int, seed: int,
                   places: dict[str, ExpertPlace] | None = None
                   ) -> dict[str, tuple[torch.Tensor, QuantGrid]]:
    """``calibrated``'s weights (by checkpoint name, each on its grid) with their rounding
    learned over ``steps`` batches of ``batch`` of ``windows`` (``[samples, seq_len]``
    token ids), drawn by ``seed``. A name is the float ``model``'s parameter's, but for
    MoE experts' projections, placed in transformers' stacked experts by ``places``.
    ``model``'s own parameters are frozen (``requires_grad`` off): only the offsets
    learn."""
    model.requires_grad_(False)
    offsets = {name: RoundingOffsets(*item) for name, item in calibrated.items()}
    generator = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for step in range(steps):
            # One window at a time: only one window's logits are held for the backward
            # pass; the gradients add up over the batch before the step.
            for index in torch.randint(len(windows), (batch,), generator=generator):
                weights = stacked_parameters(
                    model, {name: item.weight() for name, item in offsets.items()},
                    places or {})
                divergence(model, weights, windows[index:index + 1]).backward()
            for item in offsets.values():
                item.descend(LEARNING_RATE * (1 - step / steps))
    return {name: (item.rounded(), item.grid) for name, item in offsets.items()}
