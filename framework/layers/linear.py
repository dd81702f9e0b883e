"""Linear layers laid out for tensor parallelism.

Each layer holds only its rank's part of the full matrix and knows how to cut
that part out of a checkpoint tensor (``weight_loader``), so that a model loads
the same files at any ``tp_size``:

* ``ColumnParallelLinear`` splits the output features (rows of the weight);
* ``MergedColumnParallelLinear`` is several column-parallel matrices stacked
  (gate and up projections), each split on its own;
* ``QKVParallelLinear`` stacks the query, key and value projections, split by
  heads (key/value heads are replicated when there are fewer than ranks);
* ``RowParallelLinear`` splits the input features (columns of the weight); its
  partial outputs need a sum over ranks.

Parameters are created with the default dtype and device, so a model builds
them under ``torch.device(...)`` and ``default_dtype(...)``. With ``tp_size``
above 1 the layers that need a collective (``RowParallelLinear`` here, the
vocabulary-parallel embedding and head) run only once a tensor-parallel group
is bound to them (``bind_tp_group``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from framework.layers.deferred import materialized
from framework.layers.linear_kernel import linear
from framework.layers.quantization.weights import QuantizedWeight


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in ``dtype`` inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class CheckpointWeight(Protocol):
    """A checkpoint tensor as a weight loader gets it: a ``torch.Tensor``, or a tensor of a
    file read only as far as it is indexed (``weight_loader.SafetensorsSlice``).

    Loaders take their rank's part with ``narrow`` and read a whole tensor with
    ``[...]`` (``read_whole``), so that a rank reads only its share of the file.
    """

    @property
    def shape(self) -> Any:
        """The stored shape."""

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``length`` entries from ``start`` along ``dim`` (read from the file, if it is one)."""

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The entries at ``index``; ``[...]``: every one."""


def read_whole(loaded: CheckpointWeight) -> torch.Tensor:
    """All of ``loaded``, as a tensor (for weights every rank holds whole)."""
    return loaded[...]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, raising ``ValueError`` when it does not divide evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def rank_kv_heads(total_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The first key/value head rank ``tp_rank`` of ``tp_size`` holds, and how many: the
    heads split evenly, or with fewer heads than ranks each head replicated on
    ``tp_size // total_kv_heads`` consecutive ranks.

    Raises:
        ValueError: heads and ranks that do not divide one another.
    """
    if tp_size >= total_kv_heads:
        replicas = divide(tp_size, total_kv_heads, "tp_size / key-value heads")
        return tp_rank // replicas, 1
    count = divide(total_kv_heads, tp_size, "key/value heads")
    return tp_rank * count, count


def check_loaded_shape(param: torch.Tensor, loaded: CheckpointWeight, what: str) -> None:
    """Raise ``ValueError`` unless ``loaded`` has exactly the shape of ``param``."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"expected {tuple(param.shape)}"
        )


def row_amax(loaded: CheckpointWeight, rows_per_read: int = 1024) -> torch.Tensor:
    """Each row's largest magnitude (float32 ``[out]``) of a whole ``[out, in]`` checkpoint
    tensor, read ``rows_per_read`` rows at a time."""
    out = loaded.shape[0]
    return torch.cat([loaded.narrow(0, start, min(rows_per_read, out - start)).float().abs()
                      .amax(dim=1) for start in range(0, out, rows_per_read)])


def default_weight_loader(
    param: torch.Tensor, loaded_weight: CheckpointWeight, shard_id: object = None
) -> None:
    """Copy a whole, unsharded tensor into ``param`` (shapes must match exactly)."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter takes no shard id, got {shard_id!r}")
    check_loaded_shape(param, loaded_weight, "parameter")
    param.data.copy_(read_whole(loaded_weight))


