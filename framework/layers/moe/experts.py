"""A Mixture-of-Experts layer's experts, held as two stacked weights.

``w13 [E, 2I, H]`` holds each expert's gate and up projections (gate rows first),
``w2 [E, H, I]`` its down projection. Under tensor parallelism (``tp_size``) each
rank holds every expert's slice of the intermediate size, and the outputs are
partial sums over ranks (``output_is_partial``: the caller sums them over the
group); under expert parallelism (``ep_size``, equal to ``tp_size``) each rank holds
whole experts, its share of them (``expert_range``), and the layer exchanges the
tokens with the other ranks of its group (``expert_parallel``), its output complete
on every rank. Each expert's checkpoint tensors (``experts.{e}.gate_proj``,
Mixtral's ``w1``/``w3``/``w2``; the models cut transformers' stacked tensors into
them) load into them; a rank reads only its slices. A pre-quantized checkpoint's experts
load as ``QuantizedWeight``s instead, this rank's parts of them kept until they are
stacked (``quantized_experts.py``), after which the layer multiplies through the
quantized-linear kernel and its float weights are empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.layers.activation import GatedActivation
from framework.layers.deferred import deferred, materialized
from framework.layers.linear import (
    CheckpointWeight,
    TensorParallelGroup,
    bound_tp_group,
    divide,
    row_amax,
)
from framework.layers.linear_kernel import pack_weight
from framework.layers.moe.expert_parallel import LocalExperts, expert_parallel_moe
from framework.layers.moe.torch_moe import run_experts
from framework.layers.quantization.weights import QuantizedWeight
from framework.registry import MOE_BACKENDS

if TYPE_CHECKING:
    from framework.layers.moe.quantized_experts import QuantizedExperts

#: Shard ids of the per-expert tensors: which part of the stacked weights each fills.
GATE, UP, DOWN = "gate", "up", "down"
#: An expert's projections.
PROJECTIONS = (GATE, UP, DOWN)
#: Each expert projection's name in a checkpoint (Qwen's, then Mixtral's) and its part.
EXPERT_PARTS = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN,
                "w1": GATE, "w3": UP, "w2": DOWN}
# A per-expert checkpoint tensor: ``<prefix>.experts.<expert>.<projection>.weight``.
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


@dataclass(frozen=True)
class ExpertWeightName:
    """What a per-expert checkpoint tensor's name says: the experts' prefix
    (``model.layers.0.mlp.experts``), the expert and the part (``GATE | UP | DOWN``)."""

    prefix: str
    expert: int
    part: str


def expert_weight_name(name: str) -> ExpertWeightName | None:
    """The expert and part checkpoint tensor ``name`` holds, or None for any other tensor."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match["proj"] not in EXPERT_PARTS:
        return None
    return ExpertWeightName(match["prefix"], int(match["expert"]), EXPERT_PARTS[match["proj"]])


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """The experts ``[start, end)`` that rank ``ep_rank`` of ``ep_size`` holds."""
    per_rank = divide(num_experts, ep_size, "experts")
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def pack_expert_weights(modules: list[FusedMoE]) -> None:
    """Pack (again) every expert's weights of ``modules`` for oneDNN (after every load, as
    ``pack_linear_weights`` does for the linear layers)."""
    for module in modules:
        if module.quant_experts is not None:  # multiplied by the quantized kernel
            continue
        module.packed = ([pack_weight(w) for w in module.w13], [pack_weight(w) for w in module.w2])


