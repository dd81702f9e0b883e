"""Fused Mixture-of-Experts in Triton: two grouped GEMM launches over all the experts.

The (token, choice) pairs routed to the experts held here are sorted by expert and each
expert's run of pairs is padded to a multiple of ``BLOCK_M`` (``align_to_blocks``), so a
block of ``BLOCK_M`` sorted rows belongs to one expert, named in ``block_expert``. Then:

1. ``_gate_up_kernel``: for each block and each tile of the intermediate size, the rows'
   gate and up products with that expert's ``w13`` (the two tiles ``I`` rows apart), the
   gated activation applied in registers, ``act(gate) * up`` stored ``[P, I]``;
2. ``_down_kernel``: for each block and tile of the hidden size, the down projection
   with the expert's ``w2``, times each pair's routing weight, stored per pair ``[R, H]``;
3. the pairs of each token summed in float32 (``index_add_``).

Padding rows (``slot == -1``) are neither read nor written; blocks past the last
expert's (``block_expert == -1``) do nothing, so the grid's size follows from the number
of pairs alone, not from how they spread over the experts. Products accumulate in
float32.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from framework.layers.activation import GatedActivation
from framework.layers.moe.torch_moe import sort_by_expert

#: ``GatedActivation.hidden_act`` names the kernel computes, and its ``ACTIVATION`` for each.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class MoeConfig(NamedTuple):
    """Tile sizes, warps and pipeline stages of both kernels (``tl.dot`` needs every tile
    dimension of at least 16)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """The launch configuration for ``num_pairs`` routed rows over ``num_experts`` experts.

    A decode step gives each expert a few rows: 16-row blocks waste the least padding, and
    narrow N tiles give the few blocks more programs to stream the weights with. A prefill
    gives each expert many: 64-row blocks reuse each weight tile four times as often, over
    8 warps. The gate/up kernel holds two accumulators and two weight tiles: these tiles
    spill no registers on sm_90 in any dtype (``tests/plugins/compile_kernels_for_gpu.py``;
    a 16x64x64 16-bit tile does), float32's K tile half of 16-bit's.
    """
    per_expert = num_pairs / max(num_experts, 1)
    wide = dtype != torch.float32
    if per_expert <= 16:
        return MoeConfig(16, 32, 64 if wide else 32, num_warps=4)
    return MoeConfig(64, 64, 32 if wide else 16, num_warps=8)


