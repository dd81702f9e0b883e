"""`framework bench latency`: where one stream's time per output token goes.

One greedy request at a time, streamed through ``framework.Engine`` (its Scheduler and
Detokenizer in their own processes, as the server runs them). For the decode phase of
the request it reports, in milliseconds per output token:

* **client**: the time per output token as the caller of ``Engine.generate(...,
  stream=True)`` sees it: from the chunk with the first token to the one with the
  last, over the tokens between them;
* **step**: the Scheduler's steps (``get_server_info``'s ``step_seconds``), split into
  the **model forward** (``forward_seconds``, measured by the model worker) and the
  **Scheduler outside the forward** (batch building, sampling, stop checks, sending
  the output);
* **between steps**: client minus step, the Scheduler loop's time outside its steps
  (and anything else that delays the next step);
* **the output's way to the client** (``output_path_*`` of ``get_server_info``, from
  stamps on the messages): Scheduler → Detokenizer, detokenization, Detokenizer →
  TokenizerManager, and the TokenizerManager's applying it. These are latency each
  output adds after its step, divided by the tokens; with the components on other
  cores they overlap the next step rather than add to the client's time per token.

The prefill is kept out: the counters are read when the first chunk arrives (the
prefill is over then) and again after the last, so the per-token figures are the
growth of the counters over the decode steps between, one token each. That first read
is one ``get_server_info`` call while the request runs, which the Scheduler answers
at the start of a step (a few tenths of a millisecond in one step of over a hundred).
The output path's figures and the outputs per token are taken over the whole request
instead (per decode step of it): that mid-stream call reads the Scheduler's counters
and the TokenizerManager's at two moments, and outputs applied between them would be
counted on the wrong side. The prefix cache is flushed before each request. Each model
keeps its run with the lowest client time per token: another job on the machine can
slow a run down, never speed it up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.bench.environment import git_commit, machine_description

DEFAULT_OUTPUT = "benchmarks/results/latency"
#: ``default``: the embedded model the server serves without ``--model-path``; ``llama``:
#: a random Llama of ``--layers`` and ``--hidden`` (the offline benchmark's model).
MODEL_NAMES = ("default", "llama")
#: Fewer output tokens leave too few decode steps after the first chunk to measure.
MIN_OUTPUT_LEN = 8
#: Python, which the embedded model continues; any model's tokenizer takes it.
PROMPT = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
          "    if n < 2:\n        return n\n")


@dataclass(frozen=True)
class LatencyBenchSettings:
    """Which models, how long a stream, and how many runs."""

    #: ``default``, ``llama`` or a model directory, each measured in turn.
    models: tuple[str, ...] = MODEL_NAMES
    layers: int = 4  # of the ``llama`` model
    hidden: int = 256  # of the ``llama`` model
    output_len: int = 128
    repeats: int = 5
    torch_threads: int | None = None  # None: the runtime's rule for its Scheduler
    seed: int = 0

    @classmethod
    def quick(cls) -> LatencyBenchSettings:
        """A tiny random Llama and a short stream: seconds (a first look, and the tests)."""
        return cls(models=("llama",), layers=2, hidden=64, output_len=16, repeats=2)

    def check(self) -> None:
        """Refuse settings that cannot run, naming the field (a ``ValueError``)."""
        if not self.models:
            raise ValueError("models must name at least one model")
        for name in ("layers", "hidden", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.output_len < MIN_OUTPUT_LEN:
            raise ValueError(f"output_len must be at least {MIN_OUTPUT_LEN} (decode steps to "
                             f"measure after the first chunk), got {self.output_len}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")


@dataclass(frozen=True)
class Counters:
    """The Engine's cumulative counters, as ``get_server_info`` reports them."""

    step_seconds: float
    forward_seconds: float
    decode_steps: int
    extend_steps: int
    outputs: int
    scheduler_to_detokenizer_seconds: float
    detokenize_seconds: float
    detokenizer_to_manager_seconds: float
    manager_seconds: float

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Counters:
        """The counters out of a ``get_server_info`` answer."""
        return cls(info["step_seconds"], info["forward_seconds"], info["decode_steps"],
                   info["extend_steps"], info["output_path_outputs"],
                   info["output_path_scheduler_to_detokenizer_seconds"],
                   info["output_path_detokenize_seconds"],
                   info["output_path_detokenizer_to_manager_seconds"],
                   info["output_path_manager_seconds"])

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other), strict=True)))


