"""Linear layers that add the LoRA deltas of many adapters, one slot per adapter.

``LoraLinear`` wraps one of the model's tensor-parallel linear layers. It holds
every slot's matrices stacked: ``lora_a`` ``[slots, subs * max_rank, in_local]``
and ``lora_b`` ``[slots, out_local, subs * max_rank]``, where ``subs`` is how
many Hugging Face projections the layer fuses that adapters may target (q, k
and v in ``qkv_proj``). Each projection owns its own ``max_rank`` columns of
``lora_b`` and rows of ``lora_a``: ``b`` is block-diagonal, so one kernel call
computes every projection's ``B_i A_i x`` in its own rows of the output.

Sharding follows the base layer, through the base's own ``weight_loader``:

* column kinds (q/k/v, gate/up): ``lora_b``'s rows are cut like the weight's
  (key/value heads replicated when fewer than ranks); ``lora_a`` is whole;
* row kinds (o, down): ``lora_a``'s input columns are cut like the weight's;
  ``lora_b`` is whole, and the delta is added to the rank's partial product
  before the sum over ranks.

``apply_lora`` swaps a model's targeted layers for wrappers and returns a
``LoraModel``, through which the runner sets each forward's ``LoraBatch``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from framework.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from framework.lora.adapter import FUSED_MODULE_OF, LoraAdapter, LoraWeights, ModelLoraSpec
from framework.lora.batch import LoraBatch
from framework.registry import LORA_BACKENDS

LoraKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoraBatch],
                      torch.Tensor]

#: The base layer's shard id of each Hugging Face projection it fuses (``weight_loader``).
SHARD_ID_OF: dict[str, str | int | None] = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1,
    "o_proj": None, "down_proj": None,
}
_BASE_KIND: dict[str, type[LinearBase]] = {
    "qkv_proj": QKVParallelLinear, "gate_up_proj": MergedColumnParallelLinear,
    "o_proj": RowParallelLinear, "down_proj": RowParallelLinear,
}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class LoraState:
    """What the wrappers of one model share: this forward's batch and the kernel."""

    kernel: LoraKernel
    batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """A base linear layer plus the per-slot LoRA delta of the current ``LoraBatch``."""

    def __init__(self, base: LinearBase, state: LoraState, layer: int, modules: tuple[str, ...],
                 max_slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.layer = layer
        #: The Hugging Face projections of ``base`` adapters may target, in column order.
        self.lora_modules = modules
        self.max_rank = max_rank
        #: Whether the layer sees only the batch's output rows (``LoraBatch.output``): the
        #: projections after attention in the model's last layer.
        self.on_output_rows = False
        self.is_row_parallel = isinstance(base, RowParallelLinear)
        out_local, in_local = base.local_shape
        width = len(modules) * max_rank
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.register_buffer("lora_a", torch.zeros(max_slots, width, in_local, **like),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_slots, out_local, width, **like),
                             persistent=False)
        self.register_buffer("lora_scalings", torch.zeros(max_slots, **like), persistent=False)

    def full_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of projection ``module`` before sharding."""
        base = self.base
        out_local, in_local = base.local_shape
        if isinstance(base, RowParallelLinear):
            return in_local * base.tp_size, out_local
        if isinstance(base, QKVParallelLinear):
            heads = base.total_num_heads if module == "q_proj" else base.total_num_kv_heads
            return in_local, heads * base.head_size
        assert isinstance(base, MergedColumnParallelLinear)  # the kinds apply_lora wraps
        shard = SHARD_ID_OF[module]
        assert isinstance(shard, int)  # gate or up
        return in_local, base.output_sizes[shard]

    @torch.no_grad()
    def load_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Write this rank's shards of ``adapter``'s matrices for this layer into ``slot``
        (projections it does not target stay zero)."""
        self.clear_slot(slot)
        for index, module in enumerate(self.lora_modules):
            pair = adapter.weights.get((self.layer, module))
            if pair is not None:
                self._load_projection(slot, index, module, pair)
        self.lora_scalings[slot] = adapter.scaling

    def _load_projection(self, slot: int, index: int, module: str, pair: LoraWeights) -> None:
        columns = slice(index * self.max_rank, (index + 1) * self.max_rank)
        in_features, out_features = self.full_shape(module)
        like = {"dtype": self.lora_a.dtype, "device": self.lora_a.device}
        # Ranks below max_rank are zero-padded, so every slot multiplies alike.
        a = torch.zeros(self.max_rank, in_features, **like)
        a[:pair.a.shape[0]] = pair.a
        b = torch.zeros(out_features, self.max_rank, **like)
        b[:, :pair.b.shape[1]] = pair.b
        a_slice, b_slice = self.lora_a[slot, columns], self.lora_b[slot, :, columns]
        if self.is_row_parallel:
            self.base.weight_loader(a_slice, a, None)  # this rank's input columns
            b_slice.copy_(b)
        else:
            a_slice.copy_(a)
            self.base.weight_loader(b_slice, b, SHARD_ID_OF[module])  # this rank's rows

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        """Zero ``slot``: rows on it get no delta."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_scalings[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus each row's adapter delta."""
        batch = self.state.batch
        if batch is not None and self.on_output_rows and batch.output is not None:
            batch = batch.output
        if batch is None or not batch.seg_lens:
            return self.base(x)
        if batch.row_slots.shape[0] != x.shape[0]:
            raise ValueError(f"the LoRA batch has {batch.row_slots.shape[0]} rows, layer "
                             f"{self.layer} got {x.shape[0]}")
        delta = self.state.kernel(x, self.lora_a, self.lora_b, self.lora_scalings, batch)
        if self.is_row_parallel:
            # The delta of this rank's input columns is partial too: summed with the product.
            return self.base.reduce(self.base.partial(x) + delta)
        return self.base(x) + delta


