#!/usr/bin/env python
"""Train the embedded default model: a tiny Llama that completes Python code.

The model and its byte-level BPE tokenizer are trained from scratch on the
Python standard library's own source files (PSF licence), which every machine
with Python has, so the run needs no download and no data set. The output
directory is a Hugging Face checkpoint (``config.json``,
``generation_config.json``, ``model.safetensors`` in bfloat16 with tied
embeddings, ``tokenizer.json``, ``tokenizer_config.json``) plus the model card
``README.md``, the loss history ``loss_history.csv`` and ``loss_curve.png``.

The shipped model in ``framework/default_model/`` is made by::

    python scripts/train_default_model.py --output framework/default_model

With ``--teacher DIR`` the run makes a draft model of a trained one instead (for
speculative decoding): it reuses the teacher's tokenizer, starts from the teacher's
embedding, first layers and final norm where their shapes match, and learns the teacher's
next-token distributions on the same windows (soft cross-entropy). The shipped draft in
``framework/default_model/draft/`` is made so (its card records the command).

(the model card records the exact command with every option). For a quick
try, pass ``--steps 50 --output /tmp/tiny``. The same seed, options, Python
version and thread count give the same weights.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import re
import shlex
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import tokenizers
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Never reach the Hugging Face Hub: everything this script loads is local. Set before
# transformers is imported, because huggingface_hub reads it at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger("train_default_model")

SPECIAL_TOKEN = "<|endoftext|>"
SAMPLE_PROMPT = "def fibonacci(n):"
# The chat template: every turn but the model's as comment lines, so that a chat prompt
# looks like the Python the model was trained on and its answer is code.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '# assistant:\\n' + message['content'] + '\\n' }}\n"
    "{%- else %}\n"
    "{{- '# ' + message['role'] + ': ' + message['content'] | replace('\\n', '\\n# ') "
    "+ '\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '# assistant:\\n' }}\n"
    "{%- endif %}\n"
)
SCRIPT_PATH = "scripts/train_default_model.py"

# Directories of the standard library that are not ordinary code: tests, third-party
# packages, codec lookup tables (encodings/) and the pydoc topic strings (pydoc_data/).
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
     "encodings", "pydoc_data"}
)

# Names of the facts table rows in the model card; read back by ``read_card_facts``.
FACT_PARAMETERS = "Parameters"
FACT_WEIGHTS_BYTES = "model.safetensors bytes"
FACT_WEIGHTS_SHA256 = "model.safetensors sha256"
FACT_VOCAB_SIZE = "Vocabulary size"
FACT_HIDDEN_SIZE = "Hidden size"
FACT_LAYERS = "Layers"
FACT_HEADS = "Attention heads"
FACT_KV_HEADS = "Key/value heads"
FACT_INTERMEDIATE = "MLP intermediate size"
FACT_STEPS = "Training steps"
FACT_TOKENS_SEEN = "Training tokens seen"


@dataclass(frozen=True)
class TrainingConfig:
    """Every choice of a training run; the defaults are those of the shipped model."""

    output: Path
    steps: int = 3600
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    threads: int = 2
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    holdout_every: int = 25
    max_files: int | None = None
    source_dir: Path | None = None
    sample_new_tokens: int = 80
    teacher: Path | None = None
    #: The share of training windows that repeat a span of themselves (``WindowSampler``).
    repeat_fraction: float = 0.25

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "seq_len", "vocab_size", "hidden_size", "num_layers",
                    "num_heads", "num_kv_heads", "intermediate_size", "threads", "log_every",
                    "eval_every", "eval_batches", "holdout_every", "sample_new_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.vocab_size <= 257:
            raise ValueError("vocab_size must exceed the 256 byte symbols plus the special token")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must not exceed max_position_embeddings")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("learning_rate must be positive; warmup_steps and weight_decay "
                             "must not be negative")
        if not 0.0 <= self.repeat_fraction <= 1.0:
            raise ValueError(f"repeat_fraction must be in [0, 1], got {self.repeat_fraction}")
        if self.max_files is not None and self.max_files < 2:
            raise ValueError("max_files must be at least 2 (training and held-out files)")

    @property
    def tokens_per_step(self) -> int:
        """Tokens predicted per optimizer step."""
        return self.batch_size * self.seq_len


@dataclass
class Corpus:
    """The training text: source files split into training and held-out sets."""

    root: Path
    train_files: list[Path]
    holdout_files: list[Path]
    train_texts: list[str]
    holdout_texts: list[str]
    sha256: str

    @property
    def train_bytes(self) -> int:
        """UTF-8 size of the training text."""
        return sum(len(text.encode()) for text in self.train_texts)

    @property
    def holdout_bytes(self) -> int:
        """UTF-8 size of the held-out text."""
        return sum(len(text.encode()) for text in self.holdout_texts)


@dataclass
class LogRecord:
    """One row of the loss history."""

    step: int
    tokens_seen: int
    learning_rate: float
    train_loss: float
    validation_loss: float | None
    elapsed_s: float


@dataclass
class TrainingResult:
    """What a run produced and measured; the model card is written from it."""

    config: TrainingConfig
    history: list[LogRecord] = field(default_factory=list)
    parameters: int = 0
    embedding_parameters: int = 0
    train_tokens: int = 0
    holdout_tokens: int = 0
    tokenizer_seconds: float = 0.0
    training_seconds: float = 0.0
    final_train_loss: float = math.nan
    final_validation_loss: float = math.nan
    special_token_id: int = 0
    sample_completion: str = ""


def stdlib_source_dir() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path, max_files: int | None = None) -> list[Path]:
    """The ``*.py`` files under ``root``, sorted by relative path, minus ``EXCLUDED_DIRS``."""
    if not root.is_dir():
        raise ValueError(f"source directory {str(root)!r} does not exist")
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        # Pruning here keeps the walk out of site-packages, which can be huge.
        subdirectories[:] = [name for name in subdirectories if name not in EXCLUDED_DIRS]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    files.sort(key=lambda path: path.relative_to(root).as_posix())
    if max_files is not None:
        files = files[:max_files]
    if len(files) < 2:
        raise ValueError(f"found {len(files)} Python files under {str(root)!r}; need at least 2")
    return files


def load_corpus(root: Path, max_files: int | None, holdout_every: int) -> Corpus:
    """Read the source files; every ``holdout_every``-th file is held out for validation."""
    files = list_source_files(root, max_files)
    digest = hashlib.sha256()
    corpus = Corpus(root=root, train_files=[], holdout_files=[], train_texts=[],
                    holdout_texts=[], sha256="")
    for index, path in enumerate(files):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            logger.warning("skipping %s: not UTF-8", path)
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + raw + b"\0")
        # The middle file of each group of ``holdout_every`` is held out, so that small
        # corpora (tests) still get one when holdout_every is small.
        if index % holdout_every == holdout_every // 2 and holdout_every > 1:
            corpus.holdout_files.append(path)
            corpus.holdout_texts.append(text)
        else:
            corpus.train_files.append(path)
            corpus.train_texts.append(text)
    if not corpus.train_texts or not corpus.holdout_texts:
        raise ValueError(f"{len(files)} files give no training or no held-out text; "
                         "use more files or a smaller holdout_every")
    corpus.sha256 = digest.hexdigest()
    return corpus


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``; ``SPECIAL_TOKEN`` is BOS, EOS and pad.

    No token is added when encoding (no BOS), as for GPT-2: documents are separated by
    ``SPECIAL_TOKEN`` in training, and prompts are plain code.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:
    """All documents as one 1-D int64 stream, each followed by the end-of-text token."""
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    stream: list[int] = []
    for encoding in encodings:
        stream.extend(encoding.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int64)


def split_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the next-token targets)."""
    count = (stream.numel() - 1) // seq_len
    if count < 1:
        raise ValueError(f"a stream of {stream.numel()} tokens is too short for seq_len {seq_len}")
    starts = torch.arange(count) * seq_len
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]