@dataclass(frozen=True)
class Breakdown:
    """One run's decode phase, in milliseconds per output token (see the module docstring)."""

    client_ms: float
    step_ms: float
    forward_ms: float
    scheduler_ms: float  # the step outside the model forward, sampling included
    between_steps_ms: float  # client minus step
    scheduler_to_detokenizer_ms: float
    detokenize_ms: float
    detokenizer_to_manager_ms: float
    manager_ms: float
    outputs_per_token: float  # text outputs sent per token (1 / the stream interval, about)
    first_token_ms: float  # from the call to the first chunk

    @property
    def non_model_share(self) -> float:
        """The client's time per token outside the model forward, as a share of it."""
        return 1.0 - self.forward_ms / self.client_ms

    @classmethod
    def of(cls, client_tokens: int, client_seconds: float, counters: Counters,
           whole: Counters, first_token_seconds: float) -> Breakdown:
        """Per-token figures: the client's ``client_seconds`` over ``client_tokens``, the
        Scheduler's counters' growth over their decode steps (one token each), and the
        output path's over the ``whole`` request.

        The output path's sums come from the whole request, between two quiet moments:
        a snapshot taken mid-stream reads the Scheduler's counters and the manager's at two
        moments, and the outputs applied in between would fall on the wrong side.
        """
        per = 1e3 / counters.decode_steps
        step = counters.step_seconds * per
        client = client_seconds * 1e3 / client_tokens
        per_whole = 1e3 / whole.decode_steps
        return cls(
            client_ms=client, step_ms=step, forward_ms=counters.forward_seconds * per,
            scheduler_ms=(counters.step_seconds - counters.forward_seconds) * per,
            between_steps_ms=client - step,
            scheduler_to_detokenizer_ms=whole.scheduler_to_detokenizer_seconds * per_whole,
            detokenize_ms=whole.detokenize_seconds * per_whole,
            detokenizer_to_manager_ms=whole.detokenizer_to_manager_seconds * per_whole,
            manager_ms=whole.manager_seconds * per_whole,
            outputs_per_token=whole.outputs / whole.decode_steps,
            first_token_ms=first_token_seconds * 1e3,
        )


@dataclass
class ModelResult:
    """One model's runs: what it is, how it was served, its best run and every run's."""

    name: str
    description: str  # layers, hidden, vocabulary, served dtype and backends
    best: Breakdown
    runs: list[Breakdown]


@dataclass
class LatencyBenchResult:
    """Every model's result, and the files written."""

    settings: LatencyBenchSettings
    threads: int
    engine_args: dict[str, Any]
    models: list[ModelResult]
    paths: list[Path] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- one stream


class StreamTimer:
    """An Engine serving one model, timing one streamed greedy request at a time."""

    def __init__(self, model_path: str, threads: int, engine_args: dict[str, Any]) -> None:
        from framework import Engine

        self.engine = Engine(model_path=model_path, torch_threads=threads, log_level="warning",
                             **engine_args)

    def counters(self) -> Counters:
        """The Engine's counters now."""
        return Counters.from_info(self.engine.get_server_info())

    def stream(self, tokens: int) -> tuple[list[float], list[int], Counters, Counters]:
        """One request for ``tokens`` tokens from an empty prefix cache.

        Returns each chunk's ``perf_counter`` time (the call's start first) and token
        count so far, the counters' growth from the first chunk to the end, and over
        the whole request.
        """
        flushed = self.engine.flush_cache()
        if not getattr(flushed, "success", True):
            raise RuntimeError(f"the prefix cache could not be flushed: {flushed.message}")
        before = self.counters()
        params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        times, counts = [time.perf_counter()], [0]
        first: Counters | None = None
        for chunk in self.engine.generate(PROMPT, params, stream=True):
            times.append(time.perf_counter())
            counts.append(counts[-1] + len(chunk["output_ids"]))
            if first is None:
                first = self.counters()  # the prefill is over: decode steps from here
        if counts[-1] != tokens or first is None:
            raise RuntimeError(f"the stream made {counts[-1]} tokens, not {tokens}")
        end = self.counters()
        return times, counts, end - first, end - before

    def run(self, output_len: int) -> Breakdown:
        """One measured request of ``output_len`` tokens."""
        times, counts, decode, whole = self.stream(output_len)
        if decode.extend_steps or decode.decode_steps < 1:
            raise RuntimeError(f"{decode.extend_steps} prefill and {decode.decode_steps} decode "
                               "steps after the first chunk: the Engine ran something else "
                               "meanwhile, or the stream was too short")
        # The client's time per token: from the chunk with the first token to the last.
        return Breakdown.of(counts[-1] - counts[1], times[-1] - times[1], decode, whole,
                            times[1] - times[0])

    def info(self) -> dict[str, Any]:
        """The Engine's ``get_server_info``."""
        return self.engine.get_server_info()

    def close(self) -> None:
        """Stop the Engine."""
        self.engine.shutdown()


