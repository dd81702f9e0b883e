"""Quantized-linear kernels for a CPU, keeping the weights in their quantized bytes.

``prepare`` repacks a loaded weight once; ``apply`` multiplies by it. A product of up to
``NATIVE_ROWS`` rows (``NATIVE_INT8_ROWS`` for int8, ``INT4_CODES_NATIVE_ROWS`` for 4-bit
codes multiplied in integers: a decode step, a short prefill) runs the native kernels
(``int8_rows_a16``, ``int4_rows_a16``, ``fp8_rows`` in
``framework/layers/attention/csrc/quant_rows.cpp``), which read the weight in its quantized
bytes and widen it in registers; 4-bit codes (in groups of a multiple of 32 features) and
int8 ones multiply ``x`` rounded to int16 per group (int8: per block of up to 128
features) in integers, at 1.5x (4-bit) and 1.5-1.8x (int8) the rate of widening them to
float32, the rounding 2^-16 of a group's largest ``|x|`` (4-bit groups of 16 take
``int4_rows`` on float32). A product of a few rows is bound by reading the weight, so
it takes about the time of reading a quarter (8-bit) or an eighth (4-bit) of the float32
bytes: on a 2-core AVX2 core, one row by a 4096 x 1024 weight took 0.4x (int8) and 0.2x
(4-bit) a float32 ``F.linear``'s time. With more rows (or no C++ compiler) each call widens
the weight to float32 a block of output rows at a time (at most ``UPCAST_ELEMENTS``
elements, so a large head never needs its whole float32 copy) and runs ``F.linear`` on the
blocks: int8 then takes 1.0-1.3x a float32 product's time at 64 rows, 4-bit and FP8
1.4-2.3x; at one row 2.5-4.5x and 5-14x, which is why few rows go to the native kernels.

torch's packed weight-only kernels (``torch._weight_int8pack_mm``,
``torch._weight_int4pack_mm_for_cpu``) run only when asked for (``packed_ops``): with torch
2.13 they measured 10-25x (one row) and 30-150x (64 rows) slower than a float32
``F.linear`` of the same shape, on an AVX2 core and on an AVX-512 one alike.

FP8 has no packed kernel in torch, and its FP8 → float cast on a CPU is scalar, 20-50x slower
than a float32 product; widened here instead: an E4M3 byte placed in
the bits of a float16 (sign to bit 15, the rest from bit 7) is the same number times
2^-8, and float16 → float32 is one vector instruction, so the weight is widened in a few
integer passes and the 2^8 goes into the channel scales. E4M3's NaN encodings (which a
checkpoint does not hold) would read as ±480.

Block-wise FP8 keeps its bytes as they are, with each row's scale per block of input
features: ``fp8_rows`` takes those as groups (the scale applied to each group's sum, as
for 4-bit groups) where the blocks split the input features evenly into multiples of 16.

4-bit weights with act-order (GPTQ ``desc_act``) have their input rows sorted by group
once at ``prepare`` (groups then contiguous) and each call reorders ``x``'s columns the
same way. A tensor-parallel rank's input rows of such a weight hold unequal shares of the
groups: each group's rows are then padded to the largest share (rounded up to the
native kernels' multiple) with rows that read a zero column appended to ``x``, so the
groups are equal runs again and every product stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from framework.layers.attention.native_build import load_cpu_kernels
from framework.layers.linear_kernel import BFLOAT16_GEMM_IS_NATIVE
from framework.layers.quantization.awq import AwqWeight
from framework.layers.quantization.fp8 import Fp8BlockWeight, Fp8Weight
from framework.layers.quantization.gptq import GptqWeight, padded_groups
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.torch_kernels import SUPPORTED_FORMATS, check_format
from framework.layers.quantization.weights import QuantizedWeight

#: The most rows of ``x`` a product by a 4-bit or FP8 weight hands to the native kernels:
#: past these, widening the weight by blocks for ``F.linear``'s GEMM costs less than the
#: kernels' simpler products (2048 x 1024, AVX-512 core: 4-bit 3.6 against 4.2 ms at 32
#: rows, 13.5 against 6.8 at 64).
NATIVE_ROWS = 32
#: The same for int8 weights, which the ``cpu`` kernel multiplies in integers on int16
#: activations (``int8_rows_a16``): ahead of widening at every count measured, to 256
#: rows (one Zen 4 thread: 2048 x 1024, 0.32 against 0.92 ms at 8 rows, 1.9 against 5.0
#: at 64, 10.8 against 15.5 at 256; 5632 x 1024, 22.2 against 53.1 at 256).
NATIVE_INT8_ROWS = 256
#: The most rows of an int8 product ``cpu_a8`` hands to ``int8_rows_a8``: past them torch's
#: int8 GEMM runs them (``int8_activation_product``: 64 rows of 2048 x 1024 in 1.3 ms on a
#: Zen 4 thread, where the kernel takes 4.3).
A8_INT8_ROWS = 8
#: The same for 4-bit weights in groups of a multiple of 32 features, which the kernels
#: multiply in integers (``int4_rows_a16``, ``int4_rows_a8``): their cost grows with the
#: rows as a GEMM's does, so they stay ahead of widening further (one Zen 4 thread, 64
#: rows: 2048 x 1024 in groups of 128, 3.2 and 2.6 ms against 4.8 widened; 1024 x 2816,
#: 5.5 and 3.9 against 7.5; 5632 x 1024 in groups of 32, 14.4 and 14.9 against 15.6).
INT4_CODES_NATIVE_ROWS = 64
#: The same for groups of at least ``INT4_LARGE_GROUP`` features, whose per-group float
#: work is less: ahead of widening to 256 rows (int4_rows_a16, one Zen 4 thread, groups of
#: 128: 2048 x 1024, 12.6 against 16.5 ms at 256 rows; 1024 x 2816, 13.2 against 19.4;
#: groups of 32 fall behind from 128 rows, 25.5 against 22.4 on 5632 x 1024).
INT4_LARGE_GROUP_NATIVE_ROWS = 256
INT4_LARGE_GROUP = 128
#: The most rows of an FP8 product (one scale per channel) the ``cpu_a8`` kernel hands to
#: ``fp8_rows`` where the CPU multiplies bfloat16 at full speed: past them torch's
#: bfloat16 GEMM on the widened codes is faster (one Zen 4 thread, 9 to 64 rows: 2048 x
#: 1024, 0.8 against 0.9 ms at 8 rows, 1.7 against 5.1 at 64).
BFLOAT16_FP8_NATIVE_ROWS = 8
#: The native kernels take input features (and 4-bit groups) in multiples of this.
NATIVE_K_MULTIPLE = 16
#: ``int4_rows_a16`` and ``int4_rows_a8`` take 4-bit groups in multiples of this (others
#: take ``int4_rows``, on float32 activations).
INT4_CODES_GROUP_MULTIPLE = 32
#: The blocks of input features an int8 weight's activations are rounded by (a scale per
#: row and block), largest first: the first that divides the input features
#: (``int8_rows_a8`` and ``int8_activation_product`` alike).
INT8_ACTIVATION_BLOCKS = (128, 64, 32, 16)
#: The largest activation code of ``cpu_a8``'s int8 rounding.
INT8_ACTIVATION_LEVELS = 127
#: Most weight elements widened to float32 at once (16 MiB).
UPCAST_ELEMENTS = 1 << 22
#: Group sizes ``_weight_int4pack_mm_for_cpu`` takes, largest first.
INT4PACK_GROUP_SIZES = (256, 128, 64, 32)
#: ``_convert_weight_to_int4pack_for_cpu`` needs the output features in multiples of this.
INT4PACK_OUT_MULTIPLE = 16
#: float16 bits of an E4M3 byte read as ``2^-8`` times its value: 2^8 restores it.
FP8_VIA_HALF_FACTOR = 256.0
#: ``x << 7`` of a sign-extended byte sets bits 15 and 14 for a negative one; this keeps
#: bit 15 (the sign) and clears bit 14 (int16 -16385 is 0xBFFF).
_CLEAR_BIT_14 = -16385


@dataclass
class CpuInt4Weight(QuantizedWeight):
    """A 4-bit weight repacked for this CPU, its input rows sorted by group.

    Packed for torch's kernel: ``packed`` and ``scales_and_zeros`` ``[in/gs, out, 2]`` with
    ``w = (q - 8) * scale + zero`` (``zero = (8 - zero point) * scale``). Otherwise
    ``nibbles`` uint8 ``[out, in/2]`` (even input rows in the low nibble), ``scales`` and
    ``zero_scales`` (``zero point * scale``) ``[out, groups]``. ``perm`` (when there)
    is the input row at each sorted position.
    """

    format: ClassVar[str] = "cpu_int4"

    @property
    def pad_column(self) -> bool:
        """Whether ``perm`` holds padding rows, which read a zero column past ``x``'s
        (``_sorted_input``)."""
        return self.sorted_features > self.in_features

    @property
    def sorted_features(self) -> int:
        """Input rows in sorted order: ``in_features``, and any padding rows."""
        perm = self.tensors.get("perm")
        return self.in_features if perm is None else len(perm)

    def sorted_matrix(self, rows: slice) -> torch.Tensor:
        """Float32 rows ``rows`` of the nibble-held matrix, its input rows in sorted order."""
        nibbles = self.tensors["nibbles"][rows]
        q = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).view(
            nibbles.shape[0], -1, self.group_size).float()
        scales, zero_scales = self.tensors["scales"][rows], self.tensors["zero_scales"][rows]
        q.mul_(scales[..., None]).sub_(zero_scales[..., None])
        return q.view(nibbles.shape[0], self.sorted_features)

    def packed_matrix(self) -> torch.Tensor:
        """The float32 matrix held in torch's int4 layout, its input rows in sorted order.

        That layout is torch's own, so it is read back through torch's kernel: unit rows
        ``x = e_i`` give column ``i``, a block of inputs at a time.
        """
        features = self.sorted_features
        block = max(1, UPCAST_ELEMENTS // features)
        columns = []
        for start in range(0, features, block):
            count = min(block, features - start)
            unit = torch.zeros(count, features)
            unit[torch.arange(count), torch.arange(start, start + count)] = 1
            columns.append(torch._weight_int4pack_mm_for_cpu(
                unit, self.tensors["packed"], self.group_size, self.tensors["scales_and_zeros"]))
        return torch.cat(columns).t()

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[out, in]`` in the original input order."""
        if "packed" in self.tensors:
            sorted_matrix = self.packed_matrix()
        else:
            sorted_matrix = self.sorted_matrix(slice(None))
        perm = self.tensors.get("perm")
        if perm is None:
            return sorted_matrix
        matrix = sorted_matrix.new_empty(self.out_features, self.in_features + self.pad_column)
        matrix[:, perm] = sorted_matrix
        return matrix[:, :self.in_features]


