"""Triton GEMMs by quantized weights, dequantized in registers: ``out = x @ w.T (+ bias)``.

Two kernels, each a plain tiled GEMM over ``[BLOCK_M, BLOCK_N]`` output tiles with a
float32 accumulator; neither ever writes a float copy of the weight to memory.

* ``int4_gemm``: 4-bit weights in GPTQ's packing (``qweight`` int32 ``[in/8, out]``, input
  row ``8r + j`` in nibble ``j`` of row ``r``), one zero point and scale per group of input
  rows and output column. ``BLOCK_K`` divides the group size, so each K step meets one
  group: the step multiplies ``x`` by ``q - zero`` (small integers, exact in float16 and
  bfloat16) and scales the partial product once per column, ``acc += (x @ (q - z)) * s``,
  which is ``x @ ((q - z) * s)`` without rounding the dequantized weight to ``x``'s dtype.
* ``w8_gemm``: 8-bit weights ``[out, in]``, int8 or FP8 E4M3 (Triton specialises the kernel
  on the weight pointer's dtype); every int8 and E4M3 value is exact in float16 and
  bfloat16, and the per-output-channel scale is applied once, after the K loop. With
  block-wise scales (block-wise FP8: a scale per output row and block of ``scale_cols``
  input rows), ``BLOCK_K`` divides the block, as for int4's groups, and each K step's
  partial product takes its block's scale; that partial product is a second float32 tile
  beside the accumulator, so tiles are at most ``SCALED_TILE_ELEMENTS`` (``w8_config``).

Row and column tails are masked (loads read zeros, stores are skipped); ``w8_gemm`` masks
the K tail too, while ``int4_gemm`` needs none (``BLOCK_K`` divides the group size, which
divides ``in``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

#: The most output elements of a block-scaled 8-bit GEMM's tile: 128 x 128 spills
#: registers on sm_90 (eight warps: 312 bytes a thread), 128 x 64 does not.
SCALED_TILE_ELEMENTS = 128 * 64
#: tl.dot needs every dimension of at least 16.
MIN_DOT = 16


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one GEMM launch (``BLOCK_K`` an upper bound for int4)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def gemm_config(rows: int, dtype: torch.dtype) -> GemmConfig:
    """GPU defaults by the activations' rows and dtype (sm_90, compiled without spills).

    Few rows make the product weight-bandwidth bound: tiles 32 columns wide spread the
    weight over more programs (128 for 4,096 outputs, about one per SM of an H100 or
    H200), 128 rows deep make longer reads. Many rows make it compute bound: larger tiles
    reuse each loaded tile more. float32 operands multiply on the CUDA cores (full
    precision, no tensor cores), whose tiles spill beyond 16 x 32 x 32. Not yet timed on
    a GPU: each choice is one that compiles for sm_90 without spilling.
    """
    if dtype == torch.float32:
        return GemmConfig(16, 32, 32, num_warps=4, num_stages=2)
    if rows <= 16:
        return GemmConfig(16, 32, 128, num_warps=4, num_stages=4)
    if rows <= 64:
        return GemmConfig(64, 64, 32, num_warps=4, num_stages=4)
    return GemmConfig(128, 128, 32, num_warps=8, num_stages=4)


def dot_args(dtype: torch.dtype) -> dict[str, bool | str]:
    """The kernels' ``DOT_FLOAT32`` and ``DOT_PRECISION`` for activations of ``dtype``.

    ``tl.dot``'s operands take the activations' type, except bfloat16 under Triton's
    interpreter, whose ``tl.dot`` multiplies bfloat16 bits as integers: there they widen
    to float32 (``DOT_FLOAT32``; exact for bfloat16 values and for the weights' small
    integers and E4M3 values). Float32 operands multiply in full precision, never TF32;
    16-bit ones take the tensor cores' native path whatever the precision says.
    """
    widen = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    full = widen or dtype == torch.float32
    return {"DOT_FLOAT32": widen, "DOT_PRECISION": "ieee" if full else "tf32"}


def int4_block_k(group_size: int, limit: int) -> int:
    """The largest power of two of at least ``MIN_DOT``, at most ``limit``, dividing the group.

    Raises:
        ValueError: a group size no such block divides (not a multiple of 16).
    """
    block = MIN_DOT
    if group_size % block:
        raise ValueError(f"the triton int4 GEMM needs a group size that is a multiple of "
                         f"{MIN_DOT}, got {group_size}")
    while block * 2 <= limit and group_size % (block * 2) == 0:
        block *= 2
    return block


def w8_config(config: GemmConfig, scale_cols: int) -> GemmConfig:
    """The tiles ``w8_gemm`` launches with: ``config``, or for block scales of
    ``scale_cols`` input rows a ``BLOCK_K`` dividing them and a tile of at most
    ``SCALED_TILE_ELEMENTS``.

    Raises:
        ValueError: ``scale_cols`` not a multiple of 16.
    """
    if not scale_cols:
        return config
    block_n = min(config.block_n, max(MIN_DOT, SCALED_TILE_ELEMENTS // config.block_m))
    return replace(config, block_n=block_n,
                   block_k=int4_block_k(scale_cols, config.block_k))


@triton.jit
def _int4_gemm_kernel(x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr,
                      M, N, K, stride_xm, stride_qk, stride_zg, stride_sg, stride_om,
                      GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      DOT_FLOAT32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x @ ((q - zero) * scale)`` (+ bias)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    # Row offsets in int64: rows * stride passes 2^31 elements in a long enough prefill.
    rows = offs_m.to(tl.int64)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_packed = tl.arange(0, BLOCK_K // 8)
    # Nibble j of a packed row holds input row 8r + j: shifting a [rows, 1, cols] tile by
    # [1, 8, 1] gives [rows, 8, cols], which flattens (row-major) into input-row order.
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
                     mask=mask_m[:, None], other=0.0)
        packed = tl.load(qweight_ptr + (k0 // 8 + offs_packed)[:, None] * stride_qk
                         + offs_n[None, :], mask=mask_n[None, :], other=0)
        q = tl.reshape((packed[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP_SIZE
        zeros = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=mask_n, other=0)
        scales = tl.load(scales_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0)
        if DOT_FLOAT32:
            xs = xs.to(tl.float32)
        w = (q - zeros.to(tl.int32)[None, :]).to(xs.dtype)
        part = tl.dot(xs, w, input_precision=DOT_PRECISION)
        acc += part * scales.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
                    M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                    SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DOT_FLOAT32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``(x @ w.T) * scale`` (+ bias), ``w`` int8 or E4M3;
    ``SCALE_COLS`` 0: a scale per output column, else per output column and block of that
    many input rows."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    # Row offsets in int64: rows * stride passes 2^31 elements in a long enough prefill.
    rows = offs_m.to(tl.int64)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if DOT_FLOAT32:
            xs = xs.to(tl.float32)
        part = tl.dot(xs, w.to(xs.dtype), input_precision=DOT_PRECISION)
        if SCALE_COLS > 0:
            scales = tl.load(scale_ptr + offs_n * stride_sn + k0 // SCALE_COLS, mask=mask_n,
                             other=0.0)
            acc += part * scales[None, :]
        else:
            acc += part
    if SCALE_COLS == 0:
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _output(x: torch.Tensor, cols: int, out: torch.Tensor | None) -> torch.Tensor:
    """A new ``[m, cols]`` result in ``x``'s dtype, or ``out`` checked to be one."""
    if out is None:
        return torch.empty(x.shape[0], cols, dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], cols) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{x.shape[0]}, {cols}] tensor")
    return out


