"""Tests for ``scripts/train_default_model.py`` and the shipped default model.

A tiny run of the training script (a dozen steps of a 2-layer model on a few
standard-library files) must produce a checkpoint that transformers loads
offline, whose model card tells the truth about it, and whose loss fell; the
pieces (loss, learning-rate schedule, batching, command line) are checked
against independent computations. The last test checks the model shipped in
``framework/default_model/`` the same way, and fails, naming the command that
makes it, when its files are missing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

import framework.default_model
from framework.default_model import (
    DEFAULT_MODEL_FILES,
    TRAINING_COMMAND,
    default_draft_model_path,
    default_model_path,
    missing_default_model_files,
)
from tests.model_fixtures import single_threaded_torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"
SHIPPED_WEIGHTS_LIMIT_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    """The training script as a module (offline settings undone afterwards)."""
    with pytest.MonkeyPatch.context() as patch, single_threaded_torch():
        # The script forces these on import; the patch restores them for other tests.
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # dataclasses look their module up in sys.modules.
        patch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        yield module


def tiny_config(script: ModuleType, output: Path, **overrides: Any) -> Any:
    """A training config that runs in a few seconds: 2 layers, a dozen steps, 12 files."""
    values: dict[str, Any] = dict(
        output=output, steps=12, seed=3, batch_size=4, seq_len=32, learning_rate=1e-2,
        warmup_steps=2, vocab_size=320, hidden_size=32, num_layers=2, num_heads=2,
        num_kv_heads=1, intermediate_size=64, max_position_embeddings=128, threads=1,
        log_every=4, eval_every=8, eval_batches=2, holdout_every=4, max_files=12,
        sample_new_tokens=12,
    )
    values.update(overrides)
    return script.TrainingConfig(**values)


@pytest.fixture(scope="module")
def tiny_run(script: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The result of one tiny training run (its output directory is ``config.output``)."""
    return script.train(tiny_config(script, tmp_path_factory.mktemp("tiny") / "model"))


def load_offline(directory: Path) -> tuple[Any, Any]:
    """Model (float32, eval mode) and tokenizer from ``directory``, never downloading."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    return model.to(torch.float32).eval(), tokenizer


@torch.no_grad()
def greedy_text(model: Any, tokenizer: Any, prompt: str, length: int) -> str:
    """Greedy continuation by full re-computation (no KV cache), until ``length`` characters
    of continuation or the end-of-text token."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    prompt_len = len(ids)
    text = ""
    while len(text) < length:
        next_id = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        ids.append(next_id)
        text = tokenizer.decode(ids[prompt_len:])
    return text


def as_int(text: str) -> int:
    """An integer written with thousands separators."""
    return int(text.replace(",", ""))


def assert_card_matches_checkpoint(script: ModuleType, directory: Path) -> None:
    """The model card's facts and sample agree with the files in ``directory``."""
    # Bytes, not read_text(): newline translation would alter a sample holding "\r".
    card = (directory / "README.md").read_bytes().decode()
    facts = script.read_card_facts(card)
    weights = directory / "model.safetensors"
    config = json.loads((directory / "config.json").read_text())
    model, tokenizer = load_offline(directory)

    with safe_open(str(weights), framework="pt") as handle:
        stored = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118
        stored_parameters = sum(math.prod(tensor.get_shape()) for tensor in stored.values())
        assert {tensor.get_dtype() for tensor in stored.values()} == {"BF16"}
    assert not any(name.startswith("lm_head") for name in stored), "embeddings must be tied"
    assert as_int(facts[script.FACT_PARAMETERS]) == stored_parameters
    assert sum(p.numel() for p in model.parameters()) == stored_parameters
    assert as_int(facts[script.FACT_WEIGHTS_BYTES]) == weights.stat().st_size
    assert facts[script.FACT_WEIGHTS_SHA256] == hashlib.sha256(weights.read_bytes()).hexdigest()

    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
    card_config = {
        script.FACT_VOCAB_SIZE: "vocab_size", script.FACT_HIDDEN_SIZE: "hidden_size",
        script.FACT_LAYERS: "num_hidden_layers", script.FACT_HEADS: "num_attention_heads",
        script.FACT_KV_HEADS: "num_key_value_heads",
        script.FACT_INTERMEDIATE: "intermediate_size",
    }
    for fact, key in card_config.items():
        assert as_int(facts[fact]) == config[key], fact
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"] == config["bos_token_id"]

    history = script.read_loss_history(directory / "loss_history.csv")
    assert as_int(facts[script.FACT_STEPS]) == history[-1].step
    assert as_int(facts[script.FACT_TOKENS_SEEN]) == history[-1].tokens_seen

    sample = script.read_card_sample(card)
    prompt = script.SAMPLE_PROMPT
    assert sample.startswith(prompt)
    expected = sample[len(prompt):]
    assert greedy_text(model, tokenizer, prompt, len(expected)) == expected


