"""`framework bench offline`: the Engine against transformers ``generate``, and a ceiling.

Five sides run on the same number of torch threads (with ``dp_size`` Engine
replicas, each replica gets its share of them); the first two produce the same
greedy output tokens from the same checkpoint:

* **engine**: ``framework.Engine`` with every prompt in one ``generate`` call
  (continuous batching), ``temperature=0``, ``ignore_eos=True``;
* **transformers**: ``generate`` in batches of ``hf_batch_size`` prompts,
  left-padded, ``do_sample=False``, ``min_new_tokens == max_new_tokens``;
* **ceiling**: the model's linear layers, norms and LM head alone (no
  attention, no sampling) on the job's shapes: every prompt token once, then
  ``output_len - 1`` decode steps of ``num_prompts`` rows. That matrix work
  is what every runtime has to do, and no runtime on these threads can do it
  much faster;
* **decode_ceiling**: the same on the decode steps alone (``output_len`` of
  them, no prefill), a bound on the decode phase;
* **kv_read**: every decode step's keys and values read once, nothing else:
  what decode attention costs at the least. ``ceiling + kv_read`` is a lower
  bound on the Engine's time for the job.

The model is a Llama of the configured shape with random weights from a
fixed seed, written once as a real Hugging Face checkpoint (safetensors plus
the embedded model's tokenizer) that both sides load from disk. The prompts
are random words from a fixed seed, tokenized once by that tokenizer; both
sides get the same token ids.

Other models:

* ``--arch mixtral`` writes a Mixtral of the shape instead: every layer a sparse
  MoE block of ``--num-experts`` experts (each a gated MLP of ``--intermediate``),
  ``--top-k`` of them per token; e.g. ``--arch mixtral --num-experts 8 --top-k 2
  --layers 4 --hidden 512 --intermediate 1792``;
* ``--model-path DIR`` runs on a checkpoint already on disk (any the Engine serves
  and transformers loads, with its tokenizer), read as it is: its config sets the
  shape, the shape flags are ignored.

The ceilings take each layer's MLP as transformers runs it when it is not a plain
gated MLP (a sparse MoE block: router and experts).

The runs alternate (engine, transformers, ceiling, decode_ceiling, kv_read, engine, ...)
after one warm-up call per side, and each side keeps its best run: another job on the
machine can slow a single run badly, never speed one up.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from framework.bench.environment import git_commit, machine_description

DEFAULT_OUTPUT = "benchmarks/results/offline"
#: Architectures of the random model: a dense Llama, or a Mixtral (sparse MoE layers).
ARCHES = ("llama", "mixtral")
SIDES = ("engine", "transformers", "ceiling", "decode_ceiling", "kv_read")
CSV_COLUMNS = ("side", "output_tokens_per_s", "best_seconds")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Plain words for the prompts; what they say does not matter, only that a real
# tokenizer turns them into a realistic spread of token counts.
_WORD_TEXT = """
the of and to in is was for on that with as by at from his an were are which this be
has had one not but have it they or first new after their two who its also time she
been other when there all during into school year city only over more most world
would where later up such used many can state about national out known university
united then made team american under game season three him through both well between
called part series name early film album river number music served along family
because population company before several including second people since work following
north south water light model token cache batch request memory stream answer question
"""
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class OfflineBenchSettings:
    """The model shape, the workload and how often each side runs."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int | None = None  # None: as many as heads
    intermediate: int | None = None  # None: 3 × hidden
    vocab: int | None = None  # None: the embedded tokenizer's
    context: int = 1024
    num_prompts: int = 64
    min_words: int = 8
    max_words: int = 120
    output_len: int = 48
    hf_batch_size: int = 16
    repeats: int = 3
    torch_threads: int | None = None  # per Engine replica; None: the runtime's rule
    # Engine replicas (data parallel), each a Scheduler with torch_threads threads; the
    # other sides run on all the replicas' threads together.
    dp_size: int = 1
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    # Each side draws its own random weights (no checkpoint is written, and the two
    # sides' tokens are not compared): for shapes too large to save and load quickly.
    dummy_weights: bool = False
    # The random model's architecture (ARCHES); for mixtral, its experts and their choice.
    arch: str = "llama"
    num_experts: int = 8
    top_k: int = 2
    # A checkpoint to run instead of a random model (its config sets the shape).
    model_path: str | None = None

    @classmethod
    def quick(cls) -> OfflineBenchSettings:
        """A tiny model and workload that finish in seconds (a first look, and the tests)."""
        return cls(layers=2, hidden=64, heads=2, context=1024, num_prompts=16, min_words=8,
                   max_words=32, output_len=16, hf_batch_size=8, repeats=2)

    @classmethod
    def llama3_8b(cls) -> OfflineBenchSettings:
        """Llama-3-8B's shape with dummy weights in bfloat16 on a CUDA GPU."""
        return cls(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                   vocab=128256, dtype="bfloat16", device="cuda", dummy_weights=True)

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads of the model."""
        return self.kv_heads or self.heads

    @property
    def intermediate_size(self) -> int:
        """Width of the MLP."""
        return self.intermediate or 3 * self.hidden

    def check(self) -> None:
        """Refuse settings that cannot run, naming the field (a ``ValueError``)."""
        for name in ("layers", "hidden", "heads", "num_prompts", "min_words", "output_len",
                     "hf_batch_size", "repeats", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.num_kv_heads})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) is below min_words "
                             f"({self.min_words})")
        if self.arch not in ARCHES:
            raise ValueError(f"arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be 1 .. num_experts "
                             f"({self.num_experts})")

    def with_checkpoint_shape(self) -> OfflineBenchSettings:
        """With ``model_path``: the shape fields read from its ``config.json``."""
        if self.model_path is None:
            return self
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        experts = config.get("num_local_experts") or config.get("num_experts")
        return dataclasses.replace(
            self, layers=config["num_hidden_layers"], hidden=config["hidden_size"],
            heads=config["num_attention_heads"],
            kv_heads=config.get("num_key_value_heads"),
            intermediate=config.get("moe_intermediate_size") or config["intermediate_size"],
            vocab=config["vocab_size"],
            arch="mixtral" if experts else "llama", num_experts=experts or self.num_experts,
            top_k=config.get("num_experts_per_tok", self.top_k))

    def resolved_threads(self) -> int:
        """Torch threads of each Engine replica: the ones set, or the Scheduler's default."""
        if self.torch_threads is not None:
            return self.torch_threads
        from framework.runtime.launch import torch_threads_per_rank, usable_cores

        return torch_threads_per_rank(usable_cores(), self.dp_size)

    def total_threads(self) -> int:
        """Torch threads of every side but the Engine: all its replicas' together."""
        return self.resolved_threads() * self.dp_size


