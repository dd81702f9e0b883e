"""A checkpoint's static KV cache scales (``k_scale``, ``v_scale``, ``kv_scale``).

They are taken out of the weights any model loads, kept by layer, cut to a rank's
key/value heads as ``QKVParallelLinear`` splits them, and start an FP8 pool's scales, which
then divide what is written; other KV cache dtypes load the checkpoint and leave them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.config import ServerArgs
from framework.mem_cache.kv_scales import CheckpointKVScales
from framework.mem_cache.memory_pool import MHATokenToKVPool
from framework.model_executor.model_runner import ModelRunner
from tests.model_fixtures import make_tiny_checkpoint


def test_take_keeps_the_scales_and_passes_the_rest() -> None:
    scales = CheckpointKVScales()
    weights = [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
               ("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2)),
               ("model.layers.0.self_attn.v_scale", torch.tensor([0.25])),
               ("model.layers.1.self_attn.kv_scale", torch.tensor([1.0, 2.0])),
               ("model.norm.weight", torch.ones(2))]
    passed = [name for name, _ in scales.take(weights)]
    assert passed == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert scales.keys[0].tolist() == [0.5] and scales.values[0].tolist() == [0.25]
    assert scales.keys[1].tolist() == scales.values[1].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(("stored", "total", "rank", "tp", "expected"), [
    ([0.5], 4, 0, 1, [0.5] * 4),  # one for the layer, every head
    ([1.0, 2.0, 3.0, 4.0], 4, 1, 2, [3.0, 4.0]),  # rank 1 of 2: heads 2 and 3
    ([1.0, 2.0], 2, 3, 4, [2.0]),  # 2 heads on 4 ranks: ranks 2 and 3 hold head 1
])
def test_rank_scales_are_the_rank_s_heads(stored: list[float], total: int, rank: int,
                                          tp: int, expected: list[float]) -> None:
    scales = CheckpointKVScales({0: torch.tensor(stored)}, {})
    k, v = scales.rank_scales(0, total, rank, tp)
    assert k is not None and k.tolist() == expected
    assert v is None  # none stored: the pool keeps 1.0


def test_a_scale_of_another_head_count_is_refused() -> None:
    scales = CheckpointKVScales({}, {2: torch.ones(3)})
    with pytest.raises(ValueError, match="layer 2's v_scale has 3 values; expected 1 or"):
        scales.rank_scales(2, 4, 0, 1)


def test_fp8_pool_divides_by_the_scales_it_starts_from() -> None:
    pool = MHATokenToKVPool(8, torch.float32, 2, 4, 1, torch.device("cpu"), "fp8_e4m3")
    k_scales = pool.k_scales[0]
    pool.set_static_scales(0, torch.tensor([0.5, 0.25]), None)
    assert pool.k_scales[0] is k_scales  # in place: backends holding it see the new values
    assert pool.k_scales[0].tolist() == [0.5, 0.25] and pool.v_scales[0].tolist() == [1.0, 1.0]
    k = torch.full((1, 2, 4), 0.3)
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    codes = pool.k_buffers[0][1].float()
    assert codes[0].tolist() == [torch.tensor(0.6).to(torch.float8_e4m3fn).float().item()] * 4
    assert codes[1].tolist() == [torch.tensor(1.2).to(torch.float8_e4m3fn).float().item()] * 4
    with pytest.raises(ValueError, match="scales of shape"):
        pool.set_static_scales(0, torch.ones(3), None)
    int8 = MHATokenToKVPool(8, torch.float32, 2, 4, 1, torch.device("cpu"), "int8")
    with pytest.raises(ValueError, match="int8 KV cache keeps no static scales"):
        int8.set_static_scales(0, torch.ones(2), None)


def test_a_checkpoint_with_kv_scales_loads_and_starts_an_fp8_cache(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")  # 2 key/value heads
    tensors = load_file(str(path / "model.safetensors"))
    layers = sorted({int(name.split(".")[2]) for name in tensors if ".layers." in name})
    for layer in layers:
        prefix = f"model.layers.{layer}.self_attn"
        tensors[f"{prefix}.k_scale"] = torch.tensor(0.5 + layer)
        tensors[f"{prefix}.v_scale"] = torch.tensor([0.25, 0.125 * (layer + 1)])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    args = {"model_path": str(path), "device": "cpu", "max_total_tokens": 64}
    runner = ModelRunner(ServerArgs(**args, kv_cache_dtype="fp8_e4m3"), str(path))
    pool = runner.pools.token_to_kv_pool
    for layer in layers:
        assert pool.k_scales[layer].tolist() == [0.5 + layer] * 2
        assert pool.v_scales[layer].tolist() == [0.25, 0.125 * (layer + 1)]
    # The scales never reach the model, whatever the cache holds.
    ModelRunner(ServerArgs(**args, kv_cache_dtype="auto"), str(path))