@dataclass
class LoraModel:
    """A model's LoRA wrappers: what the runner sets each forward's batch through."""

    state: LoraState
    wrappers: dict[tuple[int, str], LoraLinear]
    spec: ModelLoraSpec
    max_slots: int
    #: Where each wrapper sits: its parent module and attribute name.
    places: dict[tuple[int, str], tuple[nn.Module, str]] = field(default_factory=dict)
    layers: list[LoraLinear] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = list(self.wrappers.values())

    def set_batch(self, batch: LoraBatch | None) -> None:
        """Use ``batch``'s slots in the next forward passes (``None``: no adapter).

        Its ``output`` must group the rows the model's last layer keeps, the
        ``output_rows`` the model derives from the ``ForwardBatch``
        (``logits_rows()``, or ``last_token_rows()`` for embeddings).
        """
        self.state.batch = batch

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """The base layers back in place meanwhile, under their own parameter names, for
        the model's ``load_weights`` (``/update_weights_from_disk``)."""
        for key, (parent, child) in self.places.items():
            setattr(parent, child, self.wrappers[key].base)
        try:
            yield
        finally:
            for key, (parent, child) in self.places.items():
                setattr(parent, child, self.wrappers[key])


def apply_lora(model: nn.Module, max_slots: int, max_rank: int, targets: Iterable[str],
               backend: str = "torch") -> LoraModel:
    """Swap, in place, every decoder-layer linear of ``model`` that fuses one of
    ``targets`` (Hugging Face names: ``q_proj``, ``gate_proj``, ...) for a ``LoraLinear``.

    Load the base weights first: the wrapped parameters are renamed under ``.base``.

    Raises:
        ValueError: an unknown target, or a non-positive slot count or rank.
    """
    targets = set(targets)
    unknown = targets - set(FUSED_MODULE_OF)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; "
                         f"known: {', '.join(FUSED_MODULE_OF)}")
    if max_slots < 1 or max_rank < 1:
        raise ValueError(f"max_slots and max_rank must be positive, got {max_slots}, {max_rank}")
    state = LoraState(kernel=LORA_BACKENDS.get(backend))
    wrappers: dict[tuple[int, str], LoraLinear] = {}
    places: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    output_layer = _output_rows_layer(model)
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        found = _LAYER_INDEX.search(name)
        modules = tuple(m for m, fused in FUSED_MODULE_OF.items()
                        if fused == child and m in targets)
        if not modules or found is None or not isinstance(module, _BASE_KIND[child]):
            continue
        layer = int(found.group(1))
        wrapper = LoraLinear(module, state, layer, modules, max_slots, max_rank)
        wrapper.on_output_rows = layer == output_layer and child != "qkv_proj"
        parent = model.get_submodule(parent_name)
        setattr(parent, child, wrapper)
        wrappers[(layer, child)] = wrapper
        places[(layer, child)] = (parent, child)
    return LoraModel(state, wrappers, _spec_of(model, wrappers, max_rank), max_slots, places)


def _output_rows_layer(model: nn.Module) -> int | None:
    """The decoder layer that keeps only the output rows after its attention: the last
    layer of the decoder stack (``LlamaModel``), on the pipeline's last stage."""
    for module in model.modules():
        if getattr(module, "is_last_stage", False) and hasattr(module, "end_layer"):
            return int(module.end_layer) - 1
    return None


def _spec_of(model: nn.Module, wrappers: dict[tuple[int, str], LoraLinear],
             max_rank: int) -> ModelLoraSpec:
    shapes = {module: wrapper.full_shape(module)
              for wrapper in wrappers.values() for module in wrapper.lora_modules}
    config = getattr(model, "config", None)
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        num_layers = 1 + max((layer for layer, _ in wrappers), default=-1)
    return ModelLoraSpec(num_layers=num_layers, shapes=shapes, max_rank=max_rank)
