"""The matrix product of linear layers: torch's ``F.linear``, or oneDNN's on packed weights.

On a CPU, torch's float32 ``F.linear`` hands the weight to a GEMM that
rearranges it into its blocked layout on every call. oneDNN can instead take
a weight packed once, after loading, and its kernels then run the model's
products 10-35% faster on the offline benchmark's shapes (64 decode rows or
2,048 prefill rows, 256-1,536 features) on an AVX-512 server core, with the
same results up to float rounding (the sums run in another order).

The linear backend is chosen like the attention backend (``--linear-backend``):

* ``torch``: ``F.linear`` on the weight as loaded;
* ``onednn``: each linear layer and the LM head keep a packed copy of their
  weight beside it (the loaders write the weight, the embedding lookup of a
  tied head reads it), so those weights take twice their memory; the copy is
  made again after every load (``pack_linear_weights``);
* ``auto``: ``onednn`` for float32 on a CPU when torch has oneDNN, else ``torch``
  (bfloat16 products already go through oneDNN in ``F.linear``); but ``torch`` on an
  Intel CPU when torch has MKL. MKL, behind ``F.linear``, is tuned for Intel's cores
  and runs the offline benchmark's Engine 5-7% faster than oneDNN there at two
  threads (the same at one); on an AMD core oneDNN is the faster by 10-35% a product.

Whatever the backend, a product of a few rows (``native_rows_fit``: a decode step of a few
requests) runs the native ``linear_rows`` kernel where the layers have it bound (float32
and bfloat16 on a CPU, ``bind_cpu_layer_ops``): such a product is a walk through the
weight, which the kernel does in a few microseconds less than a GEMM library's call
costs (oneDNN's 40-50 us on a packed 256 x 256 weight, against under 10), and in
bfloat16 without torch's conversions; on a CPU without bfloat16 instructions, bfloat16
products of any number of rows run it (four rows per walk), and on one with them those
of up to 16 rows (eight rows per AVX-512 walk), which torch's bfloat16 GEMM cannot start
in less time. Results agree with ``F.linear``'s to float rounding, and each row's with
what the kernel gives it alone, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from framework.cpuinfo import cpu_vendor

LINEAR_BACKENDS = ("auto", "onednn", "torch")


def bfloat16_gemm_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 at full speed (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


#: The most rows of ``x`` that ``linear`` hands to the native ``linear_rows`` kernel
#: (float32; bfloat16: ``native_rows_fit``).
NATIVE_ROWS = 4
#: Whether torch's bfloat16 GEMM runs at full speed here; where it does not, bfloat16
#: products of any size go to the native kernel, which is faster at every row count
#: there (2-5x from 5 to 64 rows of a 128-wide layer, measured on AVX2).
BFLOAT16_GEMM_IS_NATIVE = bfloat16_gemm_is_native()
#: Where the GEMM is native, bfloat16 products of up to this many rows still go to the
#: native kernel: there torch's bfloat16 GEMM (oneDNN) costs 20-30 us a call however small
#: the product, while the kernel's AVX-512 walk takes 6 to 8 rows (a verify step of
#: speculative decoding) through a 128 x 384 weight in 7-13 us. A 128 x 4096 LM head is
#: faster in the GEMM from about 5 rows with the widening walk (76 against 85 us at 6 on a
#: Zen 4 EPYC), from about 9 with AVX512-BF16's dot product (124 against 159 us at 16),
#: but the kernel sums each output in the same order whatever the rows, so that a verify
#: step's logits are a plain step's to the bit and greedy speculation keeps the plain
#: tokens exactly.
BFLOAT16_NATIVE_ROWS = 16


def native_rows_fit(rows: int, weight: torch.Tensor) -> bool:
    """Whether a product of ``rows`` rows by ``weight`` ``[out, in]`` is faster in the
    native ``linear_rows`` kernel than in torch's GEMM (float32 and bfloat16)."""
    if rows <= 0:
        return False
    if weight.dtype == torch.float32:
        return rows <= NATIVE_ROWS
    if weight.dtype != torch.bfloat16:
        return False
    if not BFLOAT16_GEMM_IS_NATIVE:
        return True
    return rows <= BFLOAT16_NATIVE_ROWS


class PackableLinear(Protocol):
    """A module whose ``weight`` ``[out, in]`` multiplies inputs, with room for it packed."""

    weight: torch.Tensor
    packed_weight: torch.Tensor | None


def onednn_available() -> bool:
    """Whether this torch can pack weights for and run oneDNN's float32 linear kernel."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def mkl_preferred() -> bool:
    """Whether float32 products on this CPU are MKL's to run: an Intel CPU, a torch with MKL."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → ``onednn`` for float32 on a CPU with oneDNN (not an Intel one), else ``torch``.

    Raises:
        ValueError: an unknown name, or ``onednn`` where it cannot run.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    fits = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        return "onednn" if fits and onednn_available() and not mkl_preferred() else "torch"
    if name == "onednn" and not fits:
        raise ValueError(f"the onednn linear backend runs float32 on a CPU, not {dtype} on "
                         f"{device.type}")
    if name == "onednn" and not onednn_available():
        raise ValueError("the onednn linear backend needs a torch built with oneDNN (mkldnn)")
    return name


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout, for ``linear(..., packed=...)``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def pack_linear_weights(modules: Iterable[PackableLinear]) -> None:
    """Pack (again) the weight of each module.

    Called after every load: a packed copy made before it would keep the old values.
    """
    for module in modules:
        module.packed_weight = pack_weight(module.weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None, cpu_ops: Any = None) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[..., in]``: with oneDNN on ``packed`` when given.

    ``cpu_ops``: the native CPU kernels, when bound; then ``x`` ``[rows, in]`` goes
    through ``linear_rows`` on ``weight`` when ``native_rows_fit``.
    """
    if (cpu_ops is not None and x.dim() == 2 and x.stride(1) == 1
            and x.dtype == weight.dtype and native_rows_fit(x.shape[0], weight)):
        return cpu_ops.linear_rows(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
