"""The ``triton`` quantized-linear kernel: GPTQ, AWQ, FP8 and int8 weights multiplied in Triton.

``prepare`` repacks a loaded weight once into what the GEMMs of ``quant_gemm`` read:

* GPTQ and AWQ become one layout, ``TritonInt4Weight``: GPTQ's packing of eight input
  rows per int32 with the input rows sorted by group, zero points unpacked to uint8
  (GPTQ's stored ``zero - 1`` already undone), scales as stored. A GPTQ checkpoint
  without act-order keeps its ``qweight`` as it is; AWQ's (packed along the output dim,
  interleaved) is unpacked and packed again.
* Act-order (GPTQ ``desc_act``, a ``g_idx`` that is not ``row // group_size``): the input
  rows are sorted by group once here, so every K step of the kernel meets a single group
  and loads one row of zeros and scales, and ``apply`` gathers ``x``'s columns in the
  same order (one ``index_select`` of the activations, far smaller than the weight,
  instead of a per-row group lookup in the kernel's inner loop).
* Groups of unequal sizes (act-order rows split across tensor-parallel ranks) or of a
  size that is no multiple of 16 (a K step's least): each group is padded with rows
  that read a zero column of ``x`` to one size, a multiple of 16.
* FP8 and int8 become ``TritonW8Weight``: the 8-bit ``[out, in]`` weight as stored and a
  float32 scale per output channel (an FP8 per-tensor scale repeated); block-wise FP8 a
  scale per output channel and block of input rows (each block's scale repeated over its
  rows), its blocks a multiple of 16 input rows wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from framework.layers.quantization.awq import AwqWeight
from framework.layers.quantization.fp8 import Fp8BlockWeight, Fp8Weight
from framework.layers.quantization.gptq import GptqWeight, padded_groups
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.torch_kernels import SUPPORTED_FORMATS, check_format
from framework.layers.quantization.weights import QuantizedWeight, pack_int4, unpack_int4
from framework_triton_kernels.quant_gemm import (
    MIN_DOT,
    GemmConfig,
    gemm_config,
    int4_gemm,
    w8_gemm,
)

#: Activation dtypes the GEMMs take.
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonInt4Weight(QuantizedWeight):
    """A GPTQ or AWQ weight repacked for ``int4_gemm``, its input rows sorted by group.

    ``qweight`` int32 ``[groups * group_size / 8, out]`` (GPTQ packing of the kernel's
    rows), ``zeros`` uint8 and ``scales`` ``[groups, out]``, and ``perm`` (when the rows
    were sorted or padded) the input row each kernel row reads, ``in`` for a padding row
    (``_kernel_rows``). ``group_size`` is the kernel's group size: a multiple of 16.
    """

    format: ClassVar[str] = "triton_int4"

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[out, in]`` in the original input order."""
        q = unpack_int4(self.tensors["qweight"].t().contiguous()).float()  # [out, in sorted]
        zeros = self.tensors["zeros"].float().t().repeat_interleave(self.group_size, 1)
        scales = self.tensors["scales"].float().t().repeat_interleave(self.group_size, 1)
        sorted_matrix = (q - zeros) * scales
        perm = self.tensors.get("perm")
        if perm is None:
            return sorted_matrix
        # One column past the end takes the padding rows, and is dropped.
        matrix = sorted_matrix.new_empty(self.out_features, self.in_features + 1)
        matrix[:, perm] = sorted_matrix
        return matrix[:, :self.in_features].contiguous()


@dataclass
class TritonW8Weight(QuantizedWeight):
    """An 8-bit ``weight`` ``[out, in]`` (int8 or float8_e4m3fn) and float32 ``scale``:
    ``[out]``, or with ``group_size`` (block-wise FP8's block columns)
    ``[out, ceil(in / group_size)]``."""

    format: ClassVar[str] = "triton_w8"

    def dequantize(self) -> torch.Tensor:
        """``weight * scale`` as float32 ``[out, in]``."""
        scale = self.tensors["scale"]
        if self.group_size == -1:
            return self.tensors["weight"].float() * scale[:, None]
        scale = scale.repeat_interleave(self.group_size, 1)[:, :self.in_features]
        return self.tensors["weight"].float() * scale


