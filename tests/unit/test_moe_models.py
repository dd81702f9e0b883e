"""Qwen2-MoE, Qwen3-MoE and Mixtral on ModelRunner against transformers, and their loading.

The tiny fixtures (``tests.model_fixtures``) route each token to 2 of 4, 6 or 8
experts; Qwen2-MoE has a shared expert, a dense layer and unnormalized routing
weights, Qwen3-MoE renormalizes them, Mixtral attends within a sliding window.
Every comparison is float32, logprobs within 1e-4 of transformers'.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from framework.layers.moe import FusedMoE
from framework.model_executor.model_runner import ModelRunner
from framework.models import moe
from framework.models.llama import LlamaMLP
from framework.models.mixtral import MixtralForCausalLM
from framework.models.moe import MoeForCausalLM, SparseMoeBlock
from framework.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tests.model_fixtures import make_tiny_checkpoint, single_threaded_torch, tiny_config
from tests.unit.test_llama_models import (
    LOGPROB_ATOL,
    Driver,
    assert_all_slots_free,
    assert_batched_greedy_matches,
    load_hf,
    make_runner,
    prompt_ids,
)

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral"]
CLASSES: dict[str, type[MoeForCausalLM]] = {
    "qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}
WINDOWS = {"mixtral": 7}  # the fixtures' sliding windows
NEW_TOKENS = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_generation_matches_transformers(tmp_path: Path, arch: str) -> None:
    """One EXTEND of eight prompts of different lengths, then greedy DECODE steps."""
    path = make_tiny_checkpoint(tmp_path, arch)
    assert_batched_greedy_matches(path, make_runner(path), NEW_TOKENS, WINDOWS.get(arch))


def every_row_logprobs(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The log-probabilities after every token of each prompt, all prompts in one EXTEND."""
    driver = Driver(runner)
    requests = driver.start(len(prompts))
    rows = sum(len(p) for p in prompts)
    batch = driver.extend_batch(requests, prompts, prompt_logprob_rows=torch.arange(rows))
    output = runner.forward(batch)
    driver.finish(requests)
    assert_all_slots_free(runner)
    assert output.prompt_logits is not None
    return list(output.prompt_logits.log_softmax(-1).split([len(p) for p in prompts]))


def transformers_row_logprobs(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = load_hf(path)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]


