"""Gemma 2 and Gemma 3 (text) on ModelRunner against transformers.

The tiny checkpoints have a sliding window of 6 tokens, shorter than most test
prompts, so that sliding-window layers see only part of a request; Gemma 2's
soft-capping and a query scalar other than the head size are set too
(``tests.model_fixtures``). Every check is float32, greedy, logprobs within
1e-4 of transformers' full-sequence logits, on the torch attention backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.layers.attention import RadixAttention, bind_attention_backend
from framework.layers.linear import default_dtype
from framework.layers.rotary import RopeConfig
from framework.model_executor.model_runner import ModelRunner
from framework.models import resolve_architecture
from framework.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaEmbedding,
    GemmaRMSNorm,
    rope_config_of,
)
from framework.models.llama import sliding_window_of
from tests.model_fixtures import make_tiny_checkpoint, single_threaded_torch, tiny_config
from tests.unit.test_llama_models import (
    LOGPROB_ATOL,
    Driver,
    Request,
    assert_all_slots_free,
    assert_batched_greedy_matches,
    greedy,
    load_hf,
    make_runner,
    prompt_ids,
)

ARCHS = ["gemma2", "gemma3"]
BACKEND = "torch"
WINDOW = 6  # the fixtures' sliding window
NEW_TOKENS = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


def runner_for(tmp_path: Path, arch: str) -> tuple[Path, ModelRunner]:
    path = make_tiny_checkpoint(tmp_path, arch)
    return path, make_runner(path, attention_backend=BACKEND)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_generation_matches_transformers(tmp_path: Path, arch: str) -> None:
    """One EXTEND of eight prompts of different lengths, then DECODE steps past the window."""
    path, runner = runner_for(tmp_path, arch)
    assert_batched_greedy_matches(path, runner, NEW_TOKENS, WINDOW)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_of_chunked_and_mixed_steps_matches_transformers(
    tmp_path: Path, arch: str
) -> None:
    """Prefill without and over a cached prefix, a mixed step, then decode.

    Every prompt row's logits are asked for (``prompt_logprob_rows``), so that
    positions on both sides of the window edge are checked, not only the last.
    """
    path, runner = runner_for(tmp_path, arch)
    driver = Driver(runner)
    prompts = prompt_ids()
    chunked, whole = prompts[7], prompts[5]
    split = 9
    first, second = driver.start(2)
    seen: list[tuple[Request, int, torch.Tensor]] = []

    def run(order: list[Request], chunks: list[list[int]], decode_tail: int = 0) -> torch.Tensor:
        starts = [len(r.cached) for r in order]
        rows = [(r, start + i) for r, start, chunk in zip(order, starts, chunks, strict=True)
                for i in range(len(chunk))]
        batch = driver.extend_batch(order, chunks, decode_tail=decode_tail,
                                    prompt_logprob_rows=torch.arange(len(rows)))
        output = runner.forward(batch)
        assert output.next_token_logits is not None and output.prompt_logits is not None
        seen.extend((r, p, lp) for (r, p), lp in zip(rows, output.prompt_logits, strict=True))
        return output.next_token_logits

    next_token = int(run([second], [whole]).argmax())  # a prefill without a prefix
    run([first], [chunked[:split]])
    # A chunk over a cached prefix and the other request's decode token in one step.
    logits = run([first, second], [chunked[split:], [next_token]], decode_tail=1)
    before_decode = [len(first.cached), len(second.cached)]
    tokens, logprobs = greedy(driver, [first, second], logits, 4)
    hf_model = load_hf(path, torch.float64)
    for i, request in enumerate((first, second)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([request.cached])).logits[0].log_softmax(-1)
        for owner, position, row_logits in seen:
            if owner is request:
                torch.testing.assert_close(row_logits.double().log_softmax(-1),
                                           reference[position], atol=LOGPROB_ATOL, rtol=0.0)
        # The mixed step's and the decode steps' greedy tokens.
        rows = reference[before_decode[i] - 1:]
        assert rows.argmax(-1).tolist() == tokens[i]
        chosen = rows[torch.arange(len(tokens[i])), torch.tensor(tokens[i])]
        torch.testing.assert_close(torch.tensor(logprobs[i], dtype=torch.float64), chosen,
                                   atol=LOGPROB_ATOL, rtol=0.0)
    driver.finish([first, second])
    assert_all_slots_free(runner)


def first_step_logprobs(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    driver = Driver(runner)
    requests = driver.start(1)
    logits = driver.extend(requests, [prompt])
    driver.finish(requests)
    return logits[0].log_softmax(-1)


@pytest.mark.parametrize(("arch", "setting"), [
    ("gemma2", "sliding_window"), ("gemma3", "sliding_window"), ("gemma2", "logit_cap"),
])
def test_without_the_window_or_the_cap_the_logits_differ(
    tmp_path: Path, arch: str, setting: str
) -> None:
    """The fixtures' window and soft-capping change the output: dropping them is caught."""
    path, runner = runner_for(tmp_path, arch)
    prompt = prompt_ids()[7]
    assert len(prompt) > 3 * WINDOW
    with torch.no_grad():
        expected = load_hf(path)(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(first_step_logprobs(runner, prompt), expected,
                               atol=LOGPROB_ATOL, rtol=0.0)
    layers = [m for m in runner.model.modules() if isinstance(m, RadixAttention)]
    changed = [layer for layer in layers if getattr(layer, setting) is not None]
    assert changed, f"the fixture sets no {setting}"
    for layer in changed:
        setattr(layer, setting, None)
    difference = (first_step_logprobs(runner, prompt) - expected).abs().max()
    assert difference > 100 * LOGPROB_ATOL


def test_layers_get_gemma_settings_by_layer_type() -> None:
    """Windows, caps and RoPE bases follow ``layer_types``; scaling is the query scalar's."""
    for cls, arch, cap in ((Gemma2ForCausalLM, "gemma2", 5.0), (Gemma3ForCausalLM, "gemma3", None)):
        config = tiny_config(arch)
        model = cls(config, torch.float32, torch.device("meta"))
        for layer_id, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            sliding = config.layer_types[layer_id] == "sliding_attention"
            assert attn.attn.sliding_window == (WINDOW if sliding else None)
            assert attn.attn.sliding_window == sliding_window_of(config, layer_id)
            assert attn.attn.logit_cap == cap
            assert attn.attn.scaling == pytest.approx(24**-0.5)
            assert attn.rotary_emb.rope == rope_config_of(config, config.layer_types[layer_id])
            assert (attn.q_norm is not None) == (arch == "gemma3")
        assert model.lm_head is model.model.embed_tokens  # tied
    config = tiny_config("gemma3")
    assert rope_config_of(config, "sliding_attention") == RopeConfig(theta=10.0)
    assert rope_config_of(config, "full_attention") == RopeConfig(theta=10000.0)
    scaled = tiny_config("gemma3", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})
    assert rope_config_of(scaled, "full_attention") == RopeConfig("linear", 1e6, 8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_embedding_round_as_transformers(dtype: torch.dtype) -> None:
    """``(1 + w)`` in float32 before the cast, and the embedding scale in the activation dtype."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RMSNorm,
        Gemma3TextScaledWordEmbedding,
    )

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=generator) * 3).to(dtype)
    weight = torch.randn(64, generator=generator).to(dtype)
    ours, theirs = GemmaRMSNorm(64).to(dtype), Gemma3RMSNorm(64).to(dtype)
    ours.weight.copy_(weight)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        residual = torch.randn(5, 64, generator=generator).to(dtype)
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))

    hidden = 3072  # sqrt(3072) is 55.43: 55.5 in bfloat16
    table = torch.randn(8, hidden, generator=generator).to(dtype)
    with default_dtype(dtype):
        embedding = GemmaEmbedding(8, hidden)
    embedding.weight.data = table
    reference = Gemma3TextScaledWordEmbedding(8, hidden, 0, embed_scale=math.sqrt(hidden))
    reference.weight.data = table
    ids = torch.tensor([3, 0, 7])
    with torch.no_grad():
        assert torch.equal(embedding(ids), reference(ids))
    assert (embedding.normalizer == 55.5) == (dtype == torch.bfloat16)


@pytest.mark.parametrize(("arch", "dropped"), [
    ("gemma2", "model.layers.1.post_feedforward_layernorm.weight"),
    ("gemma3", "model.layers.2.self_attn.k_norm.weight"),
])
def test_loading_refuses_a_checkpoint_missing_a_weight(
    tmp_path: Path, arch: str, dropped: str
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    tensors = load_file(path / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no weights for 1 parameters") as info:
        make_runner(path, attention_backend=BACKEND)
    assert dropped in str(info.value)


def test_gemma3_with_vision_is_refused_naming_the_text_model() -> None:
    with pytest.raises(ValueError, match="Gemma3ForCausalLM") as info:
        resolve_architecture(["Gemma3ForConditionalGeneration"])
    assert "vision" in str(info.value) and "\n" not in str(info.value)
    assert resolve_architecture(["Gemma3ForCausalLM"]) == "Gemma3ForCausalLM"


def test_two_pipeline_stages_compute_what_the_whole_model_does(tmp_path: Path) -> None:
    """Stage 0 (embedding, layers 0-1) hands ``(hidden, residual)`` to stage 1 (layer 2, head)."""
    path, whole = runner_for(tmp_path, "gemma3")
    weights = load_file(path / "model.safetensors")
    runners = [make_runner(path, attention_backend=BACKEND) for _ in range(2)]
    stages = []
    for rank, runner in enumerate(runners):
        stage = Gemma3ForCausalLM(tiny_config("gemma3"), torch.float32, torch.device("cpu"),
                                  pp_rank=rank, pp_size=2)
        stage.load_weights(weights.items())
        bind_attention_backend(stage, runner.attn_backend)  # the stage's layers, pool-indexed
        stages.append(stage)
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None
    prompts = prompt_ids()[5:8]
    batches = []
    for runner in (whole, *runners):
        driver = Driver(runner)
        batches.append(driver.extend_batch(driver.start(len(prompts)), prompts))
    expected = whole.forward(batches[0]).next_token_logits
    for runner, batch in zip(runners, batches[1:], strict=True):
        runner.attn_backend.init_forward_metadata(batch)
    first, last = batches[1:]
    with torch.no_grad():
        handed = stages[0](first.input_ids, first.positions, first)
        assert isinstance(handed, tuple)
        logits = stages[1](last.input_ids, last.positions, last, intermediate=handed)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0.0)


def test_tensor_parallel_ranks_hold_their_heads_and_whole_head_norms(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "gemma3")
    weights = load_file(path / "model.safetensors")
    ranks = [Gemma3ForCausalLM(tiny_config("gemma3"), torch.float32, torch.device("cpu"),
                               tp_rank=rank, tp_size=2) for rank in range(2)]
    for rank in ranks:
        rank.load_weights(weights.items())
    prefix = "model.layers.1.self_attn"
    attentions = [rank.model.layers[1].self_attn for rank in ranks]
    for attn in attentions:
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
        assert torch.equal(attn.q_norm.weight, weights[f"{prefix}.q_norm.weight"])
        assert torch.equal(attn.k_norm.weight, weights[f"{prefix}.k_norm.weight"])
    queries = torch.cat([attn.qkv_proj.weight[:attn.q_size] for attn in attentions])
    assert torch.equal(queries, weights[f"{prefix}.q_proj.weight"])
    outputs = torch.cat([attn.o_proj.weight for attn in attentions], dim=1)
    assert torch.equal(outputs, weights[f"{prefix}.o_proj.weight"])
