"""The Triton fused MoE kernel against a float64 reference, the torch backend and the Engine.

Without a GPU the kernels run in Triton's CPU interpreter (this folder's conftest sets
``TRITON_INTERPRET=1`` before they are imported), which has no bfloat16 arithmetic; on a
GPU they run compiled, bfloat16 too. The kernels' scratch buffers are filled with NaN
here, so a row a kernel should write and does not shows in the output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from framework import Engine
from framework.layers.activation import GatedActivation
from framework.layers.moe.torch_moe import torch_fused_experts
from framework.registry import MOE_BACKENDS

pytest.importorskip("triton")
from framework_triton_kernels import moe
from framework_triton_kernels.moe import (
    MoeConfig,
    align_to_blocks,
    is_interpreter,
    triton_fused_experts,
)

from tests.plugins.greedy_rule import (
    FLOAT16_LOGPROB_TOLERANCE,
    FLOAT16_NEAR_TIE,
    assert_same_greedy,
)

DEVICE = torch.device("cpu" if is_interpreter() else "cuda")
#: Max abs error allowed against the float64 reference, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
DTYPES = [torch.float32, torch.float16] + ([] if is_interpreter() else [torch.bfloat16])
#: The smallest tiles tl.dot takes: the case's sizes leave partial tiles and blocks.
SMALL = MoeConfig(block_m=16, block_n=16, block_k=16, num_warps=4)
FIRST_EXPERT, LOCAL_EXPERTS, ALL_EXPERTS = 2, 4, 8
#: A local expert that no choice names.
IDLE_EXPERT = FIRST_EXPERT + 1


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill the kernels' scratch buffers with NaN: an unwritten row poisons the output."""
    def poisoned(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full((rows, cols), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(moe, "_scratch", poisoned)


def _case(dtype: torch.dtype, seed: int = 0, tokens: int = 21, hidden: int = 40,
          intermediate: int = 24) -> tuple[torch.Tensor, ...]:
    """Top-2 routing over 8 experts of which experts 2..5 are held here: 18 tokens choose
    expert 2 first (a 16-row block and a partial one), no choice names expert 3, the other
    choices fall inside and outside the held range; the last token chooses only experts
    held elsewhere. Hidden and intermediate sizes are not multiples of the tiles."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(LOCAL_EXPERTS, 2 * intermediate, hidden, generator=gen) / 6
    w2 = torch.randn(LOCAL_EXPERTS, hidden, intermediate, generator=gen) / 5
    others = torch.tensor([e for e in range(ALL_EXPERTS) if e not in (FIRST_EXPERT,
                                                                       IDLE_EXPERT)])
    ids = others[torch.randint(len(others), (tokens, 2), generator=gen)]
    ids[:18, 0] = FIRST_EXPERT
    ids[-1] = torch.tensor([0, 7])
    weights = torch.rand(tokens, 2, generator=gen)
    return (*(t.to(DEVICE, dtype) for t in (x, w13, w2, weights)), ids.to(DEVICE))


def max_error(dtype: torch.dtype, activation: str, config: MoeConfig | None = SMALL) -> float:
    """The kernel's max abs error against the reference run in float64 on ``_case``."""
    x, w13, w2, weights, ids = _case(dtype)
    act = GatedActivation(activation)
    expected = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(),
                                   ids, act, FIRST_EXPERT)
    got = triton_fused_experts(x, w13, w2, weights, ids, act, FIRST_EXPERT, config=config)
    assert got.dtype == dtype and got.shape == x.shape
    assert not got.isnan().any()
    assert (got[-1] == 0).all(), "a token routed only elsewhere must get zeros"
    return (got.double() - expected).abs().max().item()


# The activations in turn over the dtypes: the activation is computed in float32 whatever
# the dtype, so each dtype meets one (and test_launch_configs_match_float64_reference runs
# silu in float32 at two more tile configurations).
ACTIVATIONS = ["silu", "gelu_pytorch_tanh"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(dtype: torch.dtype) -> None:
    activation = ACTIVATIONS[DTYPES.index(dtype) % len(ACTIVATIONS)]
    err = max_error(dtype, activation)
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("config", [None, moe.moe_config(4096, 8, torch.float32)],
                         ids=["default for the case", "prefill tiles"])
def test_launch_configs_match_float64_reference(config: MoeConfig | None) -> None:
    err = max_error(torch.float32, "silu", config=config)
    assert err < TOLERANCE[torch.float32], err


def test_blocks_hold_one_expert_each_and_every_pair_once() -> None:
    ids = _case(torch.float32)[-1]
    layout = align_to_blocks(ids, FIRST_EXPERT, LOCAL_EXPERTS, block_m=16)
    slots = layout.slot.view(-1, 16)
    used = layout.block_expert >= 0
    assert layout.block_expert[used].tolist() == [0, 0, 2, 3]  # expert 2's 18 rows: 2 blocks
    assert (slots[~used] == -1).all()
    held = slots[slots >= 0]
    assert sorted(held.tolist()) == list(range(layout.choices.numel()))
    local = ids.reshape(-1)[layout.choices[held]] - FIRST_EXPERT
    row_experts = layout.block_expert.repeat_interleave(16)[layout.slot >= 0]
    assert (local == row_experts).all()


def test_registry_entry_matches_torch_backend() -> None:
    kernel = MOE_BACKENDS.get("triton")
    assert kernel is triton_fused_experts
    x, w13, w2, weights, ids = _case(torch.float32, seed=1)
    act = GatedActivation("silu")
    got = kernel(x, w13, w2, weights, ids, act, FIRST_EXPERT)
    expected = MOE_BACKENDS.get("torch")(x, w13, w2, weights, ids, act, FIRST_EXPERT)
    # A plain max: torch.testing.assert_close's first call imports for seconds.
    assert (got - expected).abs().max().item() < 1e-5


def test_no_held_choice_gives_zeros() -> None:
    x, w13, w2, weights, _ = _case(torch.float32)
    ids = torch.zeros(x.shape[0], 2, dtype=torch.int64, device=DEVICE)  # held elsewhere
    got = triton_fused_experts(x, w13, w2, weights, ids, GatedActivation(), FIRST_EXPERT)
    assert (got == 0).all()


@pytest.mark.parametrize("change", ["gelu", "mixed dtypes", "bfloat16 interpreted"])
def test_refuses_what_it_does_not_compute(change: str) -> None:
    if change == "bfloat16 interpreted" and not is_interpreter():
        pytest.skip("compiled kernels take bfloat16")
    x, w13, w2, weights, ids = _case(torch.float32)
    act = GatedActivation("gelu" if change == "gelu" else "silu")
    if change == "mixed dtypes":
        w2 = w2.half()
    if change == "bfloat16 interpreted":
        x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    with pytest.raises(ValueError):
        triton_fused_experts(x, w13, w2, weights, ids, act, FIRST_EXPERT)


def test_engine_greedy_parity_with_torch_backend(
        tiny_checkpoint: Callable[..., Path]) -> None:
    """The tiny Mixtral (8 experts, top-2) decodes the same with either MoE kernel.

    In float16 with the torch attention backend: the native CPU kernels (float32 and
    bfloat16) are then not needed, and a run does not wait minutes for their build.
    """
    model_dir = tiny_checkpoint("mixtral", seed=3)
    prompts = ["the quick brown fox jumps over", "def add(a, b):"]
    greedy = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    results = {}
    for backend in ("torch", "triton"):
        with Engine(model_path=str(model_dir), moe_backend=backend, dtype="float16",
                    attention_backend="torch", launch_mode="thread",
                    log_level="warning") as engine:
            results[backend] = engine.generate(prompts, greedy, return_logprob=True,
                                               top_logprobs_num=2)
    for got, ref in zip(results["triton"], results["torch"], strict=True):
        assert_same_greedy(got, ref, FLOAT16_NEAR_TIE, FLOAT16_LOGPROB_TOLERANCE)