def largest_difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_token_s_logits_match_transformers(tmp_path: Path, arch: str) -> None:
    """Each token is routed on its own: every prompt row is compared, not only the last."""
    path = make_tiny_checkpoint(tmp_path, arch)
    prompts = prompt_ids()[3:]
    got = every_row_logprobs(make_runner(path), prompts)
    assert largest_difference(got, transformers_row_logprobs(path, prompts)) < LOGPROB_ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_sending_every_token_to_expert_0_is_caught(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can tell a broken router from a working one."""
    path = make_tiny_checkpoint(tmp_path, arch)
    prompts = prompt_ids()[3:]
    route = moe.select_experts

    def to_expert_0(logits: torch.Tensor, top_k: int,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(logits, top_k, renormalize)
        return weights, torch.zeros_like(ids)

    monkeypatch.setattr(moe, "select_experts", to_expert_0)
    got = every_row_logprobs(make_runner(path), prompts)
    assert largest_difference(got, transformers_row_logprobs(path, prompts)) > 100 * LOGPROB_ATOL


@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen2_moe", {}),
    ("qwen2_moe", {"num_experts": 0}),
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("mixtral", {}),
])
def test_dense_and_sparse_layers_are_transformers(arch: str, overrides: dict[str, Any]) -> None:
    """Which layers are sparse (``mlp_only_layers``, ``decoder_sparse_step``), and each
    sparse block's settings."""
    config = tiny_config(arch, **overrides)
    model = CLASSES[arch](config, torch.float32, torch.device("meta"))
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    expected = [type(layer.mlp).__name__.endswith("SparseMoeBlock")
                for layer in reference.model.layers]
    mlps = [layer.mlp for layer in model.model.layers]
    assert [isinstance(mlp, SparseMoeBlock) for mlp in mlps] == expected
    assert all(isinstance(mlp, LlamaMLP) for mlp in mlps if not isinstance(mlp, SparseMoeBlock))
    for mlp in mlps:
        if isinstance(mlp, SparseMoeBlock):
            assert mlp.spec.top_k == 2
            assert mlp.spec.renormalize == (arch != "qwen2_moe")
            assert (mlp.shared_expert is not None) == (arch == "qwen2_moe")
            assert mlp.gate.weight.shape == (mlp.spec.num_experts, config.hidden_size)


def stacked_checkpoint(path: Path, destination: Path) -> Path:
    """``path``'s checkpoint with each layer's experts stacked as transformers holds them
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; Mixtral's block as ``mlp``)."""
    shutil.copytree(path, destination)
    per_expert = load_file(path / "model.safetensors")
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in per_expert.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        prefix, found, rest = name.partition(".experts.")
        if not found:
            stacked[name] = tensor
            continue
        expert, projection, _ = rest.split(".")
        experts.setdefault(prefix, {})[int(expert), names.get(projection, projection)] = tensor
    for prefix, tensors in experts.items():
        count = len(tensors) // 3
        stacked[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[e, "gate_proj"], tensors[e, "up_proj"]]) for e in range(count)])
        stacked[f"{prefix}.experts.down_proj"] = torch.stack(
            [tensors[e, "down_proj"] for e in range(count)])
    save_file(stacked, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_and_per_expert_checkpoints_load_the_same_weights(
    tmp_path: Path, arch: str
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    stacked = stacked_checkpoint(path, tmp_path / "stacked")
    assert not any(".experts.0." in name for name in load_file(stacked / "model.safetensors"))
    per_expert_params = dict(make_runner(path).model.named_parameters())
    stacked_params = dict(make_runner(stacked).model.named_parameters())
    assert per_expert_params.keys() == stacked_params.keys()
    for name, param in per_expert_params.items():
        assert torch.equal(param, stacked_params[name]), name


@pytest.mark.parametrize(("change", "message"), [
    ("drop", r"no weights for 1 parameters: model\.layers\.0\.mlp\.experts\.w13\[\(3, 'up'\)\]"),
    ("renumber", "names expert 6, but the model has 6 experts"),
])
def test_a_missing_or_unknown_expert_is_refused(tmp_path: Path, change: str,
                                                message: str) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    tensors = load_file(path / "model.safetensors")
    tensor = tensors.pop("model.layers.0.mlp.experts.3.up_proj.weight")
    if change == "renumber":
        tensors["model.layers.0.mlp.experts.6.up_proj.weight"] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        make_runner(path)


def test_ranks_hold_their_experts_or_their_rows_of_every_expert(tmp_path: Path) -> None:
    """Expert parallelism: whole experts, half of them each, and only those are demanded.
    Tensor parallelism: every expert, half of its intermediate rows each."""
    path = make_tiny_checkpoint(tmp_path, "qwen2_moe")
    weights = load_file(path / "model.safetensors")
    prefix = "model.layers.2.mlp.experts"
    gate_up = torch.stack([torch.cat([weights[f"{prefix}.{e}.gate_proj.weight"],
                                      weights[f"{prefix}.{e}.up_proj.weight"]])
                           for e in range(4)])
    down = torch.stack([weights[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
    without_expert_0 = {name: t for name, t in weights.items() if ".experts.0." not in name}

    def rank(**parallel: int) -> FusedMoE:
        model = Qwen2MoeForCausalLM(tiny_config("qwen2_moe"), torch.float32,
                                    torch.device("cpu"), **parallel)
        model.load_weights(weights.items())
        return model.model.layers[2].mlp.experts

    for ep_rank in (0, 1):
        experts = rank(ep_rank=ep_rank, ep_size=2)
        held = slice(2 * ep_rank, 2 * ep_rank + 2)
        assert torch.equal(experts.w13, gate_up[held]) and torch.equal(experts.w2, down[held])
    model = Qwen2MoeForCausalLM(tiny_config("qwen2_moe"), torch.float32, torch.device("cpu"),
                                ep_rank=1, ep_size=2)
    model.load_weights(without_expert_0.items())  # expert 0 is rank 0's to load
    with pytest.raises(ValueError, match=r"experts\.w2\[\(0, 'down'\)\]"):
        Qwen2MoeForCausalLM(tiny_config("qwen2_moe"), torch.float32, torch.device("cpu"),
                            ep_rank=0, ep_size=2).load_weights(without_expert_0.items())

    halves = [rank(tp_rank=tp_rank, tp_size=2) for tp_rank in (0, 1)]
    assert all(experts.w13.shape == (4, 32, 64) for experts in halves)
    gates = torch.cat([experts.w13[:, :16] for experts in halves], dim=1)
    ups = torch.cat([experts.w13[:, 16:] for experts in halves], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), gate_up)
    assert torch.equal(torch.cat([experts.w2 for experts in halves], dim=2), down)


class RecordingGroup:
    """A stand-in tensor-parallel group: returns a rank's partial sum as it is, keeping it."""

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x)
        return x


def test_two_ranks_partial_sums_add_up_to_the_whole_block_in_one_all_reduce(
    tmp_path: Path
) -> None:
    """Two tensor-parallel ranks' outputs of a sparse block with a shared expert, each summed
    over nothing, add up to the one-rank block: the experts' and the shared expert's partial
    sums go into one all-reduce."""
    weights = load_file(make_tiny_checkpoint(tmp_path, "qwen2_moe") / "model.safetensors")
    config = tiny_config("qwen2_moe")

    def block(**parallel: int) -> SparseMoeBlock:
        model = Qwen2MoeForCausalLM(config, torch.float32, torch.device("cpu"), **parallel)
        model.load_weights(weights.items())
        return model.model.layers[0].mlp

    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = block()(x)
        partials = []
        for tp_rank in (0, 1):
            part = block(tp_rank=tp_rank, tp_size=2)
            part.tp_group = group = RecordingGroup()
            partials.append(part(x))
            # One all-reduce, of the whole output: nothing is added after it.
            assert len(group.reduced) == 1 and group.reduced[0] is partials[-1]
    assert not torch.allclose(partials[0], whole, atol=1e-3)
    torch.testing.assert_close(partials[0] + partials[1], whole, atol=1e-5, rtol=0.0)


def test_dummy_weights_build_a_moe_of_the_config_s_shape(tmp_path: Path) -> None:
    # The config alone gives the shape: the benchmarks' way to a model without its files.
    path = make_tiny_checkpoint(tmp_path, "mixtral")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    runner = make_runner(path, load_format="dummy", moe_backend="torch")
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    config = tiny_config("mixtral")
    assert len(experts) == config.num_hidden_layers
    for layer in experts:
        assert tuple(layer.w13.shape) == (config.num_local_experts,
                                          2 * config.intermediate_size, config.hidden_size)
        assert layer.w13.std() > 0 and layer.moe_kernel.__name__ == "torch_fused_experts"
    driver = Driver(runner)
    logits = driver.extend(driver.start(1), [prompt_ids()[0]])
    assert torch.isfinite(logits).all()