@contextmanager
def model_directory(name: str, settings: LatencyBenchSettings) -> Iterator[str]:
    """The directory of model ``name``: the embedded one, a random Llama written to a
    temporary directory (removed after), or the path given."""
    if name == "default":
        from framework.default_model import default_model_path

        yield default_model_path()
    elif name == "llama":
        from framework.bench.offline import OfflineBenchSettings, write_model_dir

        shape = OfflineBenchSettings(layers=settings.layers, hidden=settings.hidden,
                                     seed=settings.seed)
        with tempfile.TemporaryDirectory(prefix="framework-bench-") as tmp:
            yield str(write_model_dir(shape, Path(tmp)))
    else:
        yield name


def describe_model(name: str, path: str, info: dict[str, Any]) -> str:
    """What was measured: the model's shape from its config, and how it was served."""
    config = json.loads((Path(path) / "config.json").read_text())
    what = {"default": "the embedded default model", "llama": "a random Llama"}.get(name, name)
    return (f"{what}: {config.get('num_hidden_layers')} layers, hidden "
            f"{config.get('hidden_size')}, vocabulary {config.get('vocab_size'):,}, served in "
            f"{info['dtype']} on {info['device']}, attention backend "
            f"`{info['attention_backend']}`, linear backend `{info['linear_backend']}`")


def measure_model(name: str, settings: LatencyBenchSettings, threads: int,
                  engine_args: dict[str, Any]) -> ModelResult:
    """Warm one Engine up on ``name``, then run it ``repeats`` times; keep the best run."""
    with model_directory(name, settings) as path:
        timer = StreamTimer(path, threads, engine_args)
        try:
            description = describe_model(name, path, timer.info())
            print(f"{name}: {description}", flush=True)
            timer.stream(MIN_OUTPUT_LEN)  # first calls' costs stay out
            runs = []
            for repeat in range(settings.repeats):
                runs.append(timer.run(settings.output_len))
                print(f"{name} run {repeat + 1}/{settings.repeats}: "
                      f"{_format_breakdown(runs[-1])}", flush=True)
        finally:
            timer.close()
    return ModelResult(name, description, min(runs, key=lambda run: run.client_ms), runs)


def _format_breakdown(run: Breakdown) -> str:
    return (f"client {run.client_ms:.3f} ms/token, step {run.step_ms:.3f} (forward "
            f"{run.forward_ms:.3f}, Scheduler {run.scheduler_ms:.3f}), between steps "
            f"{run.between_steps_ms:.3f}; output path {run.scheduler_to_detokenizer_ms:.3f} + "
            f"{run.detokenize_ms:.3f} + {run.detokenizer_to_manager_ms:.3f} + "
            f"{run.manager_ms:.3f}")


def run_benchmark(settings: LatencyBenchSettings, output_dir: str | Path,
                  engine_args: dict[str, Any] | None = None) -> LatencyBenchResult:
    """Measure every model of ``settings`` and write ``latency.md`` and ``latency.json``.

    ``engine_args``: extra ``Engine`` keywords (``transport``, ``codec``, ...).
    """
    from framework.bench.offline import quiet_transformers

    settings.check()
    engine_args = dict(engine_args or {})
    threads = settings.torch_threads
    if threads is None:
        from framework.runtime.launch import torch_threads_per_rank, usable_cores

        threads = torch_threads_per_rank(usable_cores(), 1)
    with quiet_transformers():
        models = [measure_model(name, settings, threads, engine_args)
                  for name in settings.models]
    result = LatencyBenchResult(settings, threads, engine_args, models)
    result.paths = write_results(result, Path(output_dir))
    return result


# --------------------------------------------------------------------------- results

#: (Breakdown field, what the row measures) in the order of the tables.
ROWS: tuple[tuple[str, str], ...] = (
    ("client_ms", "**client: time per output token** (`Engine.generate(stream=True)`)"),
    ("step_ms", "Scheduler step"),
    ("forward_ms", "of which the model forward"),
    ("scheduler_ms", "of which the rest: batch, sampling, stop checks, output sent"),
    ("between_steps_ms", "between steps (client minus step)"),
    ("scheduler_to_detokenizer_ms", "output path: Scheduler → Detokenizer"),
    ("detokenize_ms", "output path: detokenization"),
    ("detokenizer_to_manager_ms", "output path: Detokenizer → TokenizerManager"),
    ("manager_ms", "output path: TokenizerManager applying it"),
)


