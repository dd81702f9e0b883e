"""Phi-3 on ModelRunner against transformers, plus loading its fused checkpoint tensors.

The tiny Phi-3 fixture has a sliding window of 7 tokens, shorter than most test
prompts, so the window shapes every prefill, chunk and decode step checked
here. The checks run on the torch attention backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from framework.layers.attention import RadixAttention
from framework.model_executor.model_runner import ModelRunner
from framework.models.phi3 import Phi3ForCausalLM, RowSlice
from tests.model_fixtures import make_tiny_checkpoint, single_threaded_torch, tiny_config
from tests.unit.test_llama_models import (
    Driver,
    assert_all_slots_free,
    assert_batched_greedy_matches,
    assert_matches_transformers,
    greedy,
    load_hf,
    make_runner,
    prompt_ids,
)

NEW_TOKENS = 16
WINDOW = tiny_config("phi3").sliding_window


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


def torch_runner(path: Path) -> ModelRunner:
    return make_runner(path, attention_backend="torch")


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": None}, {"num_key_value_heads": 1}])
def test_batched_greedy_generation_matches_transformers(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    path = make_tiny_checkpoint(tmp_path, "phi3", **overrides)
    assert_batched_greedy_matches(path, torch_runner(path), NEW_TOKENS, WINDOW)


def test_chunked_prefill_and_a_mixed_step_match_transformers(tmp_path: Path) -> None:
    """A chunk over a cached prefix longer than the window, a fresh prompt and a decoding
    request in one EXTEND step, then decode steps for all three."""
    path = make_tiny_checkpoint(tmp_path, "phi3")
    driver = Driver(torch_runner(path))
    prompts = prompt_ids()
    chunked, fresh, decoding = prompts[7], prompts[3], prompts[5]
    split = 2 * WINDOW + 1
    first, second, third = driver.start(3)
    prefill = driver.extend([first, third], [chunked[:split], decoding])
    decoded = int(prefill[1].argmax())
    mixed = driver.runner.forward(driver.extend_batch(
        [first, second, third], [chunked[split:], fresh, [decoded]], decode_tail=1))
    logits = mixed.next_token_logits
    assert logits is not None
    tokens, logprobs = greedy(driver, [first, second, third], logits, 8)
    hf_model = load_hf(path)
    assert_matches_transformers(hf_model, chunked, tokens[0], logprobs[0])
    assert_matches_transformers(hf_model, fresh, tokens[1], logprobs[1])
    third_logprob = float(prefill[1].log_softmax(-1)[decoded])
    assert_matches_transformers(hf_model, decoding, [decoded, *tokens[2]],
                                [third_logprob, *logprobs[2]])
    driver.finish([first, second, third])
    assert_all_slots_free(driver.runner)


def test_every_layer_attends_within_the_window() -> None:
    config = tiny_config("phi3", num_hidden_layers=3)
    model = Phi3ForCausalLM(config, torch.float32, torch.device("meta"))
    windows = [m.sliding_window for m in model.modules() if isinstance(m, RadixAttention)]
    assert windows == [WINDOW] * 3
    unwindowed = Phi3ForCausalLM(tiny_config("phi3", sliding_window=None), torch.float32,
                                 torch.device("meta"))
    assert {m.sliding_window for m in unwindowed.modules() if isinstance(m, RadixAttention)} \
        == {None}


class RecordingWeight:
    """A checkpoint tensor that records the rows each read takes, as ``(start, length)``."""

    def __init__(self, tensor: torch.Tensor, reads: list[tuple[int, int]]) -> None:
        self._tensor = tensor
        self._reads = reads
        self.shape = tensor.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self._reads.append((start, length) if dim == 0 else (0, self.shape[0]))
        return self._tensor.narrow(dim, start, length)

    def __getitem__(self, index: Any) -> torch.Tensor:
        self._reads.append((0, self.shape[0]))
        return self._tensor[index]


def load_rank(tensors: dict[str, torch.Tensor], rank: int, tp_size: int
              ) -> tuple[Phi3ForCausalLM, dict[str, list[tuple[int, int]]]]:
    """A rank's model loaded from ``tensors``, with the rows it read of each tensor."""
    config = tiny_config("phi3")
    model = Phi3ForCausalLM(config, torch.float32, torch.device("cpu"), tp_rank=rank,
                            tp_size=tp_size)
    reads: dict[str, list[tuple[int, int]]] = {name: [] for name in tensors}
    model.load_weights((name, RecordingWeight(tensor, reads[name]))
                       for name, tensor in tensors.items())
    return model, reads


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_loads_and_reads_only_its_rows_of_the_fused_tensors(
    tmp_path: Path, tp_size: int
) -> None:
    """Two ranks split the two key/value heads; four ranks replicate each on two ranks."""
    config = tiny_config("phi3")
    tensors = load_file(make_tiny_checkpoint(tmp_path, "phi3") / "model.safetensors")
    head_dim = config.hidden_size // config.num_attention_heads
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q_rows, kv_rows = heads * head_dim // tp_size, max(1, kv_heads // tp_size) * head_dim
    size = config.intermediate_size
    mlp_rows = size // tp_size
    qkv_name = "model.layers.1.self_attn.qkv_proj.weight"
    gate_up_name = "model.layers.1.mlp.gate_up_proj.weight"
    qkv, gate_up = tensors[qkv_name], tensors[gate_up_name]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    gate, up = gate_up.split([size, size])
    for rank in range(tp_size):
        model, reads = load_rank(tensors, rank, tp_size)
        layer = model.model.layers[1]
        kv_start = rank * kv_heads // tp_size * head_dim
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([
            q[rank * q_rows:(rank + 1) * q_rows],
            k[kv_start:kv_start + kv_rows],
            v[kv_start:kv_start + kv_rows],
        ])), rank
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([
            gate[rank * mlp_rows:(rank + 1) * mlp_rows], up[rank * mlp_rows:(rank + 1) * mlp_rows],
        ])), rank
        q_size = heads * head_dim
        assert reads[qkv_name] == [
            (rank * q_rows, q_rows),
            (q_size + kv_start, kv_rows),
            (q_size + kv_heads * head_dim + kv_start, kv_rows),
        ]
        assert reads[gate_up_name] == [(rank * mlp_rows, mlp_rows),
                                       (size + rank * mlp_rows, mlp_rows)]


