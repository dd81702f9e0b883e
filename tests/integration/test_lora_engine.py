"""LoRA adapters through the Engine: a batch mixing the base model and three adapters.

Each prompt runs under the base model and every adapter, after the mixed batch
cached it: KV shared across adapters in the prefix cache would change the tokens.

Three PEFT adapters of different ranks and targets (random A and B:
``init_lora_weights=False``) are served at once. The greedy tokens of a batch
mixing them with base-model requests must equal each adapter served alone and
transformers + peft with the adapter merged (float64); under TP=2 as well.
Selecting adapter 0 for every row instead must change the tokens. The mixed batch's
prompt logprobs over whole prompts (every row of the prefill makes logits, so the last
layer runs them all and orders them after it) equal the merged models' too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from framework import Engine
from framework.lora import serving
from framework.lora.batch import NO_SLOT
from tests.model_fixtures import (
    make_tiny_checkpoint,
    make_tiny_tokenizer,
    reference_model,
    transformers_greedy,
)

PROMPTS = ["the quick brown fox", "hello world, this is a test", "def add(a, b):", "x",
           "once upon a time", "print(add(2, 3))", "a b c d e f", "the end"]
NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
ENGINE_ARGS = {"log_level": "warning", "dtype": "float32", "launch_mode": "thread"}
#: name -> (rank, alpha, targets, rsLoRA)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "attn4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "mlp2": (2, 4, ["gate_proj", "up_proj", "down_proj"], False),
}
#: Each prompt's adapter in the mixed batch: base and every adapter, twice.
MIXED = [None, "attn4", "all8", "mlp2"] * 2


def _make_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int, alpha: int,
                  targets: list[str], rslora: bool) -> Path:
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # B large enough that every adapter changes the greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(out_dir)
    return out_dir


def make_lora_dirs(root: Path) -> dict[str, Path]:
    """The tiny Llama (``base``) and each of ``ADAPTERS`` for it, under ``root``."""
    base = make_tiny_checkpoint(root, "llama", seed=21)
    dirs: dict[str, Path] = {"base": base}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        dirs[name] = _make_adapter(base, root / name, seed, rank, alpha, targets, rslora)
    return dirs


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_lora_dirs(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = make_tiny_tokenizer()
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def merged_models(lora_dirs: dict[str, Path]) -> dict[str | None, Any]:
    """transformers' base model and each adapter merged into it (peft), float64."""
    import peft

    models: dict[str | None, Any] = {}
    for name in (None, *ADAPTERS):
        model = reference_model(lora_dirs["base"])
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, lora_dirs[name]).merge_and_unload()
        models[name] = model.double()
    return models


