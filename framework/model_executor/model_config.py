"""What the runtime needs to know about a model, read from its directory.

``ModelConfig.from_pretrained`` reads ``config.json`` (itself for the built-in
decoder families, ``plain_config.py``; through transformers otherwise) and
``generation_config.json``, picks the model class's architecture, the
dtype and the context length, and checks that the directory is a model.

Dtype rule for ``--dtype auto``: the checkpoint's ``dtype`` (``torch_dtype``
in older configs) is used as is, except that float16 becomes float32 on CPU
(half-precision matmuls on CPU are slow and lose accuracy, while bfloat16 is
well supported there); a config without a dtype runs in float32.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.model_executor.model_dir import check_model_dir
from framework.model_executor.plain_config import plain_config
from framework.models import is_embedding_architecture, resolve_architecture

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def read_hf_config(model_path: str | Path) -> Any:
    """The configuration of a local model directory (never downloads).

    A ``PlainConfig`` for the model types it knows (no transformers import),
    else transformers' ``AutoConfig``.
    """
    path = check_model_dir(model_path)
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        plain = plain_config(raw) if isinstance(raw, dict) else None
    except (OSError, ValueError) as exc:  # json's errors are ValueErrors
        raise ValueError(f"cannot read {config_path}: {_first_line(exc)}") from exc
    if plain is not None:
        return plain
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise ValueError(f"cannot read {config_path}: {_first_line(exc)}") from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """The dtype to run in, for a ``--dtype`` value (see the module docstring for "auto")."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    if config_dtype not in _DTYPES.values():
        return torch.float32
    if config_dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return config_dtype


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def read_eos_token_ids(model_path: str | Path, hf_config: Any) -> set[int]:
    """EOS ids from config.json and, when present, generation_config.json."""
    eos = _as_id_set(getattr(hf_config, "eos_token_id", None))
    generation_path = Path(model_path) / "generation_config.json"
    if generation_path.is_file():
        try:
            generation = json.loads(generation_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {generation_path}: {exc}") from exc
        eos |= _as_id_set(generation.get("eos_token_id"))
    return eos


def _context_len(hf_config: Any, context_length: int | None) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if context_length is not None:
        if context_length <= 0:
            raise ValueError(f"--context-length must be > 0, got {context_length}")
        if model_max is not None and context_length > model_max:
            raise ValueError(
                f"--context-length {context_length} is longer than the model's "
                f"max_position_embeddings ({model_max})"
            )
        length = context_length
    elif model_max is not None:
        length = int(model_max)
    else:
        raise ValueError("config.json has no max_position_embeddings; pass --context-length")
    # A sliding window limits what a layer attends to, not the context: no cap here.
    return length


@dataclass
class ModelConfig:
    """A model's shape, dtype, context length and stop tokens."""

    model_path: str
    hf_config: Any = field(repr=False)
    architecture: str
    vocab_size: int
    context_len: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    is_embedding: bool
    #: The model class returns pooled embeddings itself (``is_embedding_model``), rather
    #: than a decoder whose hidden states are pooled (``--is-embedding``).
    is_native_embedding: bool
    eos_token_ids: set[int]

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        device: torch.device | None = None,
        context_length: int | None = None,
        is_embedding: bool = False,
    ) -> ModelConfig:
        """Read a local model directory.

        Raises:
            ValueError: the directory or its config is missing or malformed, or
                the architecture is not supported.
        """
        hf_config = read_hf_config(model_path)
        architecture = resolve_architecture(getattr(hf_config, "architectures", None))
        num_heads = int(hf_config.num_attention_heads)
        native_embedding = is_embedding_architecture(architecture)
        return cls(
            model_path=str(model_path),
            hf_config=hf_config,
            architecture=architecture,
            vocab_size=int(hf_config.vocab_size),
            context_len=_context_len(hf_config, context_length),
            hidden_size=int(hf_config.hidden_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_attention_heads=num_heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(
                getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
            ),
            dtype=resolve_dtype(dtype, hf_config, device or torch.device("cpu")),
            is_embedding=is_embedding or native_embedding,
            is_native_embedding=native_embedding,
            eos_token_ids=read_eos_token_ids(model_path, hf_config),
        )

    def num_heads_per_rank(self, tp_size: int) -> int:
        """Attention heads held by one tensor-parallel rank."""
        return self.num_attention_heads // tp_size

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """Key/value heads held by one rank (replicated when fewer than the ranks)."""
        return max(1, self.num_kv_heads // tp_size)

    def shape_signature(self) -> dict[str, Any]:
        """The fields that decide every weight's shape (for swapping in new weights)."""
        config = self.hf_config
        return {
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": getattr(config, "intermediate_size", None),
            "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        }