#: Tokens changed in each repeated span (``WindowSampler``): none to this many, at random.
REPEAT_MAX_EDITS = 2


class WindowSampler:
    """Batches of training windows: each epoch visits every window once, in seeded order.

    With ``repeat_fraction``, that share of the windows (drawn per window) become a span
    of their text followed by the same span again, with up to ``REPEAT_MAX_EDITS`` of its
    tokens replaced, then the text that followed the span: code re-emitted with small
    edits. The standard library repeats itself too rarely for a model this small to learn
    to copy from its context, and speculative decoding by prompt lookup or by a draft
    model gains on such copies only when the model makes them.
    """

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int,
                 repeat_fraction: float = 0.0) -> None:
        if windows.shape[0] < batch_size:
            raise ValueError(f"only {windows.shape[0]} windows of training text for "
                             f"batch size {batch_size}; lower seq_len or batch_size")
        self.windows = windows
        self.batch_size = batch_size
        self.repeat_fraction = repeat_fraction
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(windows.shape[0], generator=self.generator)
        self.cursor = 0
        self.epochs_started = 1

    def next_batch(self) -> torch.Tensor:
        """The next ``[batch_size, seq_len + 1]`` batch; reshuffles when an epoch ends."""
        if self.cursor + self.batch_size > self.order.numel():
            self.order = torch.randperm(self.windows.shape[0], generator=self.generator)
            self.cursor = 0
            self.epochs_started += 1
        indices = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        batch = self.windows[indices]
        if self.repeat_fraction:
            chosen = torch.rand(len(batch), generator=self.generator) < self.repeat_fraction
            for row in chosen.nonzero().flatten().tolist():
                batch[row] = self._repeated(batch[row])
        return batch

    def _repeated(self, window: torch.Tensor) -> torch.Tensor:
        """``window``'s first ``span`` tokens, then its text from the start again (edited)."""
        length = window.numel()
        span = int(torch.randint(length // 8, length // 2 + 1, (1,), generator=self.generator))
        edits = int(torch.randint(0, REPEAT_MAX_EDITS + 1, (1,), generator=self.generator))
        copy = window[:length - span].clone()
        at = torch.randint(0, span, (edits,), generator=self.generator)
        copy[at] = window[torch.randint(0, length, (edits,), generator=self.generator)]
        return torch.cat([window[:span], copy])


def build_model(config: TrainingConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialized float32 Llama sized by ``config`` (seeded by the caller)."""
    special_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
    )
    return LlamaForCausalLM(llama_config)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def make_optimizer(model: torch.nn.Module, config: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm scales)."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95), eps=1e-8)


def learning_rate_at(step: int, config: TrainingConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` of the peak.

    ``step`` counts from 0; the last step (``steps - 1``) gets the minimum.
    """
    peak = config.learning_rate
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = peak * config.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def language_model_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a ``[B, seq_len + 1]`` batch of windows."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def distillation_loss(model: LlamaForCausalLM, teacher: LlamaForCausalLM,
                      batch: torch.Tensor) -> torch.Tensor:
    """Mean soft cross-entropy of ``model``'s next-token distributions against ``teacher``'s
    on a ``[B, seq_len + 1]`` batch (the KL divergence plus the teacher's entropy): a draft
    trained on it learns to predict what the teacher will say, not only the text."""
    inputs = batch[:, :-1]
    with torch.no_grad():
        teacher.eval()
        target = torch.softmax(teacher(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           target.reshape(-1, target.shape[-1]))


def copy_matching_weights(teacher: LlamaForCausalLM, model: LlamaForCausalLM) -> int:
    """Copy each of ``teacher``'s tensors that ``model`` has under the same name and shape
    (the embedding, the first layers, the final norm); returns how many were copied."""
    source = teacher.state_dict()
    copied = 0
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
                copied += 1
    return copied


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               learning_rate: float, grad_clip: float,
               teacher: LlamaForCausalLM | None = None) -> float:
    """One optimizer step on ``batch`` at ``learning_rate``; returns the loss before the step.

    The loss is against the text, or against ``teacher``'s distributions when given.
    """
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    model.train()
    loss = language_model_loss(model, batch) if teacher is None \
        else distillation_loss(model, teacher, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean loss over the given held-out windows (every window has the same length)."""
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start:start + batch_size]
        total += float(language_model_loss(model, batch)) * batch.shape[0]
    return total / windows.shape[0]


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                    output: Path) -> None:
    """Save the model in bfloat16 safetensors and the tokenizer, in Hugging Face's layout."""
    output.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    # A copy, so that the caller's float32 model stays as it was.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(output, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(output)
    # transformers 5 records its own class name, which 4.x's AutoTokenizer does not know;
    # both map the 4.x name to their fast tokenizer.
    config_path = output / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for loading_option in ("is_local", "local_files_only"):  # a teacher's, loaded offline
        tokenizer_config.pop(loading_option, None)
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def load_checkpoint(path: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load a saved checkpoint offline, the model in float32 for CPU inference."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.to(torch.float32).eval(), tokenizer


@torch.no_grad()
def greedy_completion(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                      prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt`` (without the prompt), stopping at end of text."""
    input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def write_loss_history(history: Sequence[LogRecord], path: Path) -> None:
    """The loss history as CSV (validation_loss empty where none was measured)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "tokens_seen", "learning_rate", "train_loss", "validation_loss",
                         "elapsed_s"])
        for record in history:
            writer.writerow([
                record.step, record.tokens_seen, f"{record.learning_rate:.6g}",
                f"{record.train_loss:.5f}",
                "" if record.validation_loss is None else f"{record.validation_loss:.5f}",
                f"{record.elapsed_s:.2f}",
            ])


def read_loss_history(path: Path) -> list[LogRecord]:
    """The records written by ``write_loss_history``."""
    with path.open(newline="") as handle:
        return [
            LogRecord(
                step=int(row["step"]), tokens_seen=int(row["tokens_seen"]),
                learning_rate=float(row["learning_rate"]), train_loss=float(row["train_loss"]),
                validation_loss=float(row["validation_loss"]) if row["validation_loss"] else None,
                elapsed_s=float(row["elapsed_s"]),
            )
            for row in csv.DictReader(handle)
        ]


def plot_loss_curve(history: Sequence[LogRecord], config: TrainingConfig, parameters: int,
                    path: Path) -> None:
    """Training and held-out loss against steps, as a PNG."""
    # The object-oriented API needs no pyplot state and no display.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), dpi=100)
    axes = figure.subplots()
    axes.plot([r.step for r in history], [r.train_loss for r in history],
              label=f"training (mean of each {config.log_every} steps)", linewidth=1.2)
    evaluated = [r for r in history if r.validation_loss is not None]
    axes.plot([r.step for r in evaluated], [r.validation_loss for r in evaluated], "o-",
              label="held-out files", markersize=4)
    axes.set_xlabel(f"step ({config.tokens_per_step} tokens each)")
    axes.set_ylabel("cross-entropy (nats per token)")
    axes.set_title(f"Default model: {parameters / 1e6:.2f}M parameters, "
                   f"{config.steps} steps on the Python standard library")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def config_to_command(config: TrainingConfig) -> str:
    """The command line that repeats a run with ``config`` (every option spelled out)."""
    args = ["python", SCRIPT_PATH]
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if value is None:
            continue
        args += ["--" + item.name.replace("_", "-"), str(value)]
    return shlex.join(args)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cpu_name() -> str:
    """The processor's marketing name where the OS tells it, else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        if match:
            return match.group(1).strip()
    return platform.processor() or platform.machine()


def code_fence(text: str) -> str:
    """A backtick fence longer than any backtick run inside ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def introduction(config: TrainingConfig, result: TrainingResult) -> str:
    """The model card's first paragraph: what the model is and what it is for."""
    size = f"{result.parameters / 1e6:.1f}M-parameter Llama"
    if config.teacher is not None:
        return f"""A {size}, the draft model of the default model (`{config.teacher}`) for
speculative decoding (`--speculative-algorithm draft`): it proposes tokens that the default
model verifies. It reuses the default model's tokenizer (the tokenizer section below
describes that one), starts from the default model's embedding, first layer(s) and final
norm, and was trained on the same windows to predict the default model's next-token
distributions (soft cross-entropy against them: the training losses below are that; the
held-out loss is against the text)."""
    return f"""A {size}, trained from scratch with its own byte-level
BPE tokenizer on the source code of the Python standard library. `framework serve` and
`framework.Engine()` use it when no model path is given, so that the runtime works offline
out of the box: in tests, demos and benchmarks of the serving machinery. It continues
Python code; at this size the output has the shape of Python but is rarely correct, and
the model cannot follow instructions. Its chat template (below) makes `/v1/chat/completions`
work, for tests and demos of the chat route."""


def repeat_paragraph(config: TrainingConfig) -> str:
    """The card's words on the repeated windows (``WindowSampler``); none without them."""
    if not config.repeat_fraction:
        return ""
    return f"""
Of the windows, {config.repeat_fraction:.0%} (drawn per window) are rewritten as a span of
their text (an eighth to a half of the window) followed by the same span again, with up to
{REPEAT_MAX_EDITS} of its tokens replaced, then the text that followed the span: code
re-emitted with small edits. They teach the model to copy from its context, which the
training text alone did not at this size, and which speculative decoding's prompt lookup
and draft model gain on.
"""


def render_model_card(result: TrainingResult, corpus: Corpus, output: Path) -> str:
    """The model card (``README.md``) text for a finished run saved in ``output``."""
    config = result.config
    weights = output / "model.safetensors"
    sample = SAMPLE_PROMPT + result.sample_completion
    fence = code_fence(sample)
    head_dim = config.hidden_size // config.num_heads
    facts = [
        (FACT_PARAMETERS, f"{result.parameters:,}"),
        ("Embedding parameters (tied with the output layer)", f"{result.embedding_parameters:,}"),
        (FACT_WEIGHTS_BYTES, f"{weights.stat().st_size:,}"),
        (FACT_WEIGHTS_SHA256, file_sha256(weights)),
        (FACT_VOCAB_SIZE, f"{config.vocab_size:,}"),
        (FACT_HIDDEN_SIZE, str(config.hidden_size)),
        (FACT_LAYERS, str(config.num_layers)),
        (FACT_HEADS, str(config.num_heads)),
        (FACT_KV_HEADS, str(config.num_kv_heads)),
        (FACT_INTERMEDIATE, str(config.intermediate_size)),
        ("Training window (tokens)", str(config.seq_len)),
        (FACT_STEPS, f"{config.steps:,}"),
        (FACT_TOKENS_SEEN, f"{config.steps * config.tokens_per_step:,}"),
        ("Epochs over the training text",
         f"{config.steps * config.tokens_per_step / result.train_tokens:.2f}"),
        ("Final training loss (mean of the last log interval)", f"{result.final_train_loss:.4f}"),
        ("Final held-out loss", f"{result.final_validation_loss:.4f}"),
        ("Training time (optimizer loop)", f"{result.training_seconds / 60:.1f} min"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in facts)
    python_version = platform.python_version()
    bytes_per_token = corpus.train_bytes / max(1, result.train_tokens - len(corpus.train_texts))
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- code
- python
- llama
- tiny
---

# framework default model{"'s draft" if config.teacher else ""}: a tiny Python code model

{introduction(config, result)}

## Sample

Greedy completion (transformers `generate`, float32, {config.sample_new_tokens} new tokens at
most) of the prompt `{SAMPLE_PROMPT}`:

{fence}python
{sample}
{fence}

## Facts

| Fact | Value |
| --- | --- |
{table}

## Data

The `*.py` files of the Python {python_version} standard library
(`sysconfig.get_paths()["stdlib"]`), read in sorted order of their relative paths,
without the directories {", ".join(f"`{name}`" for name in sorted(EXCLUDED_DIRS))} (tests,
third-party packages, codec tables and pydoc's topic strings). Every
{config.holdout_every}th file is held out to measure the held-out loss.

- Training files: {len(corpus.train_files):,} ({corpus.train_bytes:,} bytes,
  {result.train_tokens:,} tokens)
- Held-out files: {len(corpus.holdout_files):,} ({corpus.holdout_bytes:,} bytes,
  {result.holdout_tokens:,} tokens)
- SHA-256 of the files read (relative paths and contents): `{corpus.sha256}`

Each file ends with `{SPECIAL_TOKEN}`; the token stream is cut into non-overlapping windows
of {config.seq_len} tokens, visited in a seeded random order, each window once per epoch.
{repeat_paragraph(config)}
## Tokenizer

Byte-level BPE (the `tokenizers` library: ByteLevel pre-tokenizer and decoder, all 256
bytes in the base alphabet, so any text encodes), trained on the training files with a
vocabulary of {config.vocab_size:,} tokens, about {bytes_per_token:.2f} bytes per token on
the training text. `{SPECIAL_TOKEN}` (id {result.special_token_id}) is the BOS, EOS and padding
token; encoding adds no special tokens. Saved as a transformers fast tokenizer, so
`AutoTokenizer.from_pretrained` loads it.

## Chat template

`tokenizer_config.json` holds a chat template, so that `/v1/chat/completions` works out of
the box. The model never saw a conversation, so the template writes one as the Python it
was trained on: a system or user message becomes comment lines (`# user: ` before its
first line, `# ` before each other line), an assistant message is the line `# assistant:`
followed by its text as it is (code), and the generation prompt is `# assistant:` and a
newline, after which the model writes code. Two messages and the generation prompt:

```text
# system: You write Python.
# user: Write a function
# that adds two numbers.
# assistant:
```

## Architecture

`LlamaForCausalLM`: hidden size {config.hidden_size}, {config.num_layers} layers,
{config.num_heads} attention heads of {head_dim} dimensions ({config.num_kv_heads} key/value
heads), SwiGLU MLP of {config.intermediate_size}, RMSNorm, rotary position embeddings,
input and output embeddings tied. `max_position_embeddings` is
{config.max_position_embeddings} so that the runtime accepts longer requests, but training
windows were {config.seq_len} tokens: expect worse text beyond that. Weights are stored in
bfloat16 ({weights.stat().st_size / 1e6:.1f} MB).

## Training

Float32 on CPU with AdamW (betas 0.9 and 0.95, weight decay {config.weight_decay} on
matrices), peak learning rate {config.learning_rate} after {config.warmup_steps} warm-up
steps, cosine decay to {config.min_lr_ratio} of the peak, gradient clipping at
{config.grad_clip}, batches of {config.batch_size} windows of {config.seq_len} tokens,
{config.steps:,} steps, seed {config.seed}. Tokenizer training and data preparation took
{result.tokenizer_seconds:.0f} s, the optimizer loop {result.training_seconds:.0f} s.

- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {config.threads} torch threads,
  {platform.system()} {platform.machine()}
- Software: Python {python_version}, torch {torch.__version__}, transformers
  {transformers.__version__}, tokenizers {tokenizers.__version__}, safetensors
  {safetensors.__version__}

![Loss curve](loss_curve.png)

The loss history is in `loss_history.csv`.

## Reproduce

From the repository root (no network needed):

```bash
{config_to_command(config)}
```

The same options, Python version (hence the same standard library) and thread count give
the same weights.

## Licence

The training text is the Python standard library, under the Python Software Foundation
License Version 2. The weights, tokenizer and this card are distributed with `framework`
under its Apache-2.0 licence; the weights were trained on PSF-licensed text.
"""


def read_card_facts(card: str) -> dict[str, str]:
    """The rows of the model card's facts table, as name → value text."""
    section = card.split("## Facts", 1)[-1].split("\n## ", 1)[0]
    return {match.group(1): match.group(2)
            for match in re.finditer(r"^\| (.+?) \| (.+?) \|$", section, re.MULTILINE)}


def read_card_sample(card: str) -> str:
    """The text of the model card's sample (prompt and completion)."""
    match = re.search(r"^(`{3,})python\n(.*?)\n\1$", card, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError("the model card has no python sample block")
    return match.group(2)


def train(config: TrainingConfig) -> TrainingResult:
    """Train the tokenizer and the model, then write the checkpoint, card and loss files."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    result = TrainingResult(config=config)
    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    corpus = load_corpus(config.source_dir or stdlib_source_dir(), config.max_files,
                         config.holdout_every)
    logger.info("corpus: %d training files (%d bytes), %d held out", len(corpus.train_files),
                corpus.train_bytes, len(corpus.holdout_files))
    teacher = None
    if config.teacher is None:
        tokenizer = train_tokenizer(corpus.train_texts, config.vocab_size)
    else:
        teacher, tokenizer = load_checkpoint(config.teacher)
        teacher.requires_grad_(False)
    result.special_token_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    train_stream = encode_documents(tokenizer, corpus.train_texts)
    holdout_stream = encode_documents(tokenizer, corpus.holdout_texts)
    result.train_tokens, result.holdout_tokens = train_stream.numel(), holdout_stream.numel()
    sampler = WindowSampler(split_windows(train_stream, config.seq_len), config.batch_size,
                            config.seed, config.repeat_fraction)
    holdout_windows = split_windows(holdout_stream, config.seq_len)[
        :config.eval_batches * config.batch_size]
    result.tokenizer_seconds = time.perf_counter() - started
    logger.info("tokenizer: %d tokens; %d training tokens, %d held-out; %.1f s", len(tokenizer),
                result.train_tokens, result.holdout_tokens, result.tokenizer_seconds)

    model = build_model(config, tokenizer)
    if teacher is not None:
        copied = copy_matching_weights(teacher, model)
        logger.info("draft: %d tensors started from the teacher's", copied)
    result.parameters = count_parameters(model)
    result.embedding_parameters = model.get_input_embeddings().weight.numel()
    logger.info("model: %d parameters (%d in the tied embedding)", result.parameters,
                result.embedding_parameters)
    run_training_loop(model, sampler, holdout_windows, result, teacher)

    save_checkpoint(model, tokenizer, output)
    saved_model, saved_tokenizer = load_checkpoint(output)
    result.sample_completion = greedy_completion(saved_model, saved_tokenizer, SAMPLE_PROMPT,
                                                 config.sample_new_tokens)
    logger.info("sample:\n%s%s", SAMPLE_PROMPT, result.sample_completion)
    write_loss_history(result.history, output / "loss_history.csv")
    plot_loss_curve(result.history, config, result.parameters, output / "loss_curve.png")
    (output / "README.md").write_text(render_model_card(result, corpus, output))
    return result


def run_training_loop(model: LlamaForCausalLM, sampler: WindowSampler,
                      holdout_windows: torch.Tensor, result: TrainingResult,
                      teacher: LlamaForCausalLM | None = None) -> None:
    """The optimizer loop: logs every ``log_every`` steps into ``result.history``.

    With a ``teacher``, the training loss is the soft cross-entropy against its
    distributions; the held-out loss is always against the text.
    """
    config = result.config
    optimizer = make_optimizer(model, config)
    started = time.perf_counter()
    interval_losses: list[float] = []
    for step in range(config.steps):
        learning_rate = learning_rate_at(step, config)
        interval_losses.append(train_step(model, optimizer, sampler.next_batch(), learning_rate,
                                          config.grad_clip, teacher))
        done = step + 1
        if done % config.log_every and done != config.steps:
            continue
        validation_loss = None
        if done % config.eval_every == 0 or done == config.steps:
            validation_loss = evaluate(model, holdout_windows, config.batch_size)
        record = LogRecord(step=done, tokens_seen=done * config.tokens_per_step,
                           learning_rate=learning_rate,
                           train_loss=sum(interval_losses) / len(interval_losses),
                           validation_loss=validation_loss,
                           elapsed_s=time.perf_counter() - started)
        result.history.append(record)
        interval_losses.clear()
        log_progress(record, config)
    result.training_seconds = time.perf_counter() - started
    result.final_train_loss = result.history[-1].train_loss
    result.final_validation_loss = float(result.history[-1].validation_loss or math.nan)


def log_progress(record: LogRecord, config: TrainingConfig) -> None:
    """One log line: loss, learning rate, throughput and the time left."""
    steps_per_s = record.step / max(record.elapsed_s, 1e-9)
    remaining_s = (config.steps - record.step) / steps_per_s
    held_out = "" if record.validation_loss is None else f" | held-out {record.validation_loss:.4f}"
    logger.info("step %d/%d | loss %.4f%s | lr %.2e | %.2f steps/s, %.0f tokens/s | "
                "%.0f s, %.0f s left", record.step, config.steps, record.train_loss, held_out,
                record.learning_rate, steps_per_s, steps_per_s * config.tokens_per_step,
                record.elapsed_s, remaining_s)


def parse_args(argv: Sequence[str] | None = None) -> TrainingConfig:
    """A ``TrainingConfig`` from command-line options (one per field, same names)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    for item in dataclasses.fields(TrainingConfig):
        flag = "--" + item.name.replace("_", "-")
        if item.name == "output":
            parser.add_argument(flag, type=Path, required=True,
                                help="directory to write the checkpoint, card and loss files")
            continue
        default = item.default
        kind = {"max_files": int, "source_dir": Path, "teacher": Path}.get(
            item.name, type(default))
        help_text = {"max_files": "use only the first N source files (for quick tries)",
                     "source_dir": "directory of .py files (default: the standard library)",
                     "teacher": "a trained checkpoint to make a draft model of: its "
                                "tokenizer is reused and its distributions learned"}
        parser.add_argument(flag, type=kind, default=default,
                            help=help_text.get(item.name, f"default: {default}"))
    try:
        return TrainingConfig(**vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    config = parse_args(argv)
    result = train(config)
    logger.info("done: final loss %.4f, held-out %.4f, %d parameters, %.0f s of training; "
                "wrote %s", result.final_train_loss, result.final_validation_loss,
                result.parameters, result.training_seconds, config.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