@dataclass(frozen=True)
class OfflineBenchRow:
    """One side's result: its best run and every run's time."""

    side: str  # one of SIDES
    output_tokens_per_s: float  # num_prompts × output_len / best_seconds
    best_seconds: float
    run_seconds: tuple[float, ...]

    def csv_row(self) -> list[Any]:
        """The values under ``csv_header``."""
        return [self.side, self.output_tokens_per_s, self.best_seconds, *self.run_seconds]


def csv_header(repeats: int) -> list[str]:
    """``offline.csv``'s columns: ``CSV_COLUMNS``, then ``run_1_seconds`` .. ``run_N_seconds``."""
    return [*CSV_COLUMNS, *(f"run_{i}_seconds" for i in range(1, repeats + 1))]


@dataclass
class OfflineBenchResult:
    """What a run measured and produced: rows, files, and each side's greedy tokens."""

    settings: OfflineBenchSettings
    threads: int  # of every side but the Engine: those of all its replicas together
    rows: list[OfflineBenchRow]
    prompts: list[list[int]]
    engine_outputs: list[list[int]]
    transformers_outputs: list[list[int]]
    #: The Engine's best run: its Scheduler's step seconds and model forward seconds.
    engine_step_seconds: float = 0.0
    engine_forward_seconds: float = 0.0
    #: The Engine's attention and linear backends (``auto`` resolved).
    attention_backend: str = ""
    linear_backend: str = ""
    paths: list[Path] = field(default_factory=list)

    @property
    def non_model_fraction(self) -> float:
        """Share of the Engine's step time spent outside the model forward (best run)."""
        if self.engine_step_seconds <= 0:
            return 0.0
        return 1.0 - self.engine_forward_seconds / self.engine_step_seconds

    def identical_outputs(self) -> int:
        """How many prompts got the very same tokens from the Engine and transformers."""
        return sum(e == t for e, t in zip(self.engine_outputs, self.transformers_outputs,
                                          strict=True))

    def row(self, side: str) -> OfflineBenchRow:
        """The row of ``side``."""
        return next(r for r in self.rows if r.side == side)


# --------------------------------------------------------------------------- model and prompts


def _model_classes(settings: OfflineBenchSettings) -> tuple[Any, Any, dict[str, Any]]:
    """transformers' config and model class of the settings' ``arch``, and the config's
    keywords of that architecture alone."""
    if settings.arch == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralConfig, MixtralForCausalLM, {
            "num_local_experts": settings.num_experts, "num_experts_per_tok": settings.top_k,
            "sliding_window": None}
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM, {}