def _grid(rows: int, cols: int, config: GemmConfig) -> tuple[int, int]:
    return triton.cdiv(rows, config.block_m), triton.cdiv(cols, config.block_n)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
              scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
              config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, in] @ w.T`` for GPTQ-packed ``qweight [in/8, out]``: ``[m, out]`` in ``x``'s dtype.

    ``zeros`` (integer) and ``scales`` are ``[in/group_size, out]``; ``config.block_k`` is
    lowered to divide ``group_size`` (``int4_block_k``). ``out``, when given, is the
    contiguous ``[m, out]`` tensor to write.
    """
    x = x.contiguous()
    rows, cols = x.shape[0], qweight.shape[1]
    out = _output(x, cols, out)
    block_k = int4_block_k(group_size, config.block_k)
    _int4_gemm_kernel[_grid(rows, cols, config)](
        x, qweight, zeros, scales, out if bias is None else bias, out,
        rows, cols, x.shape[1], x.stride(0), qweight.stride(0), zeros.stride(0),
        scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, **dot_args(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def w8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None, config: GemmConfig,
            out: torch.Tensor | None = None, scale_cols: int = 0) -> torch.Tensor:
    """``(x [m, in] @ weight.T) * scale`` for int8 or E4M3 ``weight [out, in]``: ``[m, out]``.

    ``scale`` is float32 ``[out]``, or with ``scale_cols`` ``[out, ceil(in / scale_cols)]``
    (a scale per block of ``scale_cols`` input rows, a multiple of 16; the tiles are then
    ``w8_config``'s); the result is in ``x``'s dtype, written to ``out`` (contiguous
    ``[m, out]``) when given.
    """
    x = x.contiguous()
    rows, cols = x.shape[0], weight.shape[0]
    out = _output(x, cols, out)
    config = w8_config(config, scale_cols)
    _w8_gemm_kernel[_grid(rows, cols, config)](
        x, weight, scale, out if bias is None else bias, out,
        rows, cols, x.shape[1], x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_COLS=scale_cols, HAS_BIAS=bias is not None, **dot_args(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