def is_interpreter() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read
    when the kernels are defined, as this module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full float32 products (never TF32) for float32 inputs;
    16-bit inputs take the tensor cores' native path whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _gated(gate, up, ACTIVATION: tl.constexpr):
    """``act(gate) * up`` in float32: SiLU, or GELU's tanh form written as
    ``x * sigmoid(2u)`` (the same function, with one exponential)."""
    if ACTIVATION == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.79788... is sqrt(2 / pi), the tanh approximation's scale.
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    return act * up


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, inter_ptr, slot_ptr, token_ptr, block_expert_ptr,
                    hidden, intermediate, stride_x, stride_we, stride_wn, stride_inter,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``inter[p, n-tile] = act(x[token] @ gate.T) * (x[token] @ up.T)`` for one block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slot_ptr + offs_m)
        valid = pair >= 0
        token = tl.load(token_ptr + pair, mask=valid, other=0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < intermediate
        # The expert's offset in int64: E * 2I * H passes 2**31 on the larger models.
        w_gate = w13_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        w_up = w_gate + intermediate * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < hidden
            rows = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :],
                           mask=valid[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            gate = tl.load(w_gate + offs_k[:, None], mask=mask_w, other=0.0)
            up = tl.load(w_up + offs_k[:, None], mask=mask_w, other=0.0)
            acc_gate = tl.dot(rows, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(rows, up, acc_up, input_precision=DOT_PRECISION)
        gated = _gated(acc_gate, acc_up, ACTIVATION)
        tl.store(inter_ptr + offs_m[:, None] * stride_inter + offs_n[None, :],
                 gated.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(inter_ptr, w2_ptr, out_ptr, slot_ptr, scale_ptr, block_expert_ptr,
                 hidden, intermediate, stride_inter, stride_we, stride_wh, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """``out[pair, n-tile] = scale[pair] * inter[p] @ w2[expert, n-tile].T`` for one block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slot_ptr + offs_m)
        valid = pair >= 0
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hidden
        w_down = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wh
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, intermediate, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < intermediate
            gated = tl.load(inter_ptr + offs_m[:, None] * stride_inter + offs_k[None, :],
                            mask=valid[:, None] & mask_k[None, :], other=0.0)
            down = tl.load(w_down + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                           other=0.0)
            acc = tl.dot(gated, down, acc, input_precision=DOT_PRECISION)
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + pair[:, None] * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


class BlockLayout(NamedTuple):
    """The sorted pairs laid out in blocks of one expert each (``align_to_blocks``)."""

    #: ``[P]``: the pair (index into ``choices``) of each padded row, -1 for padding.
    slot: torch.Tensor
    #: ``[P / BLOCK_M]``: the local expert of each block, -1 past the last one.
    block_expert: torch.Tensor
    #: ``[R]``: each pair's flat index into ``ids`` ``[n, top_k]``.
    choices: torch.Tensor
    #: ``[R]``: each pair's token.
    tokens: torch.Tensor


def align_to_blocks(ids: torch.Tensor, first_expert: int, num_local: int,
                    block_m: int) -> BlockLayout:
    """Sort the held (token, choice) pairs by expert and pad each expert's run of them to a
    multiple of ``block_m`` rows.

    The padded length is bounded by ``R + min(R, E) * (block_m - 1)``, a size known without
    reading the counts back; the blocks past the used ones get expert -1.
    """
    choices, experts, tokens = sort_by_expert(ids, first_expert, num_local)
    pairs = choices.numel()
    counts = torch.bincount(experts, minlength=num_local)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first_pair = counts.cumsum(0) - counts
    index = torch.arange(pairs, device=ids.device)
    position = (padded_end - padded)[experts] + index - first_pair[experts]
    blocks = triton.cdiv(pairs + min(pairs, num_local) * (block_m - 1), block_m)
    slot = torch.full((blocks * block_m,), -1, dtype=torch.int64, device=ids.device)
    slot[position] = index
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return BlockLayout(slot, block_expert, choices, tokens)


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized buffer for one kernel's output: each row a kernel reads or sums
    later is written first."""
    return torch.empty(rows, cols, dtype=dtype, device=device)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: GatedActivation) -> str:
    """The kernels' ``ACTIVATION`` for ``act``; refuses what the kernels do not compute."""
    if act.hidden_act not in ACTIVATIONS:
        raise ValueError(f"the triton MoE kernel computes the gated {sorted(ACTIVATIONS)} "
                         f"activations, not {act.hidden_act!r}")
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"the triton MoE kernel needs one dtype for x ({x.dtype}), w13 "
                         f"({w13.dtype}) and w2 ({w2.dtype})")
    if x.dtype == torch.bfloat16 and is_interpreter():
        raise ValueError("the triton MoE kernel takes no bfloat16 under TRITON_INTERPRET=1: "
                         "the interpreter's bfloat16 products are wrong; use float16 or "
                         "float32")
    return ACTIVATIONS[act.hidden_act]


def triton_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, act: GatedActivation,
                         first_expert: int = 0, packed: object = None, *,
                         config: MoeConfig | None = None) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for each token ``t``, as
    ``torch_fused_experts`` (same arguments, same result up to float rounding).

    ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``, for the experts
    ``first_expert .. first_expert + E - 1``; choices of other experts add nothing.
    ``packed`` (a CPU backend's layout) is not read. ``config``: tile sizes, by default
    ``moe_config``'s for this batch.
    """
    activation = _check(x, w13, w2, act)
    num_local, inter_size, hidden_size = w2.shape[0], w2.shape[2], w2.shape[1]
    config = config or moe_config(ids.numel(), num_local, x.dtype)
    layout = align_to_blocks(ids, first_expert, num_local, config.block_m)
    if not layout.choices.numel():
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    blocks = layout.block_expert.numel()
    precision = dot_precision(x.dtype)
    inter = _scratch(layout.slot.numel(), inter_size, x.dtype, x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter_size, config.block_n))](
        x, w13, inter, layout.slot, layout.tokens, layout.block_expert,
        hidden_size, inter_size, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        ACTIVATION=activation, DOT_PRECISION=precision, num_warps=config.num_warps,
        num_stages=config.num_stages)
    scale = weights.reshape(-1).index_select(0, layout.choices).float()
    rows = _scratch(layout.choices.numel(), hidden_size, torch.float32, x.device)
    _down_kernel[(blocks, triton.cdiv(hidden_size, config.block_n))](
        inter, w2, rows, layout.slot, scale, layout.block_expert,
        hidden_size, inter_size, inter.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, layout.tokens, rows)
    return out.to(x.dtype)