def write_model_dir(settings: OfflineBenchSettings, directory: Path) -> Path:
    """A checkpoint of the benchmark's architecture and shape, random weights from the
    seed, and tokenizer.

    transformers builds and saves it (``save_pretrained``, safetensors), so
    both sides read the very same weights from disk.
    """
    import torch

    from framework.default_model import default_model_path

    config_class, model_class, extra = _model_classes(settings)
    source = Path(default_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    reference = json.loads((source / "config.json").read_text())
    config = config_class(
        vocab_size=settings.vocab or reference["vocab_size"], hidden_size=settings.hidden,
        intermediate_size=settings.intermediate_size, num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads, num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.context, rms_norm_eps=1e-5,
        bos_token_id=reference["bos_token_id"], eos_token_id=reference["eos_token_id"],
        pad_token_id=reference.get("pad_token_id", reference["eos_token_id"]),
        tie_word_embeddings=False,
        # Wider than the default 0.02: peaked next-token distributions, so that a
        # greedy choice is never a near-tie that float rounding could flip.
        initializer_range=0.1, **extra,
    )
    if settings.dummy_weights:
        config.torch_dtype = settings.dtype
        config.architectures = [model_class.__name__]
        config.save_pretrained(directory)  # the shape alone: each side draws its weights
        return directory
    torch.manual_seed(settings.seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def synchronize(device: str) -> None:
    """Wait for the device's queued work (on CUDA), so that a clock read after it is right."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def make_prompts(settings: OfflineBenchSettings, model_dir: Path) -> list[list[int]]:
    """``num_prompts`` prompts of ``min_words``..``max_words`` random words, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(settings.seed)
    texts = [" ".join(rng.choice(_WORDS)
                      for _ in range(rng.randint(settings.min_words, settings.max_words)))
             for _ in range(settings.num_prompts)]
    return [list(tokenizer(text)["input_ids"]) for text in texts]


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers progress bars (saving and loading a one-file checkpoint) in the output."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextmanager
def _using_torch_threads(count: int) -> Iterator[None]:
    """Run this thread's torch work on ``count`` threads, restoring the old count after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------- the three sides


class BenchSide(Protocol):
    """One side of the comparison: warmed up once, then timed on the whole workload."""

    name: str

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Run once on part of the work, untimed, so that first-call costs stay out."""

    def generate(self, prompts: list[list[int]]) -> float:
        """Seconds to produce ``output_len`` tokens for every prompt."""


def _check_lengths(side: str, outputs: list[list[int]], expected: int) -> None:
    # The rates count num_prompts × output_len tokens: a side that made fewer is wrong.
    short = [i for i, tokens in enumerate(outputs) if len(tokens) != expected]
    if short:
        raise RuntimeError(f"{side}: {len(short)} outputs are not {expected} tokens long "
                           f"(prompt {short[0]}: {len(outputs[short[0]])})")


class EngineSide:
    """``framework.Engine`` on the checkpoint: all prompts in one ``generate`` call."""

    name = "engine"

    def __init__(self, model_dir: Path, settings: OfflineBenchSettings, threads: int,
                 engine_args: dict[str, Any]) -> None:
        from framework import Engine

        self.settings = settings
        self.params = {"max_new_tokens": settings.output_len, "temperature": 0.0,
                       "ignore_eos": True}
        # Every prompt runs in one batch, as the ceiling's rows do; on the device where
        # transformers runs (the CPU by default, even on a machine with a GPU).
        args = {"max_running_requests": settings.num_prompts, "device": settings.device,
                "load_format": "dummy" if settings.dummy_weights else "auto",
                "dp_size": settings.dp_size, **engine_args}
        self.engine = Engine(model_path=str(model_dir), dtype=settings.dtype,
                             torch_threads=threads, log_level="warning", **args)
        self.outputs: list[list[int]] = []
        #: Per run: the Scheduler's (step seconds, model forward seconds) during it.
        self.step_split: list[tuple[float, float]] = []
        info = self.engine.get_server_info()
        replica = info.get("replicas", [info])[0]  # every replica runs the same backends
        self.attention_backend: str = replica["attention_backend"]
        self.linear_backend: str = replica["linear_backend"]

    def _scheduler_seconds(self) -> tuple[float, float]:
        # Summed over the replicas when there are several.
        info = self.engine.get_server_info()
        return info["step_seconds"], info["forward_seconds"]

    def generate(self, prompts: list[list[int]]) -> float:
        """Seconds to generate for ``prompts``, from an empty prefix cache."""
        # Without the flush, every run after the first would find its prompts cached
        # and skip the prefill that transformers has to do every time.
        flushed = self.engine.flush_cache()
        if not getattr(flushed, "success", True):
            raise RuntimeError(f"the prefix cache could not be flushed: {flushed.message}")
        step_before, forward_before = self._scheduler_seconds()
        start = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=self.params)
        elapsed = time.perf_counter() - start
        step_after, forward_after = self._scheduler_seconds()
        self.step_split.append((step_after - step_before, forward_after - forward_before))
        self.outputs = [list(o["output_ids"]) for o in outs]
        _check_lengths(self.name, self.outputs, self.settings.output_len)
        return elapsed

    def warm_up(self, prompts: list[list[int]]) -> None:
        """One call on the first transformers batch of prompts."""
        self.generate(prompts[: self.settings.hf_batch_size])

    def close(self) -> None:
        """Stop the Engine."""
        self.engine.shutdown()


class TransformersSide:
    """transformers ``generate`` in left-padded batches of ``hf_batch_size``."""

    name = "transformers"

    def __init__(self, model_dir: Path, settings: OfflineBenchSettings) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.settings = settings
        dtype = getattr(torch, settings.dtype)
        if settings.dummy_weights:  # random weights, drawn on the device itself
            config = AutoConfig.from_pretrained(model_dir)
            with torch.device(settings.device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            self.model.to(settings.device)
        config = self.model.config
        # A checkpoint without a pad token pads with its EOS (left of the prompts, masked).
        eos = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos)
        self.outputs: list[list[int]] = []

    def _generate_batch(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        device = self.settings.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts],
                                 device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)
        n = self.settings.output_len
        # No EOS: like the Engine's ignore_eos, every step takes the plain argmax (with an
        # EOS, min_new_tokens would mask it out and change the greedy choice).
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                  pad_token_id=self.pad_id)
        return out[:, width:].tolist()

    def generate(self, prompts: list[list[int]]) -> float:
        """Seconds to generate for ``prompts``, batch after batch."""
        size = self.settings.hf_batch_size
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for first in range(0, len(prompts), size):
            outputs += self._generate_batch(prompts[first:first + size])
        elapsed = time.perf_counter() - start
        self.outputs = outputs
        _check_lengths(self.name, outputs, self.settings.output_len)
        return elapsed

    def warm_up(self, prompts: list[list[int]]) -> None:
        """One batch."""
        self._generate_batch(prompts[: self.settings.hf_batch_size])


