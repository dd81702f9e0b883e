"""``PlainConfig``: what the runtime and the models read from it is what transformers gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from framework.layers.rotary import RopeConfig
from framework.model_executor.model_config import (
    ModelConfig,
    _as_id_set,
    _context_len,
    read_hf_config,
    resolve_dtype,
)
from framework.model_executor.plain_config import PLAIN_MODEL_TYPES, PlainConfig, plain_config
from framework.models.llama import head_dim_of, num_kv_heads_of

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 512,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
# Each case: config.json's fields beside model_type and architectures.
CASES: dict[str, dict[str, Any]] = {
    "defaults only": {},
    "small": SMALL,
    "small, older field names": {**SMALL, "torch_dtype": "float16", "rope_theta": 500000.0,
                                 "tie_word_embeddings": True, "eos_token_id": [3, 7]},
    "newer field names": {**SMALL, "dtype": "bfloat16",
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "llama3 rope": {**SMALL, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}},
    "linear rope": {**SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "own head size, biases, one kv head": {**SMALL, "head_dim": 32, "num_key_value_heads": 1,
                                           "attention_bias": True, "mlp_bias": True},
    "no kv heads given": {key: value for key, value in SMALL.items()
                          if key != "num_key_value_heads"},
    "sliding window used": {**SMALL, "sliding_window": 128, "use_sliding_window": True},
    "sliding window unused": {**SMALL, "sliding_window": 128, "use_sliding_window": False},
}


def _what_is_read(config: Any) -> dict[str, Any]:
    """Every value the runtime and the Llama-family models take from a configuration."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "architectures")
    flags = ("tie_word_embeddings", "attention_bias", "mlp_bias")
    return {
        **{name: getattr(config, name) for name in fields},
        **{name: bool(getattr(config, name, False)) for name in flags},
        "num_kv_heads": num_kv_heads_of(config),
        "head_dim": head_dim_of(config),
        "rope": RopeConfig.from_hf_config(config),
        "context_len": _context_len(config, None),
        "dtype": resolve_dtype("auto", config, torch.device("cpu")),
        "eos": _as_id_set(getattr(config, "eos_token_id", None)),
    }


def _write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
@pytest.mark.parametrize("case", list(CASES))
def test_the_models_read_what_transformers_gives(tmp_path: Path, model_type: str,
                                                 case: str) -> None:
    raw = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
           **CASES[case]}
    path = _write(tmp_path, raw)
    expected = _what_is_read(AutoConfig.from_pretrained(str(path), local_files_only=True))
    config = read_hf_config(path)
    assert isinstance(config, PlainConfig)
    assert _what_is_read(config) == expected


def test_every_built_in_decoder_family_is_read_plainly() -> None:
    assert set(ARCHITECTURES) == PLAIN_MODEL_TYPES


def test_other_model_types_are_left_to_transformers(tmp_path: Path) -> None:
    raw = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
           "vocab_size": 512}
    assert plain_config(raw) is None
    config = read_hf_config(_write(tmp_path, raw))
    assert type(config).__name__ == "BertConfig"
    assert config.hidden_size == 64


def test_a_head_size_that_cannot_be_derived_is_refused(tmp_path: Path) -> None:
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL,
           "hidden_size": 66}
    with pytest.raises(ValueError, match=r"cannot read .*not a multiple") as info:
        read_hf_config(_write(tmp_path, raw))
    assert "\n" not in str(info.value)
    # Given, it need not divide: it is the file's.
    config = read_hf_config(_write(tmp_path, {**raw, "head_dim": 16}))
    assert config.head_dim == 16


def test_the_default_model_reads_as_before() -> None:
    model = ModelConfig.from_pretrained(Path(__file__).parents[2] / "framework" / "default_model")
    assert isinstance(model.hf_config, PlainConfig)
    assert (model.architecture, model.hidden_size, model.num_layers, model.head_dim,
            model.vocab_size, model.dtype) == ("LlamaForCausalLM", 128, 4, 32, 4096,
                                               torch.bfloat16)
