"""`framework bench prefix-cache`: what the radix prefix cache buys, cache on vs off.

Two measurements on the same model, each run once with the radix cache and
once with ``--disable-radix-cache``, through the whole runtime (``Engine``):

* **TTFT with a shared prefix**: a request of a ``prefix``-token shared prefix
  and a ``suffix``-token own suffix asks for one token, after another request
  with the same prefix has run. The time of that call is its time to first
  token; the median over ``repeats`` requests (each with a new suffix) is kept.
* **Shared-prefix throughput**: ``requests`` requests sharing a
  ``throughput_prefix``-token prefix, each with its own suffix, sent together,
  ``output`` greedy tokens each; prompt plus output tokens per second.

The model is a Llama of the configured shape with random weights
(``--load-format dummy``) and the embedded model's tokenizer, so nothing is
downloaded and the numbers depend only on the shape.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from framework.bench.environment import git_commit, machine_description

DEFAULT_OUTPUT = "benchmarks/results/prefix_cache"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PrefixBenchSettings:
    """The model shape and the workload."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    context: int = 4096
    prefix: int = 2048
    suffix: int = 32
    repeats: int = 5
    requests: int = 32
    throughput_prefix: int = 1024
    throughput_suffix: int = 64
    output: int = 32

    @classmethod
    def quick(cls) -> PrefixBenchSettings:
        """A small run that finishes in seconds (for a first look and for tests)."""
        return cls(layers=2, hidden=64, heads=2, context=1024, prefix=256, suffix=16,
                   repeats=2, requests=4, throughput_prefix=128, throughput_suffix=16,
                   output=4)


@dataclass(frozen=True)
class PrefixBenchRow:
    """One measurement with the cache on or off."""

    measurement: str  # "ttft" or "throughput"
    radix_cache: bool
    seconds: float  # median TTFT, or the wall time of the whole batch
    tokens_per_s: float  # prompt + output tokens per second (0 for ttft)
    cached_tokens: int  # cached prompt tokens of the measured request(s)


