"""Quantized KV cache formats (``--kv-cache-dtype auto|fp8_e4m3|int8``).

* ``fp8_e4m3``: float8 E4M3 codes with one static scale per layer and KV head
  (``x ≈ code * scale``): a checkpoint's ``k_scale``/``v_scale`` (``kv_scales.py``), or
  1.0, as FP8 checkpoints without them assume: E4M3 spans ±448 with a relative step of 2^-3,
  and the keys and values of the models served stay far inside that range, so
  rounding, not clipping, sets the error. Half the bytes of bfloat16.
* ``int8``: int8 codes with one scale per token and KV head (absmax / 127), kept
  as float16 beside the codes. A static int8 scale would have to cover every
  token's largest value with 255 steps; a scale per token keeps each token's
  error within 1/254 of its own range, for 2 bytes per head and token beside the
  ``head_dim`` bytes of codes (66 against 128 bytes a head at head dim 64 in
  bfloat16).

Codes are written as tokens arrive and turned back into the model's dtype only
where an attention backend reads a request's tokens, never for the whole pool.
"""

from __future__ import annotations

import torch

#: ``--kv-cache-dtype`` choices: ``auto`` keeps the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
#: The dtype int8 scales are kept in.
INT8_SCALE_DTYPE = torch.float16
_INT8_MAX = 127.0
# The smallest int8 scale: an all-zero token's scale stays a normal float16.
_MIN_INT8_SCALE = 1e-4
_FP8_MAX = 448.0


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ``ValueError`` unless ``kv_cache_dtype`` is one of ``KV_CACHE_DTYPES``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the key and value buffers."""
    check_kv_cache_dtype(kv_cache_dtype)
    return {"auto": model_dtype, "fp8_e4m3": torch.float8_e4m3fn,
            "int8": torch.int8}[kv_cache_dtype]


def scale_bytes_per_head(kv_cache_dtype: str) -> int:
    """Bytes of scale each token keeps per KV head (only int8 keeps one per token)."""
    return INT8_SCALE_DTYPE.itemsize if kv_cache_dtype == "int8" else 0


def default_scales(kv_cache_dtype: str, slots: int, num_kv_heads: int,
                   device: torch.device) -> torch.Tensor | None:
    """One layer's scales: ``[num_kv_heads]`` (fp8), ``[slots, num_kv_heads]`` (int8),
    None (``auto``)."""
    if kv_cache_dtype == "fp8_e4m3":
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if kv_cache_dtype == "int8":
        return torch.ones(slots, num_kv_heads, dtype=INT8_SCALE_DTYPE, device=device)
    return None


def quantize(x: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of ``x`` ``[n, heads, head_dim]``, and for int8 the tokens' new scales
    ``[n, heads]`` (fp8 uses the static per-head ``scales``)."""
    if kv_cache_dtype == "fp8_e4m3":
        scaled = x.float() / scales[:, None]
        return scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), None
    token_scales = (x.float().abs().amax(dim=-1) / _INT8_MAX).clamp(min=_MIN_INT8_SCALE)
    token_scales = token_scales.to(INT8_SCALE_DTYPE)
    codes = (x.float() / token_scales.float()[..., None]).round().clamp(-_INT8_MAX, _INT8_MAX)
    return codes.to(torch.int8), token_scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype``: ``scales`` per head (fp8, ``[heads]``) or per token
    and head (int8, ``codes.shape[:-1]``)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)