def render_markdown(result: LatencyBenchResult) -> str:
    """The results as Markdown tables headed by the machine, the commit and the settings."""
    s = result.settings
    args = ", ".join(f"{k}={v}" for k, v in sorted(result.engine_args.items())) or "none"
    lines = [
        "# One stream: where the time per output token goes",
        "",
        f"- Machine: {machine_description()}",
        f"- Python {platform.python_version()}, commit {git_commit()}",
        f"- Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Workload: one greedy streamed request at a time, {s.output_len} output tokens "
        f"(EOS ignored), prompt {PROMPT!r}; the Engine's counters from the first chunk "
        "(the prefill over) to the last, the client's time from the first chunk to the "
        f"last; best of {s.repeats} runs after one warm-up request",
        f"- Scheduler on {result.threads} torch thread(s); Engine arguments: {args}",
        "",
    ]
    for model in result.models:
        best = model.best
        lines += [
            f"## {model.name}",
            "",
            f"{model.description[0].upper()}{model.description[1:]}.",
            "",
            "| per output token | ms | share of client |",
            "|---|---:|---:|",
        ]
        for field_name, label in ROWS:
            value = getattr(best, field_name)
            lines.append(f"| {label} | {value:.3f} | {value / best.client_ms:.1%} |")
        lines += [
            "",
            f"Client time per token {best.client_ms:.3f} ms is "
            f"{best.client_ms / best.forward_ms:.2f}× the model forward (non-model share "
            f"{best.non_model_share:.1%}). Text outputs per token: "
            f"{best.outputs_per_token:.2f}; time to the first token: "
            f"{best.first_token_ms:.1f} ms. Client ms/token of every run: "
            + ", ".join(f"{run.client_ms:.3f}" for run in model.runs) + ".",
            "",
        ]
    return "\n".join(lines)


def write_results(result: LatencyBenchResult, output_dir: Path) -> list[Path]:
    """``latency.md`` and ``latency.json`` (with the machine and the commit)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    md_path = output_dir / "latency.md"
    md_path.write_text(render_markdown(result))
    json_path = output_dir / "latency.json"
    payload = {
        "machine": machine_description(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "settings": dataclasses.asdict(result.settings),
        "torch_threads": result.threads,
        "engine_args": result.engine_args,
        "models": [{"name": m.name, "description": m.description,
                    "best": dataclasses.asdict(m.best),
                    "runs": [dataclasses.asdict(run) for run in m.runs]}
                   for m in result.models],
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return [md_path, json_path]


# --------------------------------------------------------------------------- command line

# flag name -> (settings field, type, help)
_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--layers": ("layers", int, "decoder layers of the random Llama"),
    "--hidden": ("hidden", int, "hidden size of the random Llama (the MLP is 3× as wide)"),
    "--output-len": ("output_len", int, "greedy output tokens of the measured request"),
    "--repeats": ("repeats", int, "measured runs per model; the fastest is kept"),
    "--torch-threads": ("torch_threads", int, "torch threads of the Scheduler (default: the "
                        "runtime's rule)"),
}
# Engine arguments passed on as given: flag -> (keyword, type).
_ENGINE_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--attention-backend": ("attention_backend", str),
    "--linear-backend": ("linear_backend", str),
    "--transport": ("transport", str),
    "--codec": ("codec", str),
    "--stream-interval": ("stream_interval", int),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench latency`` flags."""
    default = LatencyBenchSettings()
    parser.add_argument("--models", default=None, metavar="NAMES",
                        help="comma list of models: default (the embedded model), llama (a "
                             "random Llama of --layers and --hidden) or a model directory "
                             f"(default: {','.join(default.models)})")
    for flag, (name, kind, text) in _FLAGS.items():
        value = getattr(default, name)
        shown = "" if value is None else f" (default: {value})"
        parser.add_argument(flag, type=kind, default=None, metavar="N", help=text + shown)
    for flag, (_, kind) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, metavar="VALUE",
                            help=f"the Engine's {flag} (default: the server's)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random Llama and a short stream: seconds, rough numbers "
                             "(flags given explicitly still apply)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def settings_from_args(args: argparse.Namespace) -> LatencyBenchSettings:
    """The defaults (or the quick ones), with every flag given on the command line."""
    base = LatencyBenchSettings.quick() if args.quick else LatencyBenchSettings()
    given: dict[str, Any] = {name: getattr(args, name) for name, _, _ in _FLAGS.values()
                             if getattr(args, name) is not None}
    if args.models is not None:
        given["models"] = tuple(name for name in args.models.split(",") if name)
    return dataclasses.replace(base, **given)


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench latency``."""
    engine_args = {name: getattr(args, name) for name, _ in _ENGINE_FLAGS.values()
                   if getattr(args, name) is not None}
    result = run_benchmark(settings_from_args(args), args.output, engine_args)
    for path in result.paths:
        print(f"wrote {path}")
    return 0