def write_model_dir(settings: PrefixBenchSettings, directory: Path) -> Path:
    """A Llama config of the benchmark's shape plus the embedded model's tokenizer."""
    from framework.default_model import default_model_path

    source = Path(default_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": settings.hidden, "intermediate_size": settings.hidden * 3,
        "num_hidden_layers": settings.layers, "num_attention_heads": settings.heads,
        "num_key_value_heads": settings.heads, "max_position_embeddings": settings.context,
        "vocab_size": vocab, "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 0,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def measure(settings: PrefixBenchSettings, model_dir: Path, radix_cache: bool,
            engine_args: dict[str, Any]) -> list[PrefixBenchRow]:
    """Both measurements with the cache on or off, in one Engine."""
    from framework import Engine

    rng = random.Random(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    one_token = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=str(model_dir), load_format="dummy", dtype="float32",
                disable_radix_cache=not radix_cache, **engine_args) as engine:
        prefix = _random_ids(rng, settings.prefix, vocab)
        engine.generate(input_ids=prefix + _random_ids(rng, settings.suffix, vocab),
                        sampling_params=one_token)  # warms the cache (and the code paths)
        times, cached = [], 0
        for _ in range(settings.repeats):
            ids = prefix + _random_ids(rng, settings.suffix, vocab)
            start = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params=one_token)
            times.append(time.perf_counter() - start)
            cached = out["meta_info"]["cached_tokens"]
        rows = [PrefixBenchRow("ttft", radix_cache, statistics.median(times), 0.0, cached)]

        engine.flush_cache()
        shared = _random_ids(rng, settings.throughput_prefix, vocab)
        prompts = [shared + _random_ids(rng, settings.throughput_suffix, vocab)
                   for _ in range(settings.requests)]
        params = {"max_new_tokens": settings.output, "temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(p) for p in prompts) + settings.output * len(prompts)
        rows.append(PrefixBenchRow(
            "throughput", radix_cache, elapsed, tokens / elapsed,
            sum(o["meta_info"]["cached_tokens"] for o in outs)))
    return rows


def run_benchmark(settings: PrefixBenchSettings, output_dir: str | Path,
                  engine_args: dict[str, Any] | None = None) -> list[Path]:
    """Measure with the cache on and off and write the result files."""
    rows: list[PrefixBenchRow] = []
    with tempfile.TemporaryDirectory(prefix="framework-bench-") as tmp:
        model_dir = write_model_dir(settings, Path(tmp))
        for radix_cache in (True, False):
            for row in measure(settings, model_dir, radix_cache, engine_args or {}):
                print(_format_row(row), flush=True)
                rows.append(row)
    return write_results(rows, settings, Path(output_dir))


def _format_row(row: PrefixBenchRow) -> str:
    cache = "on " if row.radix_cache else "off"
    return (f"{row.measurement:<10} cache {cache} {row.seconds * 1000:10.1f} ms "
            f"{row.tokens_per_s:10.1f} tok/s  cached {row.cached_tokens}")


def write_results(rows: list[PrefixBenchRow], settings: PrefixBenchSettings,
                  output_dir: Path) -> list[Path]:
    """``prefix_cache.csv`` and ``prefix_cache.md`` (with the machine and the commit)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path = output_dir / "prefix_cache.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f.name for f in fields(PrefixBenchRow)])
        writer.writerows([list(asdict(r).values()) for r in rows])
    md_path = output_dir / "prefix_cache.md"
    md_path.write_text(render_markdown(rows, settings))
    return [csv_path, md_path]


def speedups(rows: list[PrefixBenchRow]) -> dict[str, float]:
    """Cache-on over cache-off gain per measurement (TTFT: off / on; throughput: on / off)."""
    by_key = {(r.measurement, r.radix_cache): r for r in rows}
    out = {}
    if ("ttft", True) in by_key and ("ttft", False) in by_key:
        out["ttft"] = by_key["ttft", False].seconds / by_key["ttft", True].seconds
    if ("throughput", True) in by_key and ("throughput", False) in by_key:
        out["throughput"] = (by_key["throughput", True].tokens_per_s
                             / by_key["throughput", False].tokens_per_s)
    return out


def render_markdown(rows: list[PrefixBenchRow], settings: PrefixBenchSettings) -> str:
    """The results as a Markdown table headed by the machine, the commit and the settings."""
    s = settings
    gains = speedups(rows)
    lines = [
        "# Prefix-cache benchmark",
        "",
        f"- Machine: {machine_description()}",
        f"- Python {platform.python_version()}, commit {git_commit()}",
        f"- Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Model: Llama, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, context "
        f"{s.context}, random weights (load format dummy), float32, CPU",
        f"- TTFT: a {s.prefix}-token shared prefix + {s.suffix}-token suffix, 1 output token, "
        f"after one request with the same prefix; median of {s.repeats}",
        f"- Throughput: {s.requests} requests sent together, a {s.throughput_prefix}-token "
        f"shared prefix + {s.throughput_suffix}-token suffix each, {s.output} greedy tokens",
        "",
        "| measurement | radix cache | seconds | tokens/s | cached tokens |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [f"| {r.measurement} | {'on' if r.radix_cache else 'off'} | {r.seconds:.4f} | "
              f"{r.tokens_per_s:,.1f} | {r.cached_tokens:,} |" for r in rows]
    lines.append("")
    if "ttft" in gains:
        lines.append(f"TTFT with the cache is {gains['ttft']:.1f}× faster.")
    if "throughput" in gains:
        lines.append(f"Shared-prefix throughput with the cache is {gains['throughput']:.2f}× "
                     "higher.")
    return "\n".join(lines) + "\n"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench prefix-cache`` flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a small model and workload: seconds, rough numbers")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench prefix-cache``."""
    settings = PrefixBenchSettings.quick() if args.quick else PrefixBenchSettings()
    for path in run_benchmark(settings, args.output):
        print(f"wrote {path}")
    return 0
