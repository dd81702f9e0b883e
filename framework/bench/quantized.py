"""`framework bench quantized`: output tokens/s and weight bytes, float32 against quantized.

A random Llama of about 100M parameters (8 layers, hidden 1024, intermediate 2048, the
embedded tokenizer's vocabulary), or with ``--arch mixtral`` a Mixtral of that shape with
``--experts`` experts (two chosen per token; every expert's weights quantized too), is
written once in float32; ``framework quantize``
writes its int8 (per-channel) and GPTQ int4 (``--group-size``, 128) checkpoints beside
it, and with ``--formats`` FP8 ones (per channel, and in blocks of 128: ``fp8_block``).
Each configuration (``CONFIGURATIONS``: a checkpoint, a quantized-linear kernel and
whether the LM head and embeddings are quantized too) is served by one
``framework.Engine`` that runs greedy requests at 1 stream (one request at a time) and at
64 (sent together): every checkpoint on the default kernel (float32 activations, rounded
to int16 next to 4-bit codes), again
on ``cpu_a8`` (products of a few rows on int8 activations; FP8 products of many rows on
bfloat16 ones), and each with an int8 LM
head and embedding table (``--quantize-lm-head``, ``--quantize-embeddings``).
The Engines run side by side and take turns round by round (``run_configurations``); each
configuration runs ``--rounds`` times after a warm-up and keeps its best round.
Reported: output tokens/s, the speed-up over float32, and the weight bytes
``/get_server_info`` reports (``weight_bytes_rank_0``), with the machine and commit, in
``quantized.json`` and ``quantized.md`` under ``--output``.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.bench.environment import greedy_tokens_per_second, run_stamp, write_results

DEFAULT_OUTPUT = "benchmarks/results/quantized"
#: Checkpoint formats measured by default, after float32.
FORMATS = ("int8", "gptq")
#: Every checkpoint format this benchmark writes: ``framework quantize --format`` and its
#: options (GPTQ's group size is ``--group-size``).
WRITES: dict[str, tuple[str, dict[str, Any]]] = {
    "int8": ("int8", {}), "gptq": ("gptq", {}), "fp8": ("fp8", {}),
    "fp8_block": ("fp8", {"block_size": 128})}
#: The rows' configurations: label, checkpoint, Engine options (``--quantized-linear-backend``;
#: "int8 tables": ``--quantize-lm-head`` and ``--quantize-embeddings``).
_A8 = {"quantized_linear_backend": "cpu_a8"}
_TABLES = {"quantize_lm_head": True, "quantize_embeddings": True}
CONFIGURATIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("float32", "float32", {}), ("int8", "int8", {}), ("gptq", "gptq", {}),
    ("int8, cpu_a8", "int8", _A8), ("gptq, cpu_a8", "gptq", _A8),
    ("int8, int8 tables", "int8", _TABLES),
    ("gptq, int8 tables, cpu_a8", "gptq", {**_A8, **_TABLES}),
    ("fp8", "fp8", {}), ("fp8, cpu_a8", "fp8", _A8), ("fp8, blocks of 128", "fp8_block", {}))
STREAMS = (1, 64)
#: KV slots of each Engine: 64 streams of at most ~120 tokens fit twice over, and the
#: Engines side by side fit in memory (a float32 pool sized from free memory takes up to
#: 4 GiB at this model's 64 KiB a token, and several such pools overran 24 GiB).
KV_TOKENS = 16384
_WORDS = "the data value list index count result file name table row column key page model"


@dataclass
class Settings:
    """What one run of the benchmark does."""

    layers: int = 8
    hidden: int = 1024
    intermediate: int = 2048
    group_size: int = 128  # of the GPTQ checkpoint
    output_len: int = 32
    single_requests: int = 4  # requests run one at a time for the 1-stream figure
    #: Rounds of a configuration, the best kept: they alternate between the Engines.
    rounds: int = 3
    launch_mode: str = "process"  # the Engines' (``thread`` starts faster)
    #: The Scheduler's torch threads (``--torch-threads``); None: the Engine's default plan,
    #: which leaves one core to the other components.
    torch_threads: int | None = None
    #: The checkpoint formats measured beside float32 (of ``WRITES``).
    formats: tuple[str, ...] = FORMATS
    #: The model's architecture: ``llama``, or ``mixtral`` with ``experts`` experts (each
    #: of ``intermediate`` width), two chosen per token.
    arch: str = "llama"
    experts: int = 8

    def describe(self) -> str:
        """The model, in words."""
        experts = f", {self.experts} experts (2 a token)" if self.arch == "mixtral" else ""
        return (f"random {self.arch.capitalize()}, {self.layers} layers, hidden {self.hidden}, "
                f"intermediate {self.intermediate}{experts}")

    def configurations(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The rows' configurations of float32 and ``formats``."""
        return [row for row in CONFIGURATIONS if row[1] == "float32" or row[1] in self.formats]


def write_checkpoints(settings: Settings, root: Path) -> dict[str, Path]:
    """The float32 checkpoint and each of ``settings.formats``' made from it, by name."""
    from framework.bench.offline import OfflineBenchSettings, write_model_dir
    from framework.cli_quantize import quantize_checkpoint

    shape = OfflineBenchSettings(layers=settings.layers, hidden=settings.hidden,
                                 heads=settings.hidden // 64,
                                 intermediate=settings.intermediate, arch=settings.arch,
                                 num_experts=settings.experts, top_k=2)
    paths = {"float32": root / "float32"}
    paths["float32"].mkdir()
    write_model_dir(shape, paths["float32"])
    for name in settings.formats:
        fmt, options = WRITES[name]
        paths[name] = root / name
        quantize_checkpoint(paths["float32"], paths[name], fmt, group_size=settings.group_size,
                            **options)
    return paths


