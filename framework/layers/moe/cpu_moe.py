"""The CPU MoE kernel: the reference's sort by expert, with each expert's block of rows
multiplied the way that is quickest for its size and dtype.

Measured per expert on Mixtral-like shapes (hidden 512, intermediate 1,792), on one
thread of an AVX2 server core (``docs/benchmarks.md``, "The MoE kernels on a CPU"):

* a block of a few rows (a decode step) is a walk through the expert's weights, and the
  native ``linear_rows`` kernel (bound to the activation as ``act.cpu_ops``) does it
  ``NATIVE_ROWS`` rows at a time up to twice faster than a GEMM call in float32 and
  up to six times in bfloat16;
* without native bfloat16 dot products (no AVX512-BF16, no AMX), torch's bfloat16 GEMM
  takes time in proportion to the rows, some 8× float32's on a block of hundreds of
  rows: a larger bfloat16 block is multiplied in float32 (the expert's weights
  converted for the call, which costs less than one row of the bfloat16 product);
* everything else takes ``F.linear``.

Each token's weighted outputs are summed in float32. Off the CPU, the reference kernel
runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from framework.layers.activation import GatedActivation
from framework.layers.linear_kernel import NATIVE_ROWS, bfloat16_gemm_is_native, linear
from framework.layers.moe.torch_moe import run_experts, torch_fused_experts

#: Rows up to which an expert's block goes through ``linear_rows`` (``NATIVE_ROWS`` at a
#: time), per dtype: past them one GEMM call on the block is faster.
NATIVE_BLOCK_ROWS = {torch.float32: 2 * NATIVE_ROWS, torch.bfloat16: 8 * NATIVE_ROWS}
#: Rows below which a float32 block is multiplied on the experts' packed weights (when
#: given): oneDNN gains 35 % at 8 rows, 11 % at 32, and loses a few % from 64 rows on
#: (hidden 512, intermediate 1,792, one AVX2 core), where ``F.linear``'s GEMM does as well.
PACKED_BLOCK_ROWS = 48


_BF16_GEMM = bfloat16_gemm_is_native()


def cpu_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor, act: GatedActivation,
                      first_expert: int = 0,
                      packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                      ) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for each token ``t``, as
    ``torch_fused_experts`` (same arguments, same result up to float rounding).

    ``packed``: each expert's ``w13`` and ``w2`` packed for oneDNN (the ``onednn``
    linear backend, float32), which multiplies a block of a few dozen rows (a decode
    step's) 10-35 % faster than ``F.linear`` on a weight it rearranges at every call.
    """
    if x.device.type != "cpu":
        return torch_fused_experts(x, w13, w2, weights, ids, act, first_expert)

    def mlp(expert: int, block: torch.Tensor) -> torch.Tensor:
        pair = None if packed is None else (packed[0][expert], packed[1][expert])
        return _expert_mlp(block, w13[expert], w2[expert], act, pair)

    return run_experts(x, weights, ids, first_expert, w13.shape[0], mlp)


def _expert_mlp(block: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                act: GatedActivation,
                packed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One expert's gated MLP on its block of rows ``[m, H]`` (``packed``: its two weights
    packed for oneDNN, or None)."""
    ops = act.cpu_ops
    if (ops is not None and block.dtype == w13.dtype
            and len(block) <= NATIVE_BLOCK_ROWS.get(block.dtype, 0)):
        return torch.cat([ops.linear_rows(act(ops.linear_rows(rows, w13, None)), w2, None)
                          for rows in block.split(NATIVE_ROWS)])
    if (packed is not None and block.dtype == w13.dtype == torch.float32
            and len(block) < PACKED_BLOCK_ROWS):
        return linear(act(linear(block, w13, None, packed[0])), w2, None, packed[1])
    if block.dtype == torch.bfloat16 and not _BF16_GEMM:
        block, w13, w2 = block.float(), w13.float(), w2.float()
    return F.linear(act(F.linear(block, w13)), w2)