def _sorted_input(weight: CpuInt4Weight, x: torch.Tensor) -> torch.Tensor:
    """``x``'s columns in the weight's sorted input order (padding rows read zeros)."""
    perm = weight.tensors.get("perm")
    if perm is None:
        return x
    if weight.pad_column:
        x = F.pad(x, (0, 1))
    return x.index_select(1, perm)


@dataclass
class CpuFp8Weight(QuantizedWeight):
    """E4M3 bytes ``bits`` (int8 view, no copy) and float32 ``scale`` (times 2^8): ``[out]``,
    or for block-wise FP8 ``[out, ceil(in / group_size)]``, each row's scale in each block
    of ``group_size`` input features."""

    format: ClassVar[str] = "cpu_fp8"

    def rows_unscaled(self, rows: slice) -> torch.Tensor:
        """Float32 rows ``rows`` of the weight without their scales."""
        widened = self.tensors["bits"][rows].to(torch.int16)
        return ((widened << 7) & _CLEAR_BIT_14).view(torch.float16).float()

    def rows(self, rows: slice) -> torch.Tensor:
        """Float32 rows ``rows`` of the weight, scaled."""
        scale, unscaled = self.tensors["scale"][rows], self.rows_unscaled(rows)
        if self.group_size == -1:
            return unscaled * scale[:, None]
        count, group = unscaled.shape[0], self.group_size
        if self.in_features % group == 0:  # each block's scale broadcast, not repeated
            return (unscaled.view(count, -1, group) * scale[:, :, None]).view(count, -1)
        return unscaled * scale.repeat_interleave(group, 1)[:, :self.in_features]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[out, in]``."""
        return self.rows(slice(None))


def _prepare_fp8(weight: Fp8Weight | Fp8BlockWeight) -> CpuFp8Weight:
    """An FP8 weight's bytes as they are, with its scales per row (and block) times 2^8."""
    bits = weight.tensors["weight"].view(torch.int8)
    if isinstance(weight, Fp8Weight):
        scale = (weight.channel_scales() * FP8_VIA_HALF_FACTOR).contiguous()
        return CpuFp8Weight({"bits": bits, "scale": scale}, weight.shape)
    scale = (weight.row_scales() * FP8_VIA_HALF_FACTOR).contiguous()
    return CpuFp8Weight({"bits": bits, "scale": scale}, weight.shape, weight.block[1])