def _prompts(count: int) -> list[str]:
    words = _WORDS.split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(24 + i % 16))
            for i in range(count)]


def run_configurations(paths: dict[str, Path], settings: Settings) -> list[dict[str, Any]]:
    """One row per configuration and stream count, from one Engine per configuration,
    all started at once.

    The rounds at a stream count alternate between the configurations (float32, int8,
    gptq, ..., then float32 again), so that a slower spell of a shared machine falls on
    every configuration alike rather than on the one that happened to run then.
    """
    from framework import Engine

    with ExitStack() as stack:
        engines = {name: stack.enter_context(Engine(
            model_path=str(paths[checkpoint]), dtype="float32", log_level="warning",
            max_running_requests=max(STREAMS), max_total_tokens=KV_TOKENS,
            launch_mode=settings.launch_mode,
            torch_threads=settings.torch_threads, **options))
            for name, checkpoint, options in settings.configurations()}
        weight_bytes = {name: engine.get_server_info()["weight_bytes_rank_0"]
                        for name, engine in engines.items()}
        for engine in engines.values():
            greedy_tokens_per_second(engine, _prompts(2), 2, 4)  # warm-up
        rows = []
        for streams in STREAMS:
            prompts = _prompts(settings.single_requests if streams == 1 else streams)
            best = dict.fromkeys(engines, 0.0)
            for _ in range(settings.rounds):
                for name, engine in engines.items():
                    best[name] = max(best[name], greedy_tokens_per_second(
                        engine, prompts, streams, settings.output_len))
            rows += [{"format": name, "streams": streams, "output_tokens_per_s": best[name],
                      "weight_bytes": weight_bytes[name]} for name in engines]
    order = [name for name, _, _ in settings.configurations()]
    return sorted(rows, key=lambda row: (order.index(row["format"]), row["streams"]))


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table, each row against float32's at the same streams."""
    base = {r["streams"]: r for r in rows if r["format"] == "float32"}
    lines = ["# Quantized weights", "",
             f"- Machine: {meta['machine']}", f"- Commit: {meta['commit']}",
             f"- Run: {meta['started_at']}", f"- Model: {meta['model']}",
             f"- Greedy, {meta['output_len']} output tokens per request, best of "
             f"{meta['rounds']} rounds", f"- Scheduler torch threads: {meta['torch_threads']}",
             "",
             "| format | streams | output tok/s | vs float32 | weight bytes | vs float32 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = base[r["streams"]]
        lines.append(
            f"| {r['format']} | {r['streams']} | {r['output_tokens_per_s']:,.1f} | "
            f"{r['output_tokens_per_s'] / ref['output_tokens_per_s']:.2f}x | "
            f"{r['weight_bytes']:,} | {r['weight_bytes'] / ref['weight_bytes']:.1%} |")
    return "\n".join(lines) + "\n"


def run_benchmark(settings: Settings, output: str) -> list[Path]:
    """Write the checkpoints, measure each, write the results; returns the files written."""
    meta = {**run_stamp(),
            "model": settings.describe(),
            "output_len": settings.output_len, "rounds": settings.rounds,
            "torch_threads": settings.torch_threads or "the default plan"}
    with tempfile.TemporaryDirectory(prefix="framework-quantized-") as tmp:
        paths = write_checkpoints(settings, Path(tmp))
        rows = run_configurations(paths, settings)
    return write_results(output, "quantized", {**meta, "rows": rows}, render(rows, meta))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench quantized`` flags."""
    default = Settings()
    for flag, text in (("layers", "decoder layers"), ("hidden", "hidden size (heads of 64)"),
                       ("intermediate", "MLP width (each expert's, with --arch mixtral)"),
                       ("experts", "experts of each layer, with --arch mixtral"),
                       ("group-size", "input features per GPTQ scale"),
                       ("output-len", "output tokens per request"),
                       ("single-requests", "requests run one at a time at 1 stream"),
                       ("rounds", "runs per configuration, the best kept")):
        value = getattr(default, flag.replace("-", "_"))
        parser.add_argument(f"--{flag}", type=int, default=value, metavar="N",
                            help=f"{text} (default: {value})")
    parser.add_argument("--arch", choices=("llama", "mixtral"), default=default.arch,
                        help=f"the random model's architecture (default: {default.arch})")
    parser.add_argument("--torch-threads", type=int, default=None, metavar="N",
                        help="the Engines' scheduler torch threads (default: the Engine's "
                        "plan, which leaves a core to the other components)")
    parser.add_argument("--formats", nargs="+", choices=sorted(WRITES), default=list(FORMATS),
                        metavar="FORMAT",
                        help=f"checkpoint formats measured beside float32, of "
                             f"{', '.join(sorted(WRITES))} (default: {' '.join(FORMATS)})")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench quantized``."""
    settings = Settings(layers=args.layers, hidden=args.hidden,
                        intermediate=args.intermediate, group_size=args.group_size,
                        output_len=args.output_len,
                        single_requests=args.single_requests, rounds=args.rounds,
                        torch_threads=args.torch_threads, formats=tuple(args.formats),
                        arch=args.arch, experts=args.experts)
    for path in run_benchmark(settings, args.output):
        print(f"wrote {path}")
    print(Path(args.output, "quantized.md").read_text())
    return 0