def test_row_slice_reads_within_its_rows() -> None:
    whole = torch.arange(24.0).reshape(6, 4)
    part = RowSlice(whole, 2, 3)
    assert part.shape == (3, 4)
    assert torch.equal(part[...], whole[2:5])
    assert torch.equal(part.narrow(0, 1, 2), whole[3:5])
    assert torch.equal(part.narrow(-1, 1, 2), whole[2:5, 1:3])


def test_a_missing_or_misshapen_fused_tensor_is_refused(tmp_path: Path) -> None:
    tensors = load_file(make_tiny_checkpoint(tmp_path, "phi3") / "model.safetensors")
    model = Phi3ForCausalLM(tiny_config("phi3"), torch.float32, torch.device("cpu"))
    missing_qkv = {n: t for n, t in tensors.items() if "layers.1.self_attn.qkv_proj" not in n}
    with pytest.raises(ValueError, match=r"3 parameters: .*layers\.1\.self_attn\.qkv_proj"
                                         r"\.weight\[k\]"):
        model.load_weights(missing_qkv.items())
    missing_gate_up = {n: t for n, t in tensors.items() if "layers.0.mlp.gate_up_proj" not in n}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_up_proj\.weight\[1\]"):
        model.load_weights(missing_gate_up.items())
    name = "model.layers.0.self_attn.qkv_proj.weight"
    short = {**tensors, name: tensors[name][:-16]}
    with pytest.raises(ValueError, match=rf"{name}.*\(112, 64\), expected \(128, 64\)"):
        model.load_weights(short.items())


@pytest.mark.parametrize(("overrides", "setting"), [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                          "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
      "original_max_position_embeddings": 64}, "longrope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_unsupported_rope_settings_are_refused_at_load(
    tmp_path: Path, overrides: dict[str, Any], setting: str
) -> None:
    path = make_tiny_checkpoint(tmp_path, "phi3", **overrides)
    with pytest.raises(ValueError, match=setting):
        torch_runner(path)
