"""`framework bench structured`: the cost of structured outputs, constrained vs free.

On the embedded default model, in one Engine:

* **Throughput**: a batch of ``requests`` requests sent together, each constrained by
  the same JSON schema (its own seed), then the same batch unconstrained with each
  request's ``max_new_tokens`` set to the length its constrained twin produced (and
  EOS ignored), so both runs generate the same number of tokens per request. Output
  tokens per second, the median of ``repeats`` runs each.
* **Grammar compilation**: the backend's compile of the schema on a fresh backend
  (cold, the tokenizer already read), the time to read the tokenizer's vocabulary
  into the backend (once per server), and the time for a request to get a compiled
  grammar from the cache (cached).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from framework.bench.environment import git_commit, machine_description

DEFAULT_OUTPUT = "benchmarks/results/structured_outputs"
# A record of the kind extraction pipelines ask for.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churned"]},
                 "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}


@dataclass(frozen=True)
class StructuredBenchSettings:
    """The workload."""

    requests: int = 32
    max_new_tokens: int = 256
    repeats: int = 3
    temperature: float = 1.0

    @classmethod
    def quick(cls) -> StructuredBenchSettings:
        """A small run that finishes in seconds (for a first look and for tests)."""
        return cls(requests=4, max_new_tokens=64, repeats=1)


@dataclass(frozen=True)
class StructuredBenchRow:
    """One measurement."""

    measurement: str  # "constrained", "unconstrained", "compile_cold", ...
    seconds: float
    output_tokens: int  # 0 for compile rows
    tokens_per_s: float  # 0 for compile rows
    stopped: int = 0  # requests of the last run that finished with "stop"


def _prompts(n: int) -> list[str]:
    return [f"Customer record {i} as JSON:" for i in range(n)]


def measure_throughput(settings: StructuredBenchSettings, engine: Any
                       ) -> list[StructuredBenchRow]:
    """Constrained, then unconstrained with the same token counts; median of the repeats."""
    prompts = _prompts(settings.requests)
    schema = json.dumps(SCHEMA)
    constrained = [{"json_schema": schema, "seed": i, "temperature": settings.temperature,
                    "max_new_tokens": settings.max_new_tokens}
                   for i in range(settings.requests)]
    engine.generate(prompts, constrained)  # warm-up: compiles the grammar, warms the code
    runs: dict[str, list[tuple[float, int]]] = {"constrained": [], "unconstrained": []}
    for _ in range(settings.repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, constrained)
        elapsed = time.perf_counter() - start
        lengths = [o["meta_info"]["completion_tokens"] for o in outs]
        runs["constrained"].append((elapsed, sum(lengths)))
        stopped = sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
        free = [{"seed": i, "temperature": settings.temperature, "ignore_eos": True,
                 "max_new_tokens": n} for i, n in enumerate(lengths)]
        start = time.perf_counter()
        outs = engine.generate(prompts, free)
        elapsed = time.perf_counter() - start
        runs["unconstrained"].append(
            (elapsed, sum(o["meta_info"]["completion_tokens"] for o in outs)))
    rows = []
    for name, results in runs.items():
        rate = statistics.median(tokens / seconds for seconds, tokens in results)
        seconds = statistics.median(seconds for seconds, _ in results)
        rows.append(StructuredBenchRow(name, seconds, results[-1][1], rate,
                                       stopped if name == "constrained" else 0))
    return rows


def measure_compile(tokenizer: Any, vocab_size: int, stop_ids: list[int]
                    ) -> list[StructuredBenchRow]:
    """Reading the vocabulary, a cold compile of the schema, and a cache hit."""
    from framework.constrained.base import Constraint
    from framework.constrained.manager import GrammarManager
    from framework.constrained.xgrammar_backend import XGrammarBackend

    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    start = time.perf_counter()
    backend = XGrammarBackend(tokenizer, vocab_size, stop_ids)
    vocabulary = time.perf_counter() - start
    start = time.perf_counter()
    backend.compile(constraint)
    cold = time.perf_counter() - start
    manager = GrammarManager("xgrammar", tokenizer, vocab_size, stop_ids)
    manager.compiled(constraint, timeout=600)
    start = time.perf_counter()
    manager.compiled(constraint, timeout=600)
    cached = time.perf_counter() - start
    manager.close()
    return [StructuredBenchRow("backend_vocabulary", vocabulary, 0, 0.0),
            StructuredBenchRow("compile_cold", cold, 0, 0.0),
            StructuredBenchRow("compile_cached", cached, 0, 0.0)]


def run_benchmark(settings: StructuredBenchSettings, output_dir: str | Path,
                  engine_args: dict[str, Any] | None = None) -> list[Path]:
    """Measure and write the result files."""
    from framework import Engine
    from framework.default_model import default_model_path
    from framework.runtime.hf_tokenizer import load_tokenizer

    path = default_model_path()
    config = json.loads((Path(path) / "config.json").read_text())
    rows = measure_compile(load_tokenizer(path), config["vocab_size"],
                           [config["eos_token_id"]])
    with Engine(**(engine_args or {})) as engine:
        rows += measure_throughput(settings, engine)
    for row in rows:
        print(_format_row(row), flush=True)
    return write_results(rows, settings, Path(output_dir))


def _format_row(row: StructuredBenchRow) -> str:
    if row.output_tokens:
        return (f"{row.measurement:<20} {row.seconds:8.3f} s  {row.output_tokens:6d} tokens "
                f"{row.tokens_per_s:10.1f} tok/s")
    return f"{row.measurement:<20} {row.seconds * 1000:10.3f} ms"


def ratio(rows: list[StructuredBenchRow]) -> float | None:
    """Constrained over unconstrained output tokens/s."""
    by_name = {r.measurement: r for r in rows}
    if "constrained" not in by_name or "unconstrained" not in by_name:
        return None
    return by_name["constrained"].tokens_per_s / by_name["unconstrained"].tokens_per_s


def write_results(rows: list[StructuredBenchRow], settings: StructuredBenchSettings,
                  output_dir: Path) -> list[Path]:
    """``structured_outputs.csv`` and ``structured_outputs.md`` (machine and commit)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path = output_dir / "structured_outputs.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f.name for f in fields(StructuredBenchRow)])
        writer.writerows([list(asdict(r).values()) for r in rows])
    md_path = output_dir / "structured_outputs.md"
    md_path.write_text(render_markdown(rows, settings))
    return [csv_path, md_path]