class FusedMoE(nn.Module):
    """The experts of one MoE layer; ``forward(x, weights, ids)`` applies them.

    With ``ep_size`` above 1 the layer needs its tensor-parallel group (``bind_tp_group``),
    whose ranks are the expert-parallel ones: rank ``ep_rank`` of it holds
    ``expert_range(num_experts, ep_rank, ep_size)``.
    """

    #: Built for quantized serving, the experts' weights wait for float tensors before they
    #: are allocated (framework/layers/deferred.py): quantized parts may replace them.
    deferrable_weights = ("w13", "w2")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", tp_rank: int = 0, tp_size: int = 1,
                 ep_rank: int = 0, ep_size: int = 1, backend: str = "cpu") -> None:
        super().__init__()
        if ep_size > 1 and tp_size > 1 and (ep_size != tp_size or ep_rank != tp_rank):
            # The experts' ranks are those of the tensor-parallel group, in its order.
            raise ValueError(f"expert parallelism needs ep_size ({ep_size}) and ep_rank "
                             f"({ep_rank}) equal to tp_size ({tp_size}) and tp_rank "
                             f"({tp_rank})")
        self.num_experts = num_experts
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.first_expert, end = expert_range(num_experts, ep_rank, ep_size)
        # Expert parallelism replaces the tensor split: each rank holds whole experts.
        self.split = 1 if ep_size > 1 else tp_size
        self.split_rank = 0 if ep_size > 1 else tp_rank
        self.intermediate = divide(intermediate_size, self.split, "moe intermediate size")
        local = end - self.first_expert
        self.num_local, self.hidden_size = local, hidden_size
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, self.intermediate),
                               requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.act = GatedActivation(activation)
        #: The MoE kernel (a ``MOE_BACKENDS`` entry; ``--moe-backend`` rebinds it): the
        #: ``cpu`` one hands blocks off a CPU to the torch reference.
        self.moe_kernel = MOE_BACKENDS.get(backend)
        #: Each expert's ``w13`` and ``w2`` in the linear backend's packed layout (oneDNN's,
        #: ``pack_expert_weights``), or None: the kernels multiply the weights as they are.
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.tp_group: TensorParallelGroup | None = None
        #: This rank's parts of a pre-quantized checkpoint's experts, by (local expert,
        #: ``GATE | UP | DOWN``), until they are stacked into ``quant_experts``.
        self.quant_parts: dict[tuple[int, str], QuantizedWeight] = {}
        #: The experts when held quantized (``hold_quantized``), else None.
        self.quant_experts: QuantizedExperts | None = None
        #: Float projections (an expert's gate, up or down) loaded so far, and what is
        #: called with the layer once all are in (online quantization: ``quantize_on_load``).
        self.float_loaded = 0
        self.when_loaded: Callable[[FusedMoE], None] | None = None
        #: By local expert, each row's largest magnitude of its whole down projection, read
        #: under tensor parallelism for online quantization (``LinearBase.row_amax``).
        self.down_row_amax: dict[int, torch.Tensor] = {}

    @property
    def output_is_partial(self) -> bool:
        """Whether ``forward``'s output is this rank's part of a sum over the tensor-parallel
        group (the caller all-reduces it): under tensor parallelism, not expert parallelism."""
        return self.split > 1

    def holds(self, expert: int) -> bool:
        """Whether this rank holds expert ``expert``."""
        return self.first_expert <= expert < self.first_expert + self.num_local

    def hold_quantized(self, experts: QuantizedExperts) -> None:
        """Multiply by ``experts`` from now on and free the float weights (kept empty, of
        the same dtype and device, so code reading them still works)."""
        self.quant_experts = experts
        self.packed = None
        for param in (self.w13, self.w2):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def hold_float(self) -> None:
        """Drop the quantized experts and give the float weights their shapes again,
        deferred (allocated as a float checkpoint loads into them)."""
        self.quant_experts = None
        shapes = ((self.num_local, 2 * self.intermediate, self.hidden_size),
                  (self.num_local, self.hidden_size, self.intermediate))
        for param, shape in zip((self.w13, self.w2), shapes, strict=True):
            param.data = deferred(shape, param.dtype, param.device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[n, H]``: the tokens' weighted expert outputs (``weights``, ``ids``: ``[n, k]``).

        Under tensor parallelism, over this rank's slice of every expert (a partial sum,
        ``output_is_partial``); under expert parallelism, complete: the tokens go to the
        ranks holding their experts and come back (``x`` must be the same on every rank).
        """
        if self.ep_size == 1:
            return self.local_experts(x, weights, ids)
        return expert_parallel_moe(x, weights, ids, LocalExperts(self.num_local,
                                                                 self.local_experts),
                                   bound_tp_group(self), self.ep_rank, self.ep_size)

    def local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                      ) -> torch.Tensor:
        """``[n, H]``: the weighted outputs of the experts this rank holds (choices of
        others add nothing), through the MoE kernel, or the quantized-linear kernel when
        the experts are quantized."""
        if self.quant_experts is not None:
            return run_experts(x, weights, ids, self.first_expert, self.num_local,
                               self.quant_experts.mlp(self.act))
        return self.moe_kernel(x, self.w13, self.w2, weights, ids, self.act,
                               self.first_expert, packed=self.packed)

    # ------------------------------------------------------------------ loading

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointWeight,
                      shard_id: tuple[int, str]) -> None:
        """Copy this rank's part of one expert's projection: ``shard_id`` is
        ``(expert, GATE | UP | DOWN)``, ``loaded`` its ``[I, H]`` or ``[H, I]`` matrix
        (a ``QuantizedWeight``: its part is kept in ``quant_parts``). An expert another
        rank holds is skipped unread."""
        expert, part = shard_id
        if self.holds(expert):
            self._load_one(param, loaded, expert, part)

    def _load_one(self, param: nn.Parameter, loaded: Any, expert: int, part: str) -> None:
        """One expert's gate, up or down projection, this rank's slice of it."""
        local = expert - self.first_expert
        size, hidden = self.intermediate, self.hidden_size
        start = self.split_rank * size
        quantized = isinstance(loaded, QuantizedWeight)
        if part == DOWN:
            _check(loaded, (hidden, size * self.split), f"expert {expert} down projection")
            if quantized:
                self.quant_parts[local, part] = loaded.narrow_in(start, size)
                return
            materialized(param)[local].copy_(loaded.narrow(1, start, size))
            if self.when_loaded is not None and self.split > 1:  # quantized as it loads
                self.down_row_amax[local] = row_amax(loaded)
        else:
            _check(loaded, (size * self.split, hidden), f"expert {expert} {part} projection")
            if quantized:
                self.quant_parts[local, part] = loaded.narrow_out(start, size)
                return
            offset = 0 if part == GATE else size
            materialized(param)[local, offset:offset + size].copy_(loaded.narrow(0, start, size))
        self.float_loaded += 1
        if self.float_loaded == self.num_local * len(PROJECTIONS) \
                and self.when_loaded is not None:
            self.when_loaded(self)


def _check(loaded: Any, expected: tuple[int, int], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {expected}")
