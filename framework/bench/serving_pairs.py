"""The summary of ``benchmarks/run_serving_pairs.sh``: one server per transport × codec pair.

The script runs ``framework bench serving`` against a server started with each
pair and leaves, per pair, ``TRANSPORT-CODEC.json`` (the serving benchmark's
summary), optionally ``TRANSPORT-CODEC.server.json`` (the server's own
``/get_server_info`` fields that tell how it ran) and, for a pair the server
refused, ``TRANSPORT-CODEC.skipped.txt`` (why). This module reads them and
writes ``serving_pairs.md``: one row per pair, with each pair's output tokens/s
as a share of the Engine's in ``framework bench offline`` when its CSV is given.

Run it as ``python -m framework.bench.serving_pairs summarize DIR``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.bench.environment import git_commit, machine_description

SUMMARY_NAME = "serving_pairs.md"
DEFAULT_OFFLINE_CSV = Path("benchmarks/results/offline/offline.csv")
TRANSPORT_ORDER = ("zmq", "shm", "inproc")
CODEC_ORDER = ("pickle", "msgpack", "json")
_AUX_SUFFIXES = (".server.json",)
_SKIPPED_SUFFIX = ".skipped.txt"


@dataclass(frozen=True)
class PairResult:
    """One pair's figures, read from its ``framework bench serving`` summary."""

    transport: str
    codec: str
    output_throughput: float
    request_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    completed: int
    requests: int
    launch_mode: str | None
    summary: dict[str, Any]


def split_pair_name(stem: str) -> tuple[str, str]:
    """``zmq-pickle`` -> ``("zmq", "pickle")``; a ``ValueError`` for a name without a dash."""
    transport, sep, codec = stem.partition("-")
    if not sep or not transport or not codec:
        raise ValueError(f"not a TRANSPORT-CODEC name: {stem!r}")
    return transport, codec


def load_pair(path: Path) -> PairResult:
    """The pair whose serving summary is ``path`` (``TRANSPORT-CODEC.json``).

    The transport and codec come from ``TRANSPORT-CODEC.server.json`` when it is
    there (what the server reported), else from the file name.
    """
    summary = json.loads(path.read_text(encoding="utf-8"))
    transport, codec = split_pair_name(path.stem)
    launch_mode = None
    server_path = path.with_name(path.stem + ".server.json")
    if server_path.exists():
        server = json.loads(server_path.read_text(encoding="utf-8"))
        transport = server.get("transport", transport)
        codec = server.get("codec", codec)
        launch_mode = server.get("launch_mode")
    return PairResult(
        transport=transport, codec=codec,
        output_throughput=float(summary["output_throughput"]),
        request_throughput=float(summary["request_throughput"]),
        ttft_p50_ms=summary["ttft_ms"].get("p50"), ttft_p99_ms=summary["ttft_ms"].get("p99"),
        tpot_p50_ms=summary["tpot_ms"].get("p50"),
        completed=int(summary["completed"]), requests=int(summary["requests"]),
        launch_mode=launch_mode, summary=summary,
    )


def _order(transport: str, codec: str) -> tuple[int, str, int, str]:
    def rank(name: str, order: Sequence[str]) -> int:
        return order.index(name) if name in order else len(order)
    return rank(transport, TRANSPORT_ORDER), transport, rank(codec, CODEC_ORDER), codec


def _is_pair_summary(path: Path) -> bool:
    return not any(path.name.endswith(s) for s in _AUX_SUFFIXES) and "-" in path.stem


def load_pairs(directory: Path) -> list[PairResult]:
    """Every pair's result in ``directory``, transports then codecs in the script's order."""
    pairs = [load_pair(p) for p in directory.glob("*.json") if _is_pair_summary(p)]
    return sorted(pairs, key=lambda p: _order(p.transport, p.codec))


def load_skipped(directory: Path) -> dict[tuple[str, str], str]:
    """Pairs the script skipped, each with the reason it wrote."""
    skipped = {}
    for path in directory.glob(f"*{_SKIPPED_SUFFIX}"):
        pair = split_pair_name(path.name[:-len(_SKIPPED_SUFFIX)])
        skipped[pair] = path.read_text(encoding="utf-8").strip()
    return dict(sorted(skipped.items(), key=lambda item: _order(*item[0])))