def render_markdown(rows: list[StructuredBenchRow], settings: StructuredBenchSettings) -> str:
    """The results as Markdown headed by the machine, the commit and the workload."""
    s = settings
    lines = [
        "# Structured-outputs benchmark",
        "",
        f"- Machine: {machine_description()}",
        f"- Python {platform.python_version()}, commit {git_commit()}",
        f"- Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "- Model: the embedded default model; grammar backend xgrammar",
        f"- Throughput: {s.requests} requests sent together, one JSON schema (nested object, "
        f"enum array, bounded strings and integers), temperature {s.temperature}, "
        f"max_new_tokens {s.max_new_tokens}; then the same batch unconstrained, each request "
        f"generating as many tokens as its constrained twin; median of {s.repeats} runs",
        "",
        "| measurement | seconds | output tokens | output tokens/s | finished by the grammar |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.measurement} | {r.seconds:.6f} | {r.output_tokens:,} | "
              f"{r.tokens_per_s:,.1f} | {r.stopped or ''} |" for r in rows]
    lines.append("")
    got = ratio(rows)
    if got is not None:
        lines.append(f"Constrained throughput is {got:.0%} of unconstrained (target: at "
                     "least 70%).")
    lines.append("Compile rows: `backend_vocabulary` reads the tokenizer into the backend "
                 "(once per server), `compile_cold` compiles the schema on a fresh backend, "
                 "`compile_cached` is what a later request with the same schema waits.")
    return "\n".join(lines) + "\n"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench structured`` flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a small workload: seconds, rough numbers")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench structured``."""
    settings = StructuredBenchSettings.quick() if args.quick else StructuredBenchSettings()
    for path in run_benchmark(settings, args.output):
        print(f"wrote {path}")
    return 0