def test_tiny_run_loads_offline_with_transformers(script: ModuleType, tiny_run: Any) -> None:
    directory = Path(tiny_run.config.output)
    model, tokenizer = load_offline(directory)
    config = tiny_run.config
    assert model.config.hidden_size == config.hidden_size
    assert model.config.num_hidden_layers == config.num_layers
    assert model.config.num_key_value_heads == config.num_kv_heads
    assert model.config.vocab_size == len(tokenizer) == config.vocab_size
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    code = "def add(a, b):\n    return a + b  # ünïcode\n"
    ids = tokenizer.encode(code)
    assert tokenizer.decode(ids) == code
    assert tokenizer.eos_token_id not in ids, "encoding must not add special tokens"
    special = tokenizer.convert_tokens_to_ids(script.SPECIAL_TOKEN)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == special
    assert model.config.eos_token_id == model.generation_config.eos_token_id == special


def test_tiny_run_card_matches_checkpoint(script: ModuleType, tiny_run: Any) -> None:
    directory = Path(tiny_run.config.output)
    assert_card_matches_checkpoint(script, directory)
    card = (directory / "README.md").read_text()
    reproduce = next(line for line in card.splitlines()
                     if line.startswith(f"python {script.SCRIPT_PATH}"))
    assert script.parse_args(shlex.split(reproduce)[2:]) == tiny_run.config


def test_tiny_run_writes_history_and_curve_and_loss_falls(
    script: ModuleType, tiny_run: Any
) -> None:
    directory = Path(tiny_run.config.output)
    assert not missing_files(directory)
    history = script.read_loss_history(directory / "loss_history.csv")
    assert [r.step for r in history] == [4, 8, 12]
    assert [r.tokens_seen for r in history] == [4 * 128, 8 * 128, 12 * 128]
    assert [r.validation_loss is not None for r in history] == [False, True, True]
    # A fresh model predicts nearly uniformly: loss close to ln(vocabulary).
    assert abs(history[0].train_loss - math.log(tiny_run.config.vocab_size)) < 0.6
    assert history[-1].train_loss < history[0].train_loss - 0.3
    assert history[-1].validation_loss < history[1].validation_loss
    assert (directory / "loss_curve.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def missing_files(directory: Path) -> list[str]:
    """The names in ``DEFAULT_MODEL_FILES`` that ``directory`` lacks."""
    return [name for name in DEFAULT_MODEL_FILES if not (directory / name).is_file()]


def test_same_seed_gives_same_weights(script: ModuleType, tmp_path: Path) -> None:
    again = script.train(tiny_config(script, tmp_path / "again", steps=4, log_every=2,
                                     eval_every=4))
    once_more = script.train(tiny_config(script, tmp_path / "once_more", steps=4, log_every=2,
                                         eval_every=4))
    other_seed = script.train(tiny_config(script, tmp_path / "other", steps=4, log_every=2,
                                          eval_every=4, seed=4))

    def digest(result: Any) -> str:
        return hashlib.sha256((Path(result.config.output) / "model.safetensors").read_bytes()
                              ).hexdigest()

    assert digest(again) == digest(once_more)
    assert digest(again) != digest(other_seed)


def test_overfits_a_fixed_batch(script: ModuleType) -> None:
    config = tiny_config(script, Path("unused"), learning_rate=1e-2)
    texts = [path.read_text() for path in script.list_source_files(
        script.stdlib_source_dir(), max_files=4)]
    tokenizer = script.train_tokenizer(texts, config.vocab_size)
    batch = script.split_windows(script.encode_documents(tokenizer, texts), config.seq_len)[:4]
    torch.manual_seed(0)
    model = script.build_model(config, tokenizer)
    optimizer = script.make_optimizer(model, config)
    losses = [script.train_step(model, optimizer, batch, config.learning_rate, config.grad_clip)
              for _ in range(40)]
    assert losses[-1] < 0.25 * losses[0], losses


def test_loss_matches_float64_reference(script: ModuleType) -> None:
    config = tiny_config(script, Path("unused"))
    tokenizer = script.train_tokenizer(["def f(x):\n    return x * 2\n"] * 20, config.vocab_size)
    torch.manual_seed(1)
    model = script.build_model(config, tokenizer).eval()
    batch = torch.randint(0, len(tokenizer), (3, config.seq_len + 1))
    with torch.no_grad():
        loss = script.language_model_loss(model, batch)
        logits = model(input_ids=batch[:, :-1]).logits.double()
    log_probs = logits.log_softmax(-1).gather(-1, batch[:, 1:].unsqueeze(-1))
    assert float(loss) == pytest.approx(float(-log_probs.mean()), rel=1e-5)


def test_learning_rate_warms_up_then_follows_cosine(script: ModuleType) -> None:
    config = tiny_config(script, Path("unused"), steps=110, warmup_steps=10,
                         learning_rate=2e-3, min_lr_ratio=0.1)
    peak, floor = 2e-3, 2e-4
    rates = [script.learning_rate_at(step, config) for step in range(config.steps)]
    assert rates[0] == pytest.approx(peak / 10)
    assert rates[9] == pytest.approx(peak)
    assert rates[-1] == pytest.approx(floor)
    for step in (10, 30, 59, 100):
        progress = (step - 10) / (config.steps - 1 - 10)
        expected = floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
        assert rates[step] == pytest.approx(expected)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))