def offline_engine_throughput(csv_path: Path) -> float | None:
    """The ``engine`` row's output tokens/s in ``framework bench offline``'s CSV, if any."""
    if not csv_path.exists():
        return None
    with csv_path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row.get("side") == "engine":
                return float(row["output_tokens_per_s"])
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _distinct(pairs: Sequence[PairResult], key: str, fallback: str) -> str:
    values = sorted({str(p.summary.get(key)) for p in pairs if p.summary.get(key)})
    return "; ".join(values) if values else fallback


def _run_span(pairs: Sequence[PairResult]) -> str:
    starts = sorted(str(p.summary["started_at"]) for p in pairs if p.summary.get("started_at"))
    if not starts:
        return "-"
    return starts[0] if starts[0] == starts[-1] else f"{starts[0]} to {starts[-1]}"


def _workload(pairs: Sequence[PairResult]) -> str:
    if not pairs:
        return "-"
    cfg = pairs[0].summary.get("settings", {})
    return (f"{cfg.get('num_prompts')} prompts of {cfg.get('input_len')} tokens, "
            f"{cfg.get('output_len')} output tokens each (ignore_eos), all at once, at most "
            f"{cfg.get('max_concurrency') or 'unbounded'} in flight")


def _row(pair: PairResult, offline: float | None) -> str:
    transport = pair.transport + (f" ({pair.launch_mode}s)" if pair.launch_mode == "thread"
                                  else "")
    cells = [transport, pair.codec, f"{pair.output_throughput:,.1f}",
             f"{pair.request_throughput:,.2f}", _ms(pair.ttft_p50_ms), _ms(pair.ttft_p99_ms),
             _ms(pair.tpot_p50_ms), f"{pair.completed}/{pair.requests}"]
    if offline is not None:
        cells.append(f"{pair.output_throughput / offline:.0%}")
    return "| " + " | ".join(cells) + " |"


def render_summary(pairs: Sequence[PairResult], skipped: dict[tuple[str, str], str],
                   offline: float | None, offline_source: str = str(DEFAULT_OFFLINE_CSV)
                   ) -> str:
    """``serving_pairs.md``: the machine, the commit, the workload and one row per pair."""
    lines = [
        "# Serving throughput per transport × codec",
        "",
        f"- Machine: {_distinct(pairs, 'machine', machine_description())}",
        f"- Commit: {_distinct(pairs, 'commit', git_commit())}",
        f"- Runs: {_run_span(pairs)}",
        f"- Workload (`framework bench serving`): {_workload(pairs)}",
    ]
    if offline is not None:
        lines.append(f"- Offline Engine (`framework bench offline`, {offline_source}): "
                     f"{offline:,.1f} output tokens/s")
    header = ["transport", "codec", "output tok/s", "req/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
              "TPOT p50 (ms)", "completed"]
    if offline is not None:
        header.append("% of offline Engine")
    lines += ["", "| " + " | ".join(header) + " |",
              "|---|---|" + "---:|" * (len(header) - 2)]
    lines += [_row(pair, offline) for pair in pairs]
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- {t} × {c}: {reason}" for (t, c), reason in skipped.items()]
    return "\n".join(lines) + "\n"


def summarize_dir(directory: Path, offline_csv: Path = DEFAULT_OFFLINE_CSV) -> Path:
    """Write ``serving_pairs.md`` in ``directory`` from the pair results there; its path."""
    pairs = load_pairs(directory)
    text = render_summary(pairs, load_skipped(directory), offline_engine_throughput(offline_csv),
                          str(offline_csv))
    path = directory / SUMMARY_NAME
    path.write_text(text, encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m framework.bench.serving_pairs summarize DIR [--offline-csv CSV]``."""
    parser = argparse.ArgumentParser(prog="python -m framework.bench.serving_pairs",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    summarize = commands.add_parser("summarize", help="write DIR/serving_pairs.md")
    summarize.add_argument("directory", type=Path, metavar="DIR")
    summarize.add_argument("--offline-csv", type=Path, default=DEFAULT_OFFLINE_CSV,
                           help=f"framework bench offline's CSV (default: {DEFAULT_OFFLINE_CSV}; "
                                "no percentage column when it is missing)")
    args = parser.parse_args(argv)
    path = summarize_dir(args.directory, args.offline_csv)
    print(path.read_text(encoding="utf-8"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
