"""``config.json`` of the built-in decoder families, read without importing transformers.

Importing transformers to parse a config costs a Scheduler process seconds
at start-up (its package import pulls in much of ``torch.distributed``), for
a file of a few dozen numbers. For the model types whose configuration this
module knows (``llama``, ``mistral``, ``qwen2``, ``qwen3``), ``PlainConfig``
holds the file's fields over that type's defaults, completed as transformers
completes them (grouped-query heads, head size, the sliding window and layer
types of the Qwen types), so that the models read the same values either way
(``tests/unit/test_plain_config.py`` checks this against transformers). Any
other model type is transformers' to read.
"""

from __future__ import annotations

from typing import Any

# Defaults, for a field that config.json leaves out, of what the runtime and the
# models read; the same values as transformers' configuration classes.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096,
    "head_dim": None, "rope_parameters": None, "rope_scaling": None, "rope_theta": None,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
                "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
}
PLAIN_MODEL_TYPES: frozenset[str] = frozenset(_DEFAULTS)


class PlainConfig:
    """A model's configuration as attributes: config.json over its type's defaults.

    Reads as a transformers configuration does for the fields the runtime uses
    (``config.hidden_size``, ``getattr(config, "head_dim", None)``, ...).
    """

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__!r})"

    def to_dict(self) -> dict[str, Any]:
        """Every field, as a new dict."""
        return dict(self.__dict__)


def plain_config(raw: dict[str, Any]) -> PlainConfig | None:
    """The configuration in ``raw`` (config.json's object); None for a model type not known here.

    Raises:
        ValueError: the head size cannot be derived (hidden size not a multiple of the heads).
    """
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        return None
    fields = {**_COMMON, **_DEFAULTS[model_type], **raw}
    if "dtype" not in raw:  # older files name it torch_dtype
        fields["dtype"] = raw.get("torch_dtype")
    heads = fields["num_attention_heads"]
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = heads
    if fields["head_dim"] is None:
        if fields["hidden_size"] % heads:
            raise ValueError(f"the hidden size ({fields['hidden_size']}) is not a multiple of "
                             f"the number of attention heads ({heads})")
        fields["head_dim"] = fields["hidden_size"] // heads
    if model_type in ("qwen2", "qwen3"):
        _qwen_layer_types(fields)
    return PlainConfig(fields)


def _qwen_layer_types(fields: dict[str, Any]) -> None:
    """Qwen's window, as transformers completes it: only with ``use_sliding_window``, and
    only from layer ``max_window_layers`` on (``layer_types``, unless the file lists them)."""
    if not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if fields.get("layer_types") is None:
        fields["layer_types"] = [
            "sliding_attention" if fields["sliding_window"] is not None
            and i >= fields["max_window_layers"] else "full_attention"
            for i in range(fields["num_hidden_layers"])]