class CeilingSide:
    """The model's linear layers, norms and LM head on the job's shapes, nothing else.

    Per layer: input norm, q/k/v projections, the output projection (of q, in
    place of attention's result), the residual, the post-attention norm and
    the gated MLP (a sparse MoE block's router and experts, as transformers runs
    them); then the final norm and the LM head. No embedding lookup, no attention,
    no sampling, no scheduling.

    ``ceiling`` (``with_prefill``) does the matrix work of the whole job, as
    the Engine must: every prompt token through the layers (in chunks of
    ``prefill_chunk`` rows, the Engine's chunked-prefill size) up to the last
    layer's q/k/v projections (which give the keys and values to cache), the
    rest of the last layer and the LM head on each request's last row in the
    chunk (the prompt's last token gives the first output token), then
    ``output_len - 1`` decode steps of ``num_prompts`` rows. ``decode_ceiling``
    is the decode steps alone, ``output_len`` of them: a bound on the decode
    phase, not on the job.

    The products run on ``linear_backend``, the Engine's: with ``onednn``, on
    weights packed here once (the transformers side keeps its own).
    """

    def __init__(self, hf_model: Any, settings: OfflineBenchSettings, *,
                 with_prefill: bool, prefill_chunk: int = 2048,
                 linear_backend: str = "torch") -> None:
        import torch

        from framework.layers.linear_kernel import pack_weight

        self.name = "ceiling" if with_prefill else "decode_ceiling"
        self.settings = settings
        self.with_prefill = with_prefill
        self.prefill_chunk = prefill_chunk
        self.layers = list(hf_model.model.layers)
        self.norm = hf_model.model.norm
        self.lm_head = hf_model.lm_head
        self.hidden_size = hf_model.config.hidden_size
        #: id(nn.Linear) -> its weight packed for the onednn backend.
        self.packed: dict[int, Any] = {}
        if linear_backend == "onednn":
            self.packed = {id(m): pack_weight(m.weight) for m in hf_model.modules()
                           if isinstance(m, torch.nn.Linear)}
        generator = torch.Generator().manual_seed(settings.seed)
        self.hidden = torch.randn(settings.num_prompts, self.hidden_size, generator=generator).to(
            device=settings.device, dtype=getattr(torch, settings.dtype))

    def _project(self, module: Any, x: Any) -> Any:
        from framework.layers.linear_kernel import linear

        return linear(x, module.weight, module.bias, self.packed.get(id(module)))

    def _layers(self, x: Any, keep: Any = None) -> Any:
        """``x`` through the layers; with ``keep``, the last layer after q/k/v on those rows."""
        import torch.nn.functional as F

        project = self._project
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            q, _, _ = project(attn.q_proj, h), project(attn.k_proj, h), project(attn.v_proj, h)
            if keep is not None and index == len(self.layers) - 1:
                q, x = q[keep], x[keep]
            x = x + project(attn.o_proj, q)
            h = layer.post_attention_layernorm(x)
            if not hasattr(mlp, "gate_proj"):  # a sparse MoE block, run as transformers does
                x = x + mlp(h.unsqueeze(0)).squeeze(0)
                continue
            x = x + project(mlp.down_proj,
                            F.silu(project(mlp.gate_proj, h)) * project(mlp.up_proj, h))
        return x

    def _head(self, x: Any) -> Any:
        return self._project(self.lm_head, self.norm(x))

    def _step(self, x: Any) -> Any:
        return self._head(self._layers(x))

    def _prefill(self, prompts: list[list[int]]) -> None:
        import torch

        total = sum(len(p) for p in prompts)
        rows = self.hidden.repeat(total // len(self.hidden) + 1, 1)[:total]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        for start in range(0, total, self.prefill_chunk):
            stop = min(start + self.prefill_chunk, total)
            # As in the Engine, a chunk's last layer and the head take one row per
            # request in it: each prompt ending there, and the one cut at its end.
            keep = ends[(ends >= start) & (ends < stop)] - start
            if stop < total and (len(keep) == 0 or keep[-1] != stop - start - 1):
                keep = torch.cat([keep, torch.tensor([stop - start - 1])])
            self._head(self._layers(rows[start:stop], keep.to(rows.device)))

    def _run(self, prompts: list[list[int]], decode_steps: int) -> None:
        import torch

        with torch.inference_mode():
            if self.with_prefill:
                self._prefill(prompts)
            for _ in range(decode_steps):
                self._step(self.hidden)

    def generate(self, prompts: list[list[int]]) -> float:
        """Seconds for the job's matrix work (the prompts set the prefill's rows)."""
        steps = self.settings.output_len - (1 if self.with_prefill else 0)
        start = time.perf_counter()
        self._run(prompts, steps)
        synchronize(self.settings.device)
        return time.perf_counter() - start

    def warm_up(self, prompts: list[list[int]]) -> None:
        """One step (and one prefill of the first prompt)."""
        self._run(prompts[:1], 1)


class KVReadSide:
    """The decode steps' keys and values read once each, nothing else: attention's least.

    At decode step ``t`` (1 .. ``output_len - 1``) a request of ``n`` prompt
    tokens holds ``n + t`` keys and values per layer, and any attention must
    read them all. This side streams exactly that many bytes per layer and
    step, a ``sum`` over a prefix of buffers of its own per layer (so that, as
    in the Engine, one step's keys and values of every layer together are the
    working set): what memory bandwidth alone costs the job's decode attention.
    ``ceiling + kv_read`` bounds the Engine from below; prefill attention,
    sampling and scheduling come on top.
    """

    name = "kv_read"

    def __init__(self, settings: OfflineBenchSettings) -> None:
        self.settings = settings
        self.buffers: list[Any] = []

    def _ensure_buffers(self, rows: int) -> None:
        import torch

        if self.buffers and self.buffers[0].shape[0] >= rows:
            return
        s = self.settings
        width = s.num_kv_heads * (s.hidden // s.heads)
        dtype = getattr(torch, s.dtype)
        # Ones, not empty: every page is touched before the timed reads.
        self.buffers = [torch.ones(rows, width, dtype=dtype, device=s.device)
                        for _ in range(2 * s.layers)]  # a key and a value buffer per layer

    def _run(self, prompts: list[list[int]]) -> None:
        prompt_tokens, steps = sum(len(p) for p in prompts), self.settings.output_len - 1
        self._ensure_buffers(prompt_tokens + len(prompts) * steps)
        for step in range(1, steps + 1):
            held = prompt_tokens + len(prompts) * step
            for buffer in self.buffers:
                buffer[:held].sum()

    def generate(self, prompts: list[list[int]]) -> float:
        """Seconds to read every decode step's keys and values once."""
        start = time.perf_counter()
        self._run(prompts)
        synchronize(self.settings.device)
        return time.perf_counter() - start

    def warm_up(self, prompts: list[list[int]]) -> None:
        """One pass: allocates the buffers."""
        self._run(prompts)


# --------------------------------------------------------------------------- the run


def run_benchmark(settings: OfflineBenchSettings, output_dir: str | Path,
                  engine_args: dict[str, Any] | None = None,
                  model_dir: Path | None = None) -> OfflineBenchResult:
    """Measure the three sides and write ``offline.csv`` and ``offline.md``.

    ``engine_args``: extra ``Engine`` keywords (``launch_mode``, ``transport``,
    ...). ``model_dir``: an empty directory to write the checkpoint to and
    keep (default: a temporary one, removed at the end); with ``settings.model_path``,
    that checkpoint is run instead and nothing is written.
    """
    settings = settings.with_checkpoint_shape()
    settings.check()
    if settings.model_path is not None:
        model_dir = Path(settings.model_path)
    elif model_dir is None:
        with tempfile.TemporaryDirectory(prefix="framework-bench-") as tmp:
            return run_benchmark(settings, output_dir, engine_args, Path(tmp))
    threads = settings.total_threads()
    with quiet_transformers(), _using_torch_threads(threads):
        if settings.model_path is None:
            write_model_dir(settings, model_dir)
        prompts = make_prompts(settings, model_dir)
        print(f"{settings.num_prompts} prompts of {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens, {settings.output_len} output tokens each, "
              f"{_threads_text(settings)}", flush=True)
        result = _measure(settings, model_dir, prompts, threads, engine_args or {})
    if not settings.dummy_weights:
        identical = result.identical_outputs()
        print(f"greedy outputs identical on {identical} of {len(prompts)} prompts", flush=True)
    result.paths = write_results(result, Path(output_dir))
    return result


def _measure(settings: OfflineBenchSettings, model_dir: Path, prompts: list[list[int]],
             threads: int, engine_args: dict[str, Any]) -> OfflineBenchResult:
    """Warm every side up, then run them in turn ``repeats`` times."""
    engine = EngineSide(model_dir, settings, settings.resolved_threads(), engine_args)
    try:
        transformers_side = TransformersSide(model_dir, settings)
        ceilings = [CeilingSide(transformers_side.model, settings, with_prefill=prefill,
                                prefill_chunk=engine_args.get("chunked_prefill_size", 2048),
                                linear_backend=engine.linear_backend)
                    for prefill in (True, False)]
        sides: list[BenchSide] = [engine, transformers_side, *ceilings, KVReadSide(settings)]
        for side in sides:
            side.warm_up(prompts)
        times: dict[str, list[float]] = {side.name: [] for side in sides}
        for repeat in range(settings.repeats):
            for side in sides:
                seconds = side.generate(prompts)
                times[side.name].append(seconds)
                print(f"run {repeat + 1}/{settings.repeats} {side.name:<14} "
                      f"{seconds:8.3f} s", flush=True)
    finally:
        engine.close()
    tokens = settings.num_prompts * settings.output_len
    rows = [OfflineBenchRow(name, tokens / min(runs), min(runs), tuple(runs))
            for name, runs in times.items()]
    for row in rows:
        print(_format_row(row), flush=True)
    engine_runs = times[engine.name]
    best_step, best_forward = engine.step_split[1:][engine_runs.index(min(engine_runs))]
    print(f"engine: non-model time {1 - best_forward / best_step:.1%} of step time "
          f"({best_step:.3f} s of steps, {best_forward:.3f} s in the model)", flush=True)
    return OfflineBenchResult(settings, threads, rows, prompts, engine.outputs,
                              transformers_side.outputs, best_step, best_forward,
                              engine.attention_backend, engine.linear_backend)


def _threads_text(settings: OfflineBenchSettings) -> str:
    """How the sides' torch threads are spread, in words."""
    total = settings.total_threads()
    if settings.dp_size == 1:
        return f"{total} torch thread(s) on every side"
    return (f"{total} torch threads on every side, the Engine's as {settings.dp_size} "
            f"data-parallel replicas of {settings.resolved_threads()} each")


def _format_row(row: OfflineBenchRow) -> str:
    return (f"{row.side:<14} {row.output_tokens_per_s:12,.1f} output tok/s   "
            f"best {row.best_seconds:8.3f} s")


def ratios(rows: list[OfflineBenchRow]) -> dict[str, float]:
    """Engine over transformers, and the Engine's fraction of the ceiling (output tokens/s)."""
    rate = {r.side: r.output_tokens_per_s for r in rows}
    out: dict[str, float] = {}
    if "engine" in rate and "transformers" in rate:
        out["engine_vs_transformers"] = rate["engine"] / rate["transformers"]
    if "engine" in rate and "ceiling" in rate:
        out["engine_of_ceiling"] = rate["engine"] / rate["ceiling"]
    if "engine" in rate and "decode_ceiling" in rate:
        out["engine_of_decode_ceiling"] = rate["engine"] / rate["decode_ceiling"]
    if "ceiling" in rate and "kv_read" in rate:
        # Seconds add up, rates do not: the bound's rate is 1 / (1 / ceiling + 1 / kv_read).
        bound = 1.0 / (1.0 / rate["ceiling"] + 1.0 / rate["kv_read"])
        if "engine" in rate:
            out["engine_of_bound"] = rate["engine"] / bound
        if "transformers" in rate:
            out["bound_vs_transformers"] = bound / rate["transformers"]
    return out


def _vocab_size(result: OfflineBenchResult) -> str:
    return f"{result.settings.vocab:,}" if result.settings.vocab else "4,096 (the tokenizer's)"


def _model_text(settings: OfflineBenchSettings) -> str:
    """The architecture in words (with the checkpoint's path when one was given)."""
    name = (f"Mixtral ({settings.num_experts} experts, top-{settings.top_k})"
            if settings.arch == "mixtral" else "Llama")
    return f"`{settings.model_path}` ({name}-shaped)" if settings.model_path else name


def _moe_ceiling_text(settings: OfflineBenchSettings) -> str:
    return (", the sparse MoE blocks as transformers runs them (router and experts)"
            if settings.arch == "mixtral" else "")


def _weights_text(settings: OfflineBenchSettings) -> str:
    if settings.dummy_weights:
        return "dummy random weights drawn by each side"
    if settings.model_path:
        return "the checkpoint's weights"
    return f"random weights (seed {settings.seed}) saved as safetensors"


def _device_name(device: str) -> str:
    """``CPU``, or the CUDA device's name."""
    if device != "cuda":
        return "CPU"
    import torch

    return f"CUDA ({torch.cuda.get_device_name()})"


def write_results(result: OfflineBenchResult, output_dir: Path) -> list[Path]:
    """``offline.csv`` and ``offline.md`` (with the machine and the commit)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path = output_dir / "offline.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(csv_header(result.settings.repeats))
        writer.writerows([row.csv_row() for row in result.rows])
    md_path = output_dir / "offline.md"
    md_path.write_text(render_markdown(result))
    return [csv_path, md_path]


def render_markdown(result: OfflineBenchResult) -> str:
    """The results as a Markdown table headed by the machine, the commit and the settings."""
    s = result.settings
    lengths = [len(p) for p in result.prompts]
    gains = ratios(result.rows)
    lines = [
        "# Offline throughput: Engine vs transformers",
        "",
        f"- Machine: {machine_description()}",
        f"- Python {platform.python_version()}, commit {git_commit()}",
        f"- Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Model: {_model_text(s)}, {s.layers} layers, hidden {s.hidden}, {s.heads} heads "
        f"({s.num_kv_heads} key/value), intermediate {s.intermediate_size}, vocabulary "
        f"{_vocab_size(result)}, {_weights_text(s)}, {s.dtype}, {_device_name(s.device)}",
        f"- Workload: {s.num_prompts} prompts of {s.min_words}-{s.max_words} random words "
        f"({min(lengths)}-{max(lengths)} tokens, {sum(lengths):,} in all), {s.output_len} "
        "greedy output tokens each",
        f"- {_threads_text(s)}; best of {s.repeats} alternating runs after one warm-up "
        "call each",
        f"- engine: one `Engine.generate` call with every prompt, attention backend "
        f"`{result.attention_backend}`, linear backend `{result.linear_backend}`; transformers: "
        f"`generate` in left-padded batches of {s.hf_batch_size}; ceiling: linear layers (on "
        f"the Engine's linear backend){_moe_ceiling_text(s)}, norms and LM head only, on "
        "every prompt token (chunks "
        "of 2,048 rows; past the last layer's q/k/v projections, only each request's last "
        f"row of a chunk, as in the Engine), then {s.output_len - 1} steps of "
        f"{s.num_prompts} rows; decode_ceiling: the same on {s.output_len} steps of "
        f"{s.num_prompts} rows alone (no prefill); kv_read: every decode step's keys and "
        "values read once (a sum over them), nothing else",
        "",
        "| side | output tokens/s | best seconds | runs (s) |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {r.side} | {r.output_tokens_per_s:,.1f} | {r.best_seconds:.3f} | "
              f"{', '.join(f'{t:.3f}' for t in r.run_seconds)} |" for r in result.rows]
    lines.append("")
    if "engine_vs_transformers" in gains:
        lines.append(f"The Engine is {gains['engine_vs_transformers']:.2f}× transformers.")
    if "engine_of_ceiling" in gains:
        lines.append(f"The Engine reaches {gains['engine_of_ceiling']:.1%} of the ceiling "
                     "(the job's matrix work, prefill included).")
    if "engine_of_decode_ceiling" in gains:
        lines.append(f"The Engine reaches {gains['engine_of_decode_ceiling']:.1%} of the "
                     "decode-only ceiling.")
    if "engine_of_bound" in gains and "bound_vs_transformers" in gains:
        bound = result.row("ceiling").best_seconds + result.row("kv_read").best_seconds
        lines.append(f"The ceiling plus kv_read ({bound:.3f} s) bounds the Engine from below: "
                     f"at best {gains['bound_vs_transformers']:.2f}× transformers here; the "
                     f"Engine reaches {gains['engine_of_bound']:.1%} of that bound.")
    if s.dummy_weights:
        lines.append("Greedy outputs not compared: each side drew its own dummy weights.")
    else:
        lines.append(f"Greedy outputs identical on {result.identical_outputs()} of "
                     f"{len(result.prompts)} prompts.")
    summed = f" (summed over its {s.dp_size} replicas)" if s.dp_size > 1 else ""
    lines.append(f"Engine, best run: {result.engine_step_seconds:.3f} s of Scheduler steps"
                 f"{summed}, {result.engine_forward_seconds:.3f} s of them in the model forward; "
                 f"non-model time {result.non_model_fraction:.1%} of step time.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line

# flag name -> (settings field, type, help)
_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--layers": ("layers", int, "decoder layers of the random Llama"),
    "--hidden": ("hidden", int, "hidden size"),
    "--intermediate": ("intermediate", int, "width of the MLP, or of each expert (default: "
                       "3 × hidden)"),
    "--num-experts": ("num_experts", int, "experts per layer (--arch mixtral)"),
    "--top-k": ("top_k", int, "experts each token is routed to (--arch mixtral)"),
    "--num-prompts": ("num_prompts", int, "prompts, all generated for at once"),
    "--output-len": ("output_len", int, "greedy output tokens per prompt"),
    "--hf-batch-size": ("hf_batch_size", int, "prompts per transformers generate call"),
    "--repeats": ("repeats", int, "alternating runs of each side; the best is kept"),
    "--torch-threads": ("torch_threads", int, "torch threads of each Engine replica; the "
                        "other sides get all the replicas' (default: the runtime's rule "
                        "for its Schedulers)"),
    "--dp-size": ("dp_size", int, "Engine replicas (data parallel)"),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench offline`` flags."""
    default = OfflineBenchSettings()
    for flag, (name, kind, text) in _FLAGS.items():
        value = getattr(default, name)
        shown = "" if value is None else f" (default: {value})"
        parser.add_argument(flag, type=kind, default=None, metavar="N", help=text + shown)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--quick", action="store_true",
                       help="a tiny model and workload: seconds, rough numbers (flags given "
                            "explicitly still apply)")
    shape.add_argument("--llama3-8b", action="store_true",
                       help="Llama-3-8B's shape with dummy weights in bfloat16 on a CUDA GPU "
                            "(flags given explicitly still apply)")
    parser.add_argument("--arch", default=None, choices=ARCHES,
                        help="architecture of the random model (default: llama)")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help="run this checkpoint (with its tokenizer) instead of a random "
                             "model; its config sets the shape")
    parser.add_argument("--attention-backend", default=None, metavar="NAME",
                        help="the Engine's attention backend (default: the server's default)")
    parser.add_argument("--linear-backend", default=None, choices=("auto", "onednn", "torch"),
                        help="the linear backend of the Engine and the ceilings (default: "
                             "the server's default)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def settings_from_args(args: argparse.Namespace) -> OfflineBenchSettings:
    """The defaults (or the quick ones), with every flag given on the command line."""
    base = (OfflineBenchSettings.quick() if args.quick else
            OfflineBenchSettings.llama3_8b() if args.llama3_8b else OfflineBenchSettings())
    given = {name: getattr(args, name) for name in [*(n for n, _, _ in _FLAGS.values()),
                                                    "arch", "model_path"]
             if getattr(args, name) is not None}
    return dataclasses.replace(base, **given)


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench offline``."""
    engine_args = {name: getattr(args, name) for name in ("attention_backend", "linear_backend")
                   if getattr(args, name) is not None}
    result = run_benchmark(settings_from_args(args), args.output, engine_args)
    for path in result.paths:
        print(f"wrote {path}")
    return 0
