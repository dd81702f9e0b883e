"""Pooling of packed hidden states into one embedding per sequence.

A packed batch holds the tokens of several sequences back to back, without padding, so every
pooling mode here works from the list of sequence lengths: the mean over each sequence's tokens,
its first token (CLS) or its last token. The mode and whether the result is L2-normalized follow
the checkpoint's sentence-transformers configuration (`modules.json` and the Pooling module's
`config.json`), read by `load_pooling_config`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_POOLING_MODULE_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE_TYPE = "sentence_transformers.models.Normalize"


class PoolingType(enum.Enum):
    """How the token states of one sequence become its embedding."""

    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


# Keys of a sentence-transformers Pooling config that select one of the supported modes.
_MODE_KEYS: dict[str, PoolingType] = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
# Modes sentence-transformers knows that this module does not implement.
_UNSUPPORTED_MODE_KEYS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolingConfig:
    """The pooling mode of an embedding model and whether its embeddings are L2-normalized."""

    pooling_type: PoolingType = PoolingType.MEAN
    normalize: bool = True


def load_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """Read the pooling setup of a sentence-transformers checkpoint directory.

    Without a `modules.json` the default is mean pooling followed by L2 normalization, the
    setup of most sentence-embedding checkpoints. With one, normalization is on exactly when a
    Normalize module is listed, and the mode comes from the Pooling module's `config.json`
    (mean when the Pooling module or its config is absent).

    Raises:
        ValueError: the Pooling config selects no mode, several modes, or a mode not supported.
    """
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig()
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} must hold a list of modules")
    module_types = [str(module.get("type", "")) for module in modules]
    normalize = _NORMALIZE_MODULE_TYPE in module_types
    pooling_type = PoolingType.MEAN
    if _POOLING_MODULE_TYPE in module_types:
        pooling_module = modules[module_types.index(_POOLING_MODULE_TYPE)]
        pooling_path = Path(model_dir) / str(pooling_module.get("path", "")) / "config.json"
        if pooling_path.is_file():
            pooling_type = _pooling_type_from_config(_read_json(pooling_path), pooling_path)
    return PoolingConfig(pooling_type=pooling_type, normalize=normalize)


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _pooling_type_from_config(config: dict[str, Any], path: Path) -> PoolingType:
    unsupported = [key for key in _UNSUPPORTED_MODE_KEYS if config.get(key)]
    if unsupported:
        raise ValueError(f"{path}: pooling modes {unsupported} are not supported")
    selected = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if len(selected) != 1:
        raise ValueError(
            f"{path}: exactly one of {sorted(_MODE_KEYS)} must be true, got {len(selected)}"
        )
    return selected[0]


def pool_packed(
    hidden_states: torch.Tensor, seq_lens: list[int], pooling_type: PoolingType
) -> torch.Tensor:
    """Pool packed token states [num_tokens, hidden] into [len(seq_lens), hidden] float32.

    `seq_lens` gives the number of consecutive tokens of each sequence, in order.

    Raises:
        ValueError: a length is not positive or the lengths do not add up to the token count.
    """
    _check_seq_lens(seq_lens, hidden_states.shape[0])
    states = hidden_states.float()
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=states.device)
    ends = torch.cumsum(lens, dim=0)
    if pooling_type is PoolingType.CLS:
        return states[ends - lens]
    if pooling_type is PoolingType.LAST:
        return states[ends - 1]
    return _mean_pool(states, lens)


def _mean_pool(states: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    # Summing by sequence id handles the whole batch in one kernel instead of one per sequence.
    sequence_ids = torch.repeat_interleave(torch.arange(lens.numel(), device=states.device), lens)
    sums = states.new_zeros(lens.numel(), states.shape[1]).index_add_(0, sequence_ids, states)
    return sums / lens.unsqueeze(1).to(states.dtype)


def _check_seq_lens(seq_lens: list[int], num_tokens: int) -> None:
    if any(length <= 0 for length in seq_lens):
        raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
    if sum(seq_lens) != num_tokens:
        raise ValueError(
            f"sequence lengths add up to {sum(seq_lens)}, but there are {num_tokens} tokens"
        )


def l2_normalize(embeddings: torch.Tensor) -> torch.Tensor:
    """Scale each row to unit L2 norm (rows of zeros stay zero)."""
    return F.normalize(embeddings, p=2.0, dim=-1)


class Pooler(nn.Module):
    """Pools packed token states per sequence and normalizes them as configured."""

    def __init__(self, config: PoolingConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, hidden_states: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Return the [len(seq_lens), hidden] float32 embeddings of the packed sequences."""
        pooled = pool_packed(hidden_states, seq_lens, self.config.pooling_type)
        return l2_normalize(pooled) if self.config.normalize else pooled