def _kernel_rows(g_idx: torch.Tensor, groups: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The kernel's input rows, its groups and its group size, for rows in groups ``g_idx``.

    Returns ``(perm, held, size)``: kernel row ``k`` reads input row ``perm[k]`` (``perm``
    is None when that is row ``k`` itself), and rows ``j * size`` to ``(j + 1) * size``
    are group ``held[j]``'s (``held`` None: every group, in order). When every group holds
    the same number of rows, a multiple of ``MIN_DOT``, the rows are only sorted by group;
    otherwise (a group size that is no multiple of 16, or act-order rows split across
    tensor-parallel ranks, which leaves each rank uneven groups) the groups holding rows
    are padded to the same multiple of 16 (``padded_groups``), with ``perm`` pointing
    their padding rows at the input's one-past-the-end column (``apply`` appends a zero
    column there).
    """
    g_idx = g_idx.long()
    rows = g_idx.numel()
    counts = torch.bincount(g_idx, minlength=groups)
    size = rows // groups
    if size % MIN_DOT == 0 and bool((counts == size).all()):
        order = torch.argsort(g_idx, stable=True)
        if torch.equal(order, torch.arange(rows, device=order.device)):
            return None, None, size
        return order, None, size
    return padded_groups(g_idx, groups, MIN_DOT)


def _prepare_int4(weight: GptqWeight | AwqWeight) -> TritonInt4Weight:
    """Repack GPTQ or AWQ into ``TritonInt4Weight``'s layout (see the module's notes)."""
    scales = weight.tensors["scales"]
    groups = scales.shape[0]
    if isinstance(weight, GptqWeight):
        g_idx = weight.tensors["g_idx"]
    else:
        g_idx = torch.arange(weight.in_features, device=scales.device) // (
            weight.in_features // groups)
    perm, held, size = _kernel_rows(g_idx, groups)
    zeros = weight.zeros().to(torch.uint8)
    if held is not None:
        scales, zeros = scales[held], zeros[held]
    tensors = {"scales": scales.contiguous(), "zeros": zeros}
    if isinstance(weight, GptqWeight) and perm is None:
        tensors["qweight"] = weight.tensors["qweight"].contiguous()
    else:
        q = weight.int_weight()  # [in, out]
        if perm is not None:
            # Padding rows read row ``in``: any 4-bit value will do against x's zero column.
            q = torch.cat([q, q.new_zeros(1, q.shape[1])])[perm]
            tensors["perm"] = perm
        tensors["qweight"] = pack_int4(q.t().contiguous()).t().contiguous()
    return TritonInt4Weight(tensors, weight.shape, size)


def _prepare_w8(weight: Fp8Weight | Fp8BlockWeight | Int8Weight) -> TritonW8Weight:
    """The 8-bit weight as stored and its float32 per-channel (or per-block) scale.

    Raises:
        ValueError: FP8 blocks that are not a multiple of 16 input rows wide.
    """
    if isinstance(weight, Fp8BlockWeight):
        rows, cols = weight.block
        if cols % MIN_DOT:
            raise ValueError(f"the triton GEMM takes FP8 blocks a multiple of {MIN_DOT} input "
                             f"rows wide, got {rows}x{cols}")
        return TritonW8Weight({"weight": weight.tensors["weight"].contiguous(),
                               "scale": weight.row_scales().contiguous()}, weight.shape, cols)
    if isinstance(weight, Fp8Weight):
        bits, scale = weight.tensors["weight"], weight.channel_scales()
    else:
        bits, scale = weight.tensors["qweight"], weight.tensors["scale"].float()
    return TritonW8Weight({"weight": bits.contiguous(), "scale": scale.contiguous()},
                          weight.shape)


class TritonQuantLinear:
    """Quantized ``y = x @ w.T + bias`` through Triton GEMMs that dequantize in registers."""

    def __init__(self, config: GemmConfig | None = None) -> None:
        """``config``: tiles for every call (default: ``gemm_config`` by ``x``'s rows and dtype)."""
        self.config = config

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        """Repack a loaded GPTQ, AWQ, FP8 or int8 weight for ``apply``."""
        check_format("triton", weight, SUPPORTED_FORMATS)
        if isinstance(weight, GptqWeight | AwqWeight):
            return _prepare_int4(weight)
        return _prepare_w8(weight)

    def apply(self, weight: QuantizedWeight, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """Multiply ``x`` ``[..., in]`` by a prepared weight: ``[..., out]`` in ``x``'s dtype.

        Raises:
            ValueError: a weight that did not come from ``prepare``, or an activation
                dtype other than float16, bfloat16 and float32.
        """
        if x.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"the triton quantized-linear kernel takes float16, bfloat16 or "
                             f"float32 activations, not {x.dtype}")
        rows = x.reshape(-1, weight.in_features)
        config = self.config or gemm_config(rows.shape[0], x.dtype)
        if rows.shape[0] == 0:
            y = rows.new_empty(0, weight.out_features)
        elif isinstance(weight, TritonInt4Weight):
            perm = weight.tensors.get("perm")
            if perm is not None:
                if perm.numel() > weight.in_features:  # padded groups read a zero column
                    rows = F.pad(rows, (0, 1))
                rows = rows.index_select(1, perm)
            y = int4_gemm(rows, weight.tensors["qweight"], weight.tensors["zeros"],
                          weight.tensors["scales"], bias, weight.group_size, config)
        elif isinstance(weight, TritonW8Weight):
            y = w8_gemm(rows, weight.tensors["weight"], weight.tensors["scale"], bias, config,
                        scale_cols=max(weight.group_size, 0))
        else:
            raise ValueError(f"the triton quantized-linear kernel multiplies weights from its "
                             f"prepare(), not {weight.format!r} ones")
        return y.reshape(*x.shape[:-1], weight.out_features)