class TensorParallelGroup(Protocol):
    """The collectives a layer needs from its tensor-parallel group."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks."""

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""

    def all_to_all_single(self, x: torch.Tensor, send_counts: list[int],
                          recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sent out (``send_counts[r]`` of them, in order, to rank ``r``);
        returns the rows received (``recv_counts[r]`` from rank ``r``), in rank order."""


def bound_tp_group(layer: nn.Module) -> TensorParallelGroup:
    """The group bound to ``layer``; ``NotImplementedError`` when it has none.

    Without a group, a layer split over ranks cannot compute its forward pass.
    """
    group = getattr(layer, "tp_group", None)
    if group is None:
        raise NotImplementedError(
            f"{type(layer).__name__} with tp_size={getattr(layer, 'tp_size', '?')} needs a "
            "tensor-parallel group: bind one with bind_tp_group"
        )
    return group


def bind_attribute(model: nn.Module, name: str, value: object) -> int:
    """Set ``name`` to ``value`` on every module of ``model`` that declares it; count them."""
    bound = 0
    for module in model.modules():
        if hasattr(module, name):
            setattr(module, name, value)
            bound += 1
    return bound


def bind_tp_group(model: nn.Module, group: TensorParallelGroup) -> int:
    """Give every layer of ``model`` that sums or gathers over ranks ``group``; count them."""
    return bind_attribute(model, "tp_group", group)


class LinearBase(nn.Module):
    """A ``y = x W^T + b`` layer holding this rank's ``[out_local, in_local]`` part of ``W``."""

    #: Built for quantized serving, the weight waits for a float tensor before it is
    #: allocated (framework/layers/deferred.py): quantized parts may replace it.
    deferrable_weights = ("weight",)

    def __init__(
        self,
        local_input_size: int,
        local_output_size: int,
        *,
        bias: bool,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(
            torch.empty(local_output_size, local_input_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local_output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        #: The weight in the linear backend's packed layout (``pack_linear_weights``);
        #: None: products take ``weight`` as it is.
        self.packed_weight: torch.Tensor | None = None
        #: The native CPU kernels when bound (``bind_cpu_layer_ops``): products of a few
        #: rows run their ``linear_rows``.
        self.cpu_ops: Any = None
        #: The quantized weight when the layer is quantized (``--quantization``; see
        #: framework/layers/quantization/linear_method.py), multiplied by ``quant_kernel``.
        self.quant_weight: Any = None
        self.quant_kernel: Any = None
        #: This rank's parts of a pre-quantized checkpoint's weight, by their first local
        #: output row, until they are stacked into ``quant_weight``
        #: (framework/layers/quantization/checkpoint.py).
        self.quant_parts: dict[int, QuantizedWeight] = {}
        #: Rows of the float weight loaded so far, and what is called with the layer once
        #: all are in: online quantization quantizes it then (``quantize_on_load``), so
        #: the float model is never held whole.
        self.float_loaded = 0
        self.when_loaded: Callable[[LinearBase], None] | None = None
        #: Each output row's largest magnitude over every rank's columns, read by a
        #: row-parallel rank loading for online quantization, whose channel scales then
        #: span whole rows, as on one rank; None otherwise.
        self.row_amax: torch.Tensor | None = None

    @property
    def local_shape(self) -> tuple[int, int]:
        """``(out_local, in_local)``: this rank's weight's shape, quantized or float."""
        out_local, in_local = self.weight.shape if self.quant_weight is None \
            else self.quant_weight.shape
        return out_local, in_local

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` with this rank's weight, quantized or float."""
        if self.quant_weight is not None:
            return self.quant_kernel.apply(self.quant_weight, x, bias)
        return linear(x, self.weight, bias, self.packed_weight, self.cpu_ops)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's part of the checkpoint tensor ``loaded_weight`` into ``param``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply this rank's part of the layer to ``x`` of shape ``[..., in_local]``."""
        return self.product(x, self.bias)

    def _load_rows(self, param: torch.Tensor, loaded_weight: CheckpointWeight | QuantizedWeight,
                   *, param_offset: int, rows: int, loaded_start: int, loaded_rows: int,
                   what: str) -> None:
        """``_load_rows`` of a float tensor; a quantized weight's rows are kept in
        ``quant_parts`` instead, to be stacked once all are in."""
        if not isinstance(loaded_weight, QuantizedWeight):
            _load_rows(param, loaded_weight, param_offset=param_offset, rows=rows,
                       loaded_start=loaded_start, loaded_rows=loaded_rows, what=what)
            if param is self.weight:
                self._float_rows_in(rows)
            return
        expected = (loaded_rows, self.weight.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"{what}: quantized checkpoint weight has shape "
                             f"{tuple(loaded_weight.shape)}, expected {expected}")
        self.quant_parts[param_offset] = loaded_weight.narrow_out(loaded_start, rows)

    def _float_rows_in(self, rows: int) -> None:
        """Count ``rows`` of the float weight as loaded; once all are, ``when_loaded``."""
        self.float_loaded += rows
        if self.float_loaded == self.weight.shape[0] and self.when_loaded is not None:
            self.when_loaded(self)

    def extra_repr(self) -> str:
        out_features, in_features = self.local_shape
        return (
            f"in_local={in_features}, out_local={out_features}, bias={self.bias is not None}, "
            f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


def _load_rows(
    param: torch.Tensor,
    loaded_weight: CheckpointWeight,
    *,
    param_offset: int,
    rows: int,
    loaded_start: int,
    loaded_rows: int,
    what: str,
) -> None:
    """Copy ``loaded_weight[loaded_start:+rows]`` into ``param[param_offset:+rows]``.

    ``loaded_weight`` must be the whole checkpoint tensor: ``loaded_rows`` rows
    and the trailing shape of ``param``; only those ``rows`` of it are read.
    """
    expected = (loaded_rows, *param.shape[1:])
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"expected {expected}"
        )
    materialized(param).narrow(0, param_offset, rows).copy_(
        loaded_weight.narrow(0, loaded_start, rows))


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank returns its slice of the output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        local_output = divide(output_size, tp_size, "output features")
        super().__init__(input_size, local_output, bias=bias, tp_rank=tp_rank, tp_size=tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of the full ``[output_size, ...]`` checkpoint tensor."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        rows = param.shape[0]
        self._load_rows(param, loaded_weight, param_offset=0, rows=rows,
                        loaded_start=self.tp_rank * rows, loaded_rows=rows * self.tp_size,
                        what=type(self).__name__)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices stacked along the output (e.g. gate and up).

    Checkpoints hold them separately; ``shard_id`` is the matrix's index in
    ``output_sizes``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.local_output_sizes = [
            divide(size, tp_size, "output features") for size in self.output_sizes
        ]
        super().__init__(
            input_size, sum(self.local_output_sizes), bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of matrix number ``shard_id`` into its place in ``param``."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        rows = self.local_output_sizes[shard_id]
        self._load_rows(param, loaded_weight,
                        param_offset=sum(self.local_output_sizes[:shard_id]), rows=rows,
                        loaded_start=self.tp_rank * rows,
                        loaded_rows=self.output_sizes[shard_id],
                        what=f"{type(self).__name__} shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """Query, key and value projections stacked as ``[q | k | v]`` and split by heads.

    With fewer key/value heads than ranks, each key/value head is replicated on
    ``tp_size // total_num_kv_heads`` consecutive ranks.
    """

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "attention heads")
        self.first_kv_head, self.num_kv_heads = rank_kv_heads(total_num_kv_heads, tp_rank,
                                                              tp_size)
        local_output = (self.num_heads + 2 * self.num_kv_heads) * head_size
        super().__init__(hidden_size, local_output, bias=bias, tp_rank=tp_rank, tp_size=tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's heads of projection ``shard_id`` ("q", "k" or "v") into ``param``."""
        if shard_id not in self.SHARD_IDS:
            raise ValueError(f"shard_id must be one of {self.SHARD_IDS}, got {shard_id!r}")
        q_rows = self.num_heads * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, rows, start = 0, q_rows, self.tp_rank * q_rows
            full_rows = self.total_num_heads * self.head_size
        else:
            offset = q_rows if shard_id == "k" else q_rows + kv_rows
            rows, start = kv_rows, self.first_kv_head * self.head_size
            full_rows = self.total_num_kv_heads * self.head_size
        self._load_rows(param, loaded_weight, param_offset=offset, rows=rows,
                        loaded_start=start, loaded_rows=full_rows,
                        what=f"{type(self).__name__} shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial outputs are summed over ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        local_input = divide(input_size, tp_size, "input features")
        super().__init__(local_input, output_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.tp_group: TensorParallelGroup | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's columns of the weight.

        The bias is whole on every rank: it belongs after the sum over ranks, added once.
        """
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        if param.dim() == 2:
            cols = param.shape[1]
            expected = (param.shape[0], cols * self.tp_size)
            if tuple(loaded_weight.shape) != expected:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint tensor has shape "
                    f"{tuple(loaded_weight.shape)}, expected {expected}"
                )
            if isinstance(loaded_weight, QuantizedWeight):
                self.quant_parts[0] = loaded_weight.narrow_in(self.tp_rank * cols, cols)
                return
            materialized(param).copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))
            if self.when_loaded is not None and self.tp_size > 1:  # quantized as it loads
                self.row_amax = row_amax(loaded_weight)
            self._float_rows_in(param.shape[0])
            return
        check_loaded_shape(param, loaded_weight, type(self).__name__)
        param.data.copy_(read_whole(loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer: this rank's partial product, summed over the ranks."""
        if self.tp_size == 1:
            return self.product(x, self.bias)
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product ``x_local W_local^T``: no bias, not yet summed over ranks.

        A layer that adds to the output before the sum (a LoRA delta of this
        rank's input columns) computes this, adds, then calls ``reduce``.
        """
        return self.product(x, None)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` over the group, plus the bias."""
        out = partial if self.tp_size == 1 else bound_tp_group(self).all_reduce(partial)
        # The bias is added once, after the sum, not once per rank.
        return out if self.bias is None else out + self.bias
