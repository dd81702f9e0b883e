"""The Triton segmented LoRA kernel against a float64 reference and the torch backend, and
a mixed batch of adapters through the Engine with it selected."""

from __future__ import annotations

import pytest
import torch

from framework import Engine
from framework.lora.batch import NO_SLOT, LoraBatch
from framework.lora.ops import torch_lora_delta
from framework.registry import LORA_BACKENDS

pytest.importorskip("triton")
from framework_triton_kernels.lora import triton_lora_delta

from tests.integration.test_lora_engine import ADAPTERS, MIXED, PROMPTS, make_lora_dirs
from tests.plugins.greedy_rule import (
    FLOAT16_LOGPROB_TOLERANCE,
    FLOAT16_NEAR_TIE,
    assert_same_greedy,
)

#: Max abs error allowed against the float64 reference, per input dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


def _case(dtype: torch.dtype, seed: int = 0):
    """A mixed batch: two prefills (one longer than a 16-row block), decodes, rows
    without an adapter; in/out sizes and the rank that leave partial blocks."""
    gen = torch.Generator().manual_seed(seed)
    slots, tokens = [2, NO_SLOT, 0, 2, 1], [17, 3, 5, 1, 1]
    batch = LoraBatch.build(slots, tokens)
    n = sum(tokens)
    x = torch.randn(n, 40, generator=gen)
    a = torch.randn(3, 8, 40, generator=gen) / 8
    b = torch.randn(3, 50, 8, generator=gen) / 4
    a[1, 6:] = 0  # slot 1 has rank 6, zero-padded to 8
    b[1, :, 6:] = 0
    scalings = torch.tensor([0.5, 2.0, 1.0])
    return [t.to(dtype) for t in (x, a, b)] + [scalings], batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_float64_reference(dtype: torch.dtype) -> None:
    (x, a, b, scalings), batch = _case(dtype)
    expected = torch_lora_delta(x.double(), a.double(), b.double(), scalings.double(), batch)
    got = triton_lora_delta(x, a, b, scalings, batch)
    assert got.dtype == dtype and not got.isnan().any()
    err = (got.double() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], err
    no_adapter = torch.ones(x.shape[0], dtype=torch.bool)
    no_adapter[batch.rows] = False
    assert no_adapter.any() and (got[no_adapter] == 0).all()


def test_layer_parity_with_torch_backend() -> None:
    (x, a, b, scalings), batch = _case(torch.float32, seed=1)
    got = LORA_BACKENDS.get("triton")(x, a, b, scalings, batch)
    # A plain max: torch.testing.assert_close's first call imports for seconds.
    assert (got - torch_lora_delta(x, a, b, scalings, batch)).abs().max().item() < 1e-4


def test_empty_batch_is_zero() -> None:
    batch = LoraBatch.build([NO_SLOT, NO_SLOT], [2, 1])
    x = torch.randn(3, 8)
    got = triton_lora_delta(x, torch.zeros(1, 4, 8), torch.zeros(1, 5, 4), torch.ones(1), batch)
    assert got.shape == (3, 5) and (got == 0).all()


def test_a_mixed_batch_gives_the_torch_backend_s_greedy_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Base and three adapters (ranks 2 to 8, attention and MLP targets) in one batch of a
    float16 tiny Llama: ``lora_backend="triton"`` gives the torch kernel's greedy tokens."""
    dirs = make_lora_dirs(tmp_path_factory.mktemp("triton_lora"))
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = {}
    for backend in ("torch", "triton"):
        with Engine(model_path=str(dirs["base"]), dtype="float16", launch_mode="thread",
                    log_level="warning", lora_backend=backend,
                    lora_paths=[f"{name}={dirs[name]}" for name in ADAPTERS]) as engine:
            outputs[backend] = engine.generate(PROMPTS, params, lora_path=MIXED,
                                               return_logprob=True, top_logprobs_num=2)
    for got, ref in zip(outputs["triton"], outputs["torch"], strict=True):
        assert_same_greedy(got, ref, FLOAT16_NEAR_TIE, FLOAT16_LOGPROB_TOLERANCE)