@pytest.fixture(scope="module")
def reference(merged_models: dict[str | None, Any], prompt_ids: list[list[int]]
              ) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of every prompt from transformers (+ peft, merged), float64."""
    return {name: [transformers_greedy(model, ids, NEW_TOKENS)[0] for ids in prompt_ids]
            for name, model in merged_models.items()}


@pytest.fixture(scope="module")
def reference_prompt_logprobs(merged_models: dict[str | None, Any],
                              prompt_ids: list[list[int]]) -> list[list[float]]:
    """Each prompt's logprobs of its tokens after the first, under its adapter in the mixed
    batch, from transformers (+ peft, merged), float64."""
    logprobs = []
    for ids, name in zip(prompt_ids, MIXED, strict=True):
        with torch.no_grad():
            logits = merged_models[name](torch.tensor([ids])).logits[0]
        chosen = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
        logprobs.append(chosen.squeeze(1).tolist())
    return logprobs


def _lora_paths(lora_dirs: dict[str, Path]) -> list[str]:
    return [f"{name}={lora_dirs[name]}" for name in ADAPTERS]


def _mixed(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY, lora_path=MIXED)
    return [o["output_ids"] for o in outs]


def _expected(reference: dict[str | None, list[list[int]]]) -> list[list[int]]:
    return [reference[name][i] for i, name in enumerate(MIXED)]


def test_adapters_change_the_base_model_s_tokens(
        reference: dict[str | None, list[list[int]]]) -> None:
    for name in ADAPTERS:
        differ = sum(a != b for a, b in zip(reference[name], reference[None], strict=True))
        assert differ >= len(PROMPTS) / 2, f"{name} changes only {differ} prompts"


@pytest.mark.timeout(300)
def test_mixed_batch_equals_each_alone_and_peft(
        lora_dirs: dict[str, Path], prompt_ids: list[list[int]],
        reference: dict[str | None, list[list[int]]],
        reference_prompt_logprobs: list[list[float]]) -> None:
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                **ENGINE_ARGS) as engine:
        scored = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0},
                                 lora_path=MIXED, return_logprob=True, logprob_start_len=0)
        mixed = _mixed(engine, prompt_ids)
        alone = {name: [o["output_ids"] for o in engine.generate(
            input_ids=prompt_ids, sampling_params=GREEDY, lora_path=name)]
            for name in (None, *ADAPTERS)}
        # Running each prompt again under every adapter reads the prefix cache the mixed
        # batch filled: any KV shared across adapters would change these tokens.
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    assert mixed == _expected(reference)
    for name in (None, *ADAPTERS):
        assert alone[name] == reference[name], name
    for out, expected in zip(scored, reference_prompt_logprobs, strict=True):
        got = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
        assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.timeout(300)
def test_every_row_on_adapter_zero_changes_tokens(
        lora_dirs: dict[str, Path], prompt_ids: list[list[int]],
        reference: dict[str | None, list[list[int]]], monkeypatch: pytest.MonkeyPatch) -> None:
    build = serving.LoraBatch.build

    def first_slot_for_all(request_slots: list[int], *args: Any, **kwargs: Any) -> Any:
        return build([0 if slot != NO_SLOT else NO_SLOT for slot in request_slots],
                     *args, **kwargs)

    monkeypatch.setattr(serving.LoraBatch, "build", first_slot_for_all)
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                **ENGINE_ARGS) as engine:
        broken = _mixed(engine, prompt_ids)
    assert broken != _expected(reference)


def test_unknown_adapter_is_refused(lora_dirs: dict[str, Path]) -> None:
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                **ENGINE_ARGS) as engine, pytest.raises(ValueError, match="lora_path"):
        engine.generate("hello", GREEDY, lora_path="nope")


@pytest.mark.timeout(300)
def test_two_ranks_give_the_mixed_batch_s_tokens(
        lora_dirs: dict[str, Path], prompt_ids: list[list[int]],
        reference: dict[str | None, list[list[int]]]) -> None:
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                tp_size=2, **{**ENGINE_ARGS, "launch_mode": "process"}) as engine:
        mixed = _mixed(engine, prompt_ids)
    assert mixed == _expected(reference)


def test_weights_update_with_adapters_loaded(
        lora_dirs: dict[str, Path], prompt_ids: list[list[int]],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """New base weights go under the adapters: an adapter then runs on the new base, as
    transformers + peft merged onto it do."""
    import peft

    other = make_tiny_checkpoint(tmp_path_factory.mktemp("other_base"), "llama", seed=22)
    merged = peft.PeftModel.from_pretrained(reference_model(other),
                                            lora_dirs["all8"]).merge_and_unload()
    expected = transformers_greedy(merged.double(), prompt_ids[0], NEW_TOKENS)[0]
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                **ENGINE_ARGS) as engine:
        before = engine.generate(input_ids=prompt_ids[0], sampling_params=GREEDY,
                                 lora_path="all8")["output_ids"]
        reply = engine.update_weights_from_disk(str(other))
        assert reply.success, reply.message
        after = engine.generate(input_ids=prompt_ids[0], sampling_params=GREEDY,
                                lora_path="all8")["output_ids"]
    assert after == expected != before


def test_adapters_over_an_int8_base_match_peft_on_its_dequantized_weights(
        lora_dirs: dict[str, Path], prompt_ids: list[list[int]], tmp_path: Path) -> None:
    """``--quantization int8`` under the adapters: each linear layer is quantized as it
    loads, and the adapters, built on the quantized layers, add their products to the
    int8 ones, as peft merged onto the base with its int8-dequantized weights does."""
    import shutil

    import peft
    from safetensors.torch import load_file, save_file

    from framework.layers.quantization.checkpoint_writer import is_target
    from framework.layers.quantization.int8 import Int8Weight

    dequantized = tmp_path / "int8_dequantized"
    shutil.copytree(lora_dirs["base"], dequantized)
    weights = load_file(str(lora_dirs["base"] / "model.safetensors"))
    for name, tensor in weights.items():
        if is_target(name, tensor):
            weights[name] = Int8Weight.from_float(tensor).dequantize().contiguous()
    save_file(weights, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    models = {}
    for name in (None, *ADAPTERS):
        model = reference_model(dequantized)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, lora_dirs[name]).merge_and_unload()
        models[name] = model.double()
    expected = [transformers_greedy(models[name], ids, NEW_TOKENS)[0]
                for ids, name in zip(prompt_ids, MIXED, strict=True)]
    with Engine(model_path=str(lora_dirs["base"]), lora_paths=_lora_paths(lora_dirs),
                quantization="int8", quantized_linear_backend="torch",
                **ENGINE_ARGS) as engine:
        assert _mixed(engine, prompt_ids) == expected
