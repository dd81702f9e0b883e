"""`framework bench speculative`: output tokens/s with speculative decoding against without.

For each decoding mode (``plain``, ``ngram`` and, with a draft model, ``draft``), one
``framework.Engine`` on the model (the embedded default model and its shipped draft unless
``--model-path`` and ``--draft-model-path``) runs two workloads of greedy
requests at 1 and at 8 streams (one request at a time, or eight sent together):

* **repeat**: a Python function, a blank line and its first line again, so that the
  continuation re-emits code the prompt holds (what an edit-in-place request does);
* **free**: the opening line of a function only, free generation.

Prompts end on the function's first line, without its newline: the embedded tokenizer
writes a newline together with the next line's indentation, so a prompt that ends on a
bare newline starts the model off at a token boundary its training never showed, and the
default model then loops on ``#`` lines, a run that prompt lookup drafts perfectly and
that says nothing of free generation.

Each configuration runs ``--rounds`` times after a warm-up and keeps its best round
(another job on the machine can slow a run down, never speed it up); the modes' Engines
run side by side and take turns round by round, so that the machine's slower spells
fall on every mode alike. It reports output
tokens/s, the speed-up over ``plain`` and, when speculating, the mean tokens a request gains
per verify step (``spec_accept_length`` over the run). Results, with the machine and
commit, go to ``--output`` as ``speculative.json`` and ``speculative.md``.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.bench.environment import greedy_tokens_per_second, run_stamp, write_results
from framework.config import DEFAULT_NUM_DRAFT_TOKENS

DEFAULT_OUTPUT = "benchmarks/results/speculative"
FUNCTIONS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "def read_lines(path):\n    with open(path) as handle:\n        lines = handle.readlines()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n",
    "def word_counts(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
]
WORKLOADS = {
    "repeat": [f"{code}\n\n{code.splitlines()[0]}" for code in FUNCTIONS],
    "free": [code.splitlines()[0] for code in FUNCTIONS],
}
MODES = {"plain": {}, "ngram": {"speculative_algorithm": "ngram"},
         "draft": {"speculative_algorithm": "draft"}}
STREAMS = (1, 8)


@dataclass
class Settings:
    """What one run of the benchmark does."""

    model_path: str | None = None
    #: The draft of the ``draft`` rows; None leaves them out.
    draft_model_path: str | None = "default-draft"
    output_len: int = 96
    #: ``--speculative-num-draft-tokens`` of both speculative modes; None: each mode's
    #: default (``DEFAULT_NUM_DRAFT_TOKENS``).
    num_draft_tokens: int | None = None
    #: Rounds of one configuration, the best kept: a one-stream round lasts about a second,
    #: and best-of-3 figures still moved by up to 30% between runs.
    rounds: int = 6
    launch_mode: str = "process"  # the Engines' (``thread`` starts faster)


def _prompts(workload: str, streams: int) -> list[str]:
    base = WORKLOADS[workload]
    return [base[i % len(base)] for i in range(max(streams, len(base)))]


def _spec_counters(engine: Any) -> tuple[int, int]:
    info = engine.get_server_info()
    return info.get("spec_verifications", 0), info.get("spec_accepted_tokens", 0)


def _engine_args(mode: str, settings: Settings) -> dict[str, Any]:
    args: dict[str, Any] = {"log_level": "warning", "launch_mode": settings.launch_mode,
                            **MODES[mode]}
    if mode != "plain" and settings.num_draft_tokens is not None:
        args["speculative_num_draft_tokens"] = settings.num_draft_tokens
    if mode == "draft":
        args["speculative_draft_model_path"] = settings.draft_model_path
    if settings.model_path:
        args["model_path"] = settings.model_path
    return args


def run_modes(modes: list[str], settings: Settings) -> list[dict[str, Any]]:
    """Every mode × workload × streams row, from one Engine per mode, all started at once.

    The rounds of a workload and stream count alternate between the modes (plain, then
    ngram, then draft, then plain again...), so that a slower spell of a shared machine
    falls on every mode alike rather than on the one that happened to run then.
    """
    from framework import Engine

    with ExitStack() as stack:
        engines = {mode: stack.enter_context(Engine(**_engine_args(mode, settings)))
                   for mode in modes}
        for engine in engines.values():
            greedy_tokens_per_second(engine, WORKLOADS["free"][:1], 1, 8)  # warm-up
        rows = [row for workload in WORKLOADS for streams in STREAMS
                for row in _measure(engines, workload, streams, settings)]
    return sorted(rows, key=lambda row: modes.index(row["mode"]))


def _measure(engines: dict[str, Any], workload: str, streams: int, settings: Settings
             ) -> list[dict[str, Any]]:
    """One row per mode of ``workload`` at ``streams``: the modes take turns, round by round."""
    prompts = _prompts(workload, streams)
    before = {mode: _spec_counters(engine) for mode, engine in engines.items()}
    best = dict.fromkeys(engines, 0.0)
    for _ in range(settings.rounds):
        for mode, engine in engines.items():
            best[mode] = max(best[mode], greedy_tokens_per_second(
                engine, prompts, streams, settings.output_len))
    rows = []
    for mode, engine in engines.items():
        after = _spec_counters(engine)
        steps = after[0] - before[mode][0]
        rows.append({"mode": mode, "workload": workload, "streams": streams,
                     "output_tokens_per_s": best[mode],
                     "accept_length": 1 + (after[1] - before[mode][1]) / steps
                     if steps else None})
    return rows


def _draft_tokens(given: int | None) -> str:
    if given is not None:
        return f"{given} draft tokens"
    return "draft tokens: " + ", ".join(f"{count} for {mode}"
                                        for mode, count in DEFAULT_NUM_DRAFT_TOKENS.items())


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table: each row with its speed-up over plain decoding."""
    plain = {(r["workload"], r["streams"]): r["output_tokens_per_s"]
             for r in rows if r["mode"] == "plain"}
    lines = ["# Speculative decoding", "",
             f"- Machine: {meta['machine']}", f"- Commit: {meta['commit']}",
             f"- Run: {meta['started_at']}", f"- Model: {meta['model']}",
             f"- Draft model: {meta['draft_model'] or 'none'}",
             f"- Greedy, {meta['output_len']} output tokens per request, "
             f"{_draft_tokens(meta['num_draft_tokens'])}, best of {meta['rounds']} rounds", "",
             "| workload | streams | mode | output tok/s | vs plain | mean accepted length |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        speedup = r["output_tokens_per_s"] / plain[(r["workload"], r["streams"])]
        accept = "" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        lines.append(f"| {r['workload']} | {r['streams']} | {r['mode']} | "
                     f"{r['output_tokens_per_s']:,.1f} | {speedup:.2f}x | {accept} |")
    return "\n".join(lines) + "\n"


def run_benchmark(settings: Settings, output: str) -> list[Path]:
    """Run every mode, write the results; returns the files written."""
    meta = {**run_stamp(),
            "model": settings.model_path or "the embedded default model",
            "draft_model": settings.draft_model_path,
            "output_len": settings.output_len, "num_draft_tokens": settings.num_draft_tokens,
            "rounds": settings.rounds}
    modes = [mode for mode in MODES if mode != "draft" or settings.draft_model_path]
    rows = run_modes(modes, settings)
    return write_results(output, "speculative", {**meta, "rows": rows}, render(rows, meta))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench speculative`` flags."""
    parser.add_argument("--model-path", default=None,
                        help="checkpoint to serve (default: the embedded default model)")
    parser.add_argument("--draft-model-path", default=None,
                        help="the draft of the draft rows (default: the embedded default "
                        "model's, when --model-path is not given; else no draft rows)")
    parser.add_argument("--output-len", type=int, default=Settings.output_len, metavar="N",
                        help=f"output tokens per request (default: {Settings.output_len})")
    parser.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                        help="--speculative-num-draft-tokens of the speculative runs (default: "
                        "each algorithm's own)")
    parser.add_argument("--rounds", type=int, default=Settings.rounds, metavar="N",
                        help=f"runs per configuration, the best kept (default: "
                        f"{Settings.rounds})")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"where the result files go (default: {DEFAULT_OUTPUT})")


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench speculative``."""
    draft = args.draft_model_path or (None if args.model_path else "default-draft")
    settings = Settings(model_path=args.model_path, draft_model_path=draft,
                        output_len=args.output_len,
                        num_draft_tokens=args.num_draft_tokens, rounds=args.rounds)
    for path in run_benchmark(settings, args.output):
        print(f"wrote {path}")
    print(Path(args.output, "speculative.md").read_text())
    return 0