def test_sampler_visits_each_window_once_per_epoch(script: ModuleType) -> None:
    stream = torch.arange(1 + 10 * 8)
    windows = script.split_windows(stream, 8)
    assert windows.shape == (10, 9)
    assert torch.equal(windows[:, 1:], windows[:, :-1] + 1)
    sampler = script.WindowSampler(windows, batch_size=2, seed=5)
    firsts = torch.cat([sampler.next_batch()[:, 0] for _ in range(5)])
    assert sorted(firsts.tolist()) == list(range(0, 80, 8))
    twin = script.WindowSampler(windows, batch_size=2, seed=5)
    assert torch.equal(torch.cat([twin.next_batch()[:, 0] for _ in range(5)]), firsts)
    sampler.next_batch()
    assert sampler.epochs_started == 2


def test_repeat_windows_re_emit_a_span_of_themselves_with_few_edits(
        script: ModuleType) -> None:
    windows = script.split_windows(torch.arange(1 + 40 * 64), 64)
    plain = script.WindowSampler(windows, batch_size=8, seed=3)
    repeating = script.WindowSampler(windows, batch_size=8, seed=3, repeat_fraction=1.0)
    # The first epoch's order is drawn before any repeat: the same windows, row for row.
    edits = []
    for _ in range(4):
        originals, batch = plain.next_batch(), repeating.next_batch()
        assert batch.shape == originals.shape
        for original, window in zip(originals, batch, strict=True):
            spans = [span for span in range(65 // 8, 65 // 2 + 1)
                     if torch.equal(window[:span], original[:span])
                     and (window[span:] != original[:65 - span]).sum() <= 2]
            assert len(spans) == 1, (original.tolist(), window.tolist())
            span = spans[0]
            changed = (window[span:] != original[:65 - span]).nonzero().flatten()
            assert all(at < span for at in changed.tolist())
            edits.append(len(changed))
    assert set(edits) == {0, 1, 2}
    assert torch.equal(script.WindowSampler(windows, 8, 3, repeat_fraction=0.0).next_batch(),
                       script.WindowSampler(windows, 8, 3).next_batch())


def test_source_files_are_sorted_and_skip_excluded_dirs(script: ModuleType) -> None:
    root = script.stdlib_source_dir()
    files = script.list_source_files(root)
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert "os.py" in relative
    assert not any(set(name.split("/")[:-1]) & script.EXCLUDED_DIRS for name in relative)
    assert script.list_source_files(root, max_files=3) == files[:3]


@pytest.mark.parametrize("overrides", [
    {"hidden_size": 30, "num_heads": 4},
    {"num_heads": 4, "num_kv_heads": 3},
    {"steps": 0},
    {"repeat_fraction": 1.5},
    {"vocab_size": 200},
    {"seq_len": 256, "max_position_embeddings": 128},
])
def test_invalid_config_is_rejected(script: ModuleType, overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        tiny_config(script, Path("unused"), **overrides)


def test_default_model_path_names_missing_files(monkeypatch: pytest.MonkeyPatch) -> None:
    package_dir = Path(framework.default_model.__file__).resolve().parent
    monkeypatch.setattr(framework.default_model, "DEFAULT_MODEL_FILES", ("__init__.py",))
    assert Path(default_model_path()) == package_dir
    monkeypatch.setattr(framework.default_model, "DEFAULT_MODEL_FILES",
                        ("__init__.py", "absent.safetensors"))
    assert missing_default_model_files() == ["absent.safetensors"]
    with pytest.raises(FileNotFoundError, match=r"absent\.safetensors.*--output"):
        default_model_path()


def test_shipped_default_model_matches_its_card(script: ModuleType) -> None:
    missing = missing_default_model_files()
    if missing:
        pytest.fail(f"the shipped default model lacks {', '.join(missing)}: run "
                    f"`{TRAINING_COMMAND}` (about 20 minutes on 2 CPU cores) from the "
                    "repository root to make it")
    directory = Path(default_model_path())
    assert (directory / "model.safetensors").stat().st_size <= SHIPPED_WEIGHTS_LIMIT_BYTES
    assert_card_matches_checkpoint(script, directory)
    history = script.read_loss_history(directory / "loss_history.csv")
    assert history[-1].train_loss < history[0].train_loss - 2.0
    completion = script.read_card_sample((directory / "README.md").read_text())
    body = completion.split("\n")[1:]
    assert body and body[0].startswith("    "), "the completion should be an indented body"


def test_a_draft_run_reuses_the_teacher_s_tokenizer_and_starts_from_its_weights(
        script: ModuleType, tiny_run: Any, tmp_path: Path) -> None:
    teacher_dir = Path(tiny_run.config.output)
    config = tiny_config(script, tmp_path / "draft", num_layers=1, steps=4, teacher=teacher_dir)
    teacher, _ = script.load_checkpoint(teacher_dir)
    torch.manual_seed(0)
    draft = script.build_model(config, script.load_checkpoint(teacher_dir)[1])
    # The embedding (and the output layer tied to it), layer 0's nine tensors, the norm.
    assert script.copy_matching_weights(teacher, draft) == 2 + 9 + 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight,
                       teacher.model.layers[0].mlp.up_proj.weight)
    script.train(config)
    assert (tmp_path / "draft" / "tokenizer.json").read_bytes() == (
        teacher_dir / "tokenizer.json").read_bytes()
    assert_card_matches_checkpoint(script, tmp_path / "draft")
    assert "--teacher" in (tmp_path / "draft" / "README.md").read_text()


def test_the_distillation_loss_is_the_soft_cross_entropy_in_float64(
        script: ModuleType, tiny_run: Any) -> None:
    teacher, _ = script.load_checkpoint(Path(tiny_run.config.output))
    student = script.build_model(tiny_config(script, Path("unused"), num_layers=1),
                                 script.load_checkpoint(Path(tiny_run.config.output))[1])
    batch = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p = torch.softmax(teacher(input_ids=batch[:, :-1]).logits.double(), dim=-1)
        log_q = torch.log_softmax(student(input_ids=batch[:, :-1]).logits.double(), dim=-1)
        expected = float(-(p * log_q).sum(dim=-1).mean())
        got = float(script.distillation_loss(student, teacher, batch))
    assert math.isclose(got, expected, rel_tol=1e-5)


def test_shipped_draft_model_matches_its_card_and_the_default_model_s_tokenizer(
        script: ModuleType) -> None:
    directory = Path(default_draft_model_path())
    assert (directory / "model.safetensors").stat().st_size <= SHIPPED_WEIGHTS_LIMIT_BYTES
    assert_card_matches_checkpoint(script, directory)
    default = Path(default_model_path())
    assert (directory / "tokenizer.json").read_bytes() == (default / "tokenizer.json").read_bytes()
    card = (directory / "README.md").read_text()
    assert "--teacher framework/default_model" in card
    draft_layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    default_layers = json.loads((default / "config.json").read_text())["num_hidden_layers"]
    assert draft_layers < default_layers