@dataclass
class _SortedInt4:
    """A 4-bit weight's codes with their input rows sorted by group (``q [out, K]``),
    zero points and scales ``[groups, out]``, the input row at each sorted position
    (``perm``, None: in order; ``in_features``: a padding row) and the rows per group."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None
    size: int


def _sorted_int4(weight: GptqWeight | AwqWeight) -> _SortedInt4:
    """``weight``'s codes sorted by group; groups of unequal shares (a rank's input rows
    of an act-order weight) padded to equal runs (``_padded_groups``)."""
    q = weight.int_weight().t()
    groups = weight.tensors["scales"].shape[0]
    size = weight.in_features // groups
    zeros, scales = weight.zeros().float(), weight.tensors["scales"].float()
    if isinstance(weight, AwqWeight):
        return _SortedInt4(q, zeros, scales, None, size)
    g_idx = weight.tensors["g_idx"].long()
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(weight.in_features) // size):
        return _padded_groups(q, g_idx, zeros, scales, weight.group_size)
    if torch.equal(perm, torch.arange(weight.in_features)):
        return _SortedInt4(q, zeros, scales, None, size)
    return _SortedInt4(q[:, perm], zeros, scales, perm, size)


def _padded_groups(q: torch.Tensor, g_idx: torch.Tensor, zeros: torch.Tensor,
                   scales: torch.Tensor, group_size: int) -> _SortedInt4:
    """``padded_groups``' layout, its runs a multiple of the native kernels' (of their
    integer-activation one where the checkpoint's groups are a multiple of it)."""
    multiple = INT4_CODES_GROUP_MULTIPLE if group_size % INT4_CODES_GROUP_MULTIPLE == 0 \
        else NATIVE_K_MULTIPLE
    perm, held, size = padded_groups(g_idx, scales.shape[0], multiple)
    padded_q = torch.cat([q, q.new_zeros(q.shape[0], 1)], dim=1)[:, perm]
    return _SortedInt4(padded_q, zeros[held], scales[held], perm, size)


def _int4pack_group(size: int, out_features: int) -> int | None:
    """The group size torch's int4 kernel can run this weight with, if any."""
    if out_features % INT4PACK_OUT_MULTIPLE:
        return None
    return next((g for g in INT4PACK_GROUP_SIZES if size % g == 0), None)


def _prepare_int4(weight: GptqWeight | AwqWeight, packed_ops: bool) -> CpuInt4Weight:
    """Repack GPTQ or AWQ into torch's int4 layout, or into nibbles for widening."""
    sorted_weight = _sorted_int4(weight)
    q, zeros, scales, perm, size = (sorted_weight.q, sorted_weight.zeros, sorted_weight.scales,
                                    sorted_weight.perm, sorted_weight.size)
    tensors = {} if perm is None else {"perm": perm}
    kernel_group = _int4pack_group(size, weight.out_features) if packed_ops else None
    if kernel_group is not None:
        repeat = size // kernel_group
        kernel_zeros = ((8 - zeros) * scales).repeat_interleave(repeat, 0)
        tensors["scales_and_zeros"] = torch.stack(
            [scales.repeat_interleave(repeat, 0), kernel_zeros], dim=-1).contiguous()
        tensors["packed"] = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return CpuInt4Weight(tensors, weight.shape, kernel_group)
    tensors["nibbles"] = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
    tensors["scales"] = scales.t().contiguous()
    tensors["zero_scales"] = (zeros * scales).t().contiguous()
    return CpuInt4Weight(tensors, weight.shape, size)


def _blocked_linear(x: torch.Tensor, weight: QuantizedWeight,
                    rows_of: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """``x @ w.T`` with ``w`` widened by ``rows_of`` a block of output rows at a time."""
    out_features = weight.out_features
    block = max(1, UPCAST_ELEMENTS // weight.in_features)
    if out_features <= block:
        return F.linear(x, rows_of(slice(None)))
    return torch.cat([F.linear(x, rows_of(slice(start, start + block)))
                      for start in range(0, out_features, block)], dim=1)


def int8_activation_product(x: torch.Tensor, qweight: torch.Tensor,
                            scale: torch.Tensor) -> torch.Tensor | None:
    """``x`` ``[n, in]`` rounded to int8 per row and block of ``INT8_ACTIVATION_BLOCKS``
    (the block's largest ``|x|`` at 127), times an int8 weight ``[out, in]`` with a
    ``scale`` per output channel, the products summed in integers (``torch._int_mm``:
    oneDNN's int8 GEMM, VNNI where the core has it) block by block; None where no block
    divides the input features.

    The rounding is ``int8_rows_a8``'s, so products of any number of rows agree; past
    the native kernels' rows this runs at about twice the rate of a float32 GEMM on a
    packed weight (2048 x 1024, 64 and 128 rows, one Zen 4 core), where widening the
    weight to float32 runs at 0.7-0.9x.
    """
    block = next((b for b in INT8_ACTIVATION_BLOCKS if x.shape[1] % b == 0), None)
    if block is None:
        return None
    blocks = x.view(len(x), -1, block)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, INT8_ACTIVATION_LEVELS / largest, 0.0)
    codes = torch.round(blocks * inverse).to(torch.int8)
    steps = largest / INT8_ACTIVATION_LEVELS  # [n, blocks, 1]
    y = torch.zeros(len(x), qweight.shape[0], dtype=torch.float32)
    for index in range(blocks.shape[1]):
        columns = slice(index * block, (index + 1) * block)
        product = torch._int_mm(codes[:, index], qweight[:, columns].t())
        y.addcmul_(product.float(), steps[:, index])
    return y.mul_(scale)


def bfloat16_fp8_product(x: torch.Tensor, weight: CpuFp8Weight,
                         widen: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` ``[n, in]`` rounded to bfloat16 times an FP8 weight with a scale per channel,
    in torch's bfloat16 GEMM: the codes widened to bfloat16 (``widen``: the native
    ``fp8_bfloat16``, exact: an E4M3 value has 4 significant bits) a block of output rows
    at a time; each output summed in float32 by the GEMM, rounded to bfloat16 and then
    multiplied by its channel's scale in float32.

    Where the CPU multiplies bfloat16 natively this runs at about twice a float32 GEMM's
    rate on a packed weight; rounding ``x`` and the outputs each moves an output by at
    most 2^-9 of its magnitude (for ``x``: of the sum of its terms' magnitudes).
    """
    bits = weight.tensors["bits"]
    y = _blocked_linear(x.to(torch.bfloat16), weight, lambda rows: widen(bits[rows]))
    return y.float().mul_(weight.tensors["scale"])


class CpuQuantLinear:
    """Weight-only quantized products on a CPU (see the module's notes): float32
    activations, rounded to int16 next to int8 and 4-bit codes."""

    #: Whether 4-bit and int8 products of a few rows round ``x`` to int8
    #: (``CpuInt8ActivationLinear``).
    int8_activations: ClassVar[bool] = False

    def __init__(self, packed_ops: bool = False, native: bool = True) -> None:
        """``packed_ops``: use torch's packed int8/int4 kernels (slower here: module notes);
        ``native``: run products of a few rows on the native kernels where they build."""
        self.packed_ops = packed_ops
        self.ops = load_cpu_kernels() if native else None

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        """Repack a loaded GPTQ, AWQ, FP8 or int8 weight for ``apply``."""
        check_format("cpu", weight, SUPPORTED_FORMATS)
        if isinstance(weight, GptqWeight | AwqWeight):
            return _prepare_int4(weight, self.packed_ops)
        if isinstance(weight, Fp8Weight | Fp8BlockWeight):
            return _prepare_fp8(weight)
        tensors = dict(weight.tensors, scale=weight.tensors["scale"].float().contiguous())
        return Int8Weight(tensors, weight.shape)

    def apply(self, weight: QuantizedWeight, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """Multiply ``x`` ``[n, in]`` by a prepared weight: ``[n, out]`` in ``x``'s dtype.

        Raises:
            ValueError: a weight that did not come from ``prepare``.
        """
        x32 = x.float().contiguous()
        y = self._apply_native(weight, x32)
        if y is None:
            y = self._apply_torch(weight, x32)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def _apply_torch(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` by torch's packed kernels or on float32 blocks of the weight."""
        if isinstance(weight, CpuInt4Weight):
            return self._apply_int4(weight, x)
        if isinstance(weight, CpuFp8Weight) and weight.group_size == -1:
            return _blocked_linear(x, weight, weight.rows_unscaled) * weight.tensors["scale"]
        if isinstance(weight, CpuFp8Weight):
            return _blocked_linear(x, weight, weight.rows)
        if isinstance(weight, Int8Weight):
            return self._apply_int8(weight, x)
        raise ValueError(f"the cpu quantized-linear kernel multiplies weights from its "
                         f"prepare(), not {weight.format!r} ones")

    def native_row_limit(self, weight: QuantizedWeight) -> int:
        """The most rows of ``x`` a product by a prepared ``weight`` hands to the native
        kernels."""
        if isinstance(weight, Int8Weight):
            return NATIVE_INT8_ROWS
        if (isinstance(weight, CpuInt4Weight)
                and weight.group_size % INT4_CODES_GROUP_MULTIPLE == 0):
            if weight.group_size >= INT4_LARGE_GROUP:
                return INT4_LARGE_GROUP_NATIVE_ROWS
            return INT4_CODES_NATIVE_ROWS
        return NATIVE_ROWS

    def _apply_native(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ w.T`` by the native kernels, or None where they do not take this product."""
        if (self.ops is None or x.device.type != "cpu" or x.dim() != 2
                or not 0 < x.shape[0] <= self.native_row_limit(weight)
                or x.shape[1] % NATIVE_K_MULTIPLE):
            return None
        tensors = weight.tensors
        if isinstance(weight, CpuInt4Weight):
            if "nibbles" not in tensors or weight.group_size % NATIVE_K_MULTIPLE:
                return None
            x = _sorted_input(weight, x)
            rows = self.ops.int4_rows
            if weight.group_size % INT4_CODES_GROUP_MULTIPLE == 0:
                rows = self.ops.int4_rows_a8 if self.int8_activations else self.ops.int4_rows_a16
            return rows(x, tensors["nibbles"], tensors["scales"], tensors["zero_scales"])
        if isinstance(weight, CpuFp8Weight):
            block = weight.group_size
            if block != -1 and (weight.in_features % block or block % NATIVE_K_MULTIPLE):
                return None
            return self.ops.fp8_rows(x, tensors["bits"], tensors["scale"])
        if isinstance(weight, Int8Weight):
            rows = self.ops.int8_rows_a8 if self.int8_activations else self.ops.int8_rows_a16
            return rows(x, tensors["qweight"], tensors["scale"])
        return None

    def _apply_int8(self, weight: Int8Weight, x: torch.Tensor) -> torch.Tensor:
        qweight, scale = weight.tensors["qweight"], weight.tensors["scale"]
        if self.packed_ops:
            return torch._weight_int8pack_mm(x, qweight, scale)
        return _blocked_linear(x, weight, lambda rows: qweight[rows].float()) * scale

    def _apply_int4(self, weight: CpuInt4Weight, x: torch.Tensor) -> torch.Tensor:
        x = _sorted_input(weight, x)
        if "packed" in weight.tensors:
            return torch._weight_int4pack_mm_for_cpu(
                x, weight.tensors["packed"], weight.group_size,
                weight.tensors["scales_and_zeros"])
        return _blocked_linear(x, weight, weight.sorted_matrix)


class CpuInt8ActivationLinear(CpuQuantLinear):
    """``cpu`` with 4-bit and int8 products of a few rows on int8 activations (``cpu_a8``).

    Each row of ``x`` is rounded to int8 per group (scale: the group's largest ``|x|``
    over 127) and multiplied in integers: by ``int4_rows_a8`` next to 4-bit weights (the
    weight's groups) and by ``int8_rows_a8`` next to int8 ones (blocks of the largest of
    128, 64, 32, 16 features that divides the input features). The result is the product
    of the dequantized weight and the rounded ``x``, 2.4x (4-bit) the float kernels' rate
    at one row on an AVX2 core; the rounding adds at most half a step of ``x`` per
    feature (0.4% of its group's largest value), as the int8 and int4 weight paths of
    other CPU runtimes do. 4-bit groups that are not a multiple of 32, and more rows than
    ``native_row_limit``, run as ``cpu`` does. Products of more rows by int8 weights round
    ``x`` the same way and multiply in integers by torch's int8 GEMM
    (``int8_activation_product``); by FP8 weights with a scale per channel, where the CPU
    multiplies bfloat16 natively, they round ``x`` to bfloat16 and run torch's bfloat16
    GEMM (``bfloat16_fp8_product``). Other FP8 products run as ``cpu``'s.
    """

    int8_activations: ClassVar[bool] = True

    def native_row_limit(self, weight: QuantizedWeight) -> int:
        """``cpu``'s, but int8 products past ``A8_INT8_ROWS`` rows run torch's int8 GEMM,
        and FP8 ones past ``BFLOAT16_FP8_NATIVE_ROWS`` torch's bfloat16 GEMM where it is
        native here (``bfloat16_fp8_product``)."""
        if isinstance(weight, Int8Weight):
            return A8_INT8_ROWS
        if self._bfloat16_fp8(weight):
            return BFLOAT16_FP8_NATIVE_ROWS
        return super().native_row_limit(weight)

    def _bfloat16_fp8(self, weight: QuantizedWeight) -> bool:
        """Whether products by ``weight`` past the native rows run in bfloat16: an FP8
        weight with a scale per channel, on a CPU that multiplies bfloat16 natively."""
        return (self.ops is not None and BFLOAT16_GEMM_IS_NATIVE
                and isinstance(weight, CpuFp8Weight) and weight.group_size == -1
                and weight.in_features % 8 == 0)

    def _apply_torch(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        if self._bfloat16_fp8(weight):
            assert self.ops is not None
            return bfloat16_fp8_product(x, weight, self.ops.fp8_bfloat16)
        return super()._apply_torch(weight, x)

    def _apply_int8(self, weight: Int8Weight, x: torch.Tensor) -> torch.Tensor:
        if not self.packed_ops:
            y = int8_activation_product(x, weight.tensors["qweight"], weight.tensors["scale"])
            if y is not None:
                return y
        return super()._apply_int8(weight, x)
