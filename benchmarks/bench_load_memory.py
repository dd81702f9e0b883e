"""Peak memory of starting a model: float32 against online and pre-quantized weights.

A random Llama (``--layers``, ``--hidden``, ``--intermediate``; untied LM head) is written
once in float32, with ``framework quantize``'s int8 and GPTQ (groups of 128) copies beside
it. Each configuration starts a ``ModelRunner`` (the Scheduler's model, KV cache of 256
tokens) in a process of its own, twice: the first start loads the libraries a start needs,
the second is measured: the growth of the anonymous resident memory (``RssAnon``, the
process's own pages) at its peak (sampled every millisecond) and after the start, of the
peak resident memory (``VmHWM``, reset before it; it counts the checkpoint's file pages
mapped while they are read), and the weight bytes held (with oneDNN's packed copies);
on a CUDA machine (``--device cuda``) the peak of allocated GPU memory too.
``--framework-root`` runs the processes on another checkout's ``framework`` (an earlier
commit, to compare). Writes
``load_memory.json`` and ``load_memory.md`` (machine, commit) to ``--output`` (default
``benchmarks/results/load_memory``)::

    python benchmarks/bench_load_memory.py
    python benchmarks/bench_load_memory.py --framework-root /tmp/old --output /tmp/old_run

On a CPU, memory is committed as pages are written: float weights allocated and never
written do not show in resident memory, where on a GPU they take their bytes at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from framework.bench.environment import run_stamp, write_results

#: The rows: label, checkpoint, ``ServerArgs`` options.
CONFIGURATIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("float32", "float32", {}),
    ("int8 online (--quantization int8)", "float32", {"quantization": "int8"}),
    ("fp8 online (--quantization fp8)", "float32", {"quantization": "fp8"}),
    ("int8 checkpoint", "int8", {}),
    ("GPTQ checkpoint (groups of 128)", "gptq", {}),
)
MIB = 2**20


def write_checkpoints(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """The float32 checkpoint and its int8 and GPTQ copies, by name."""
    from framework.bench.offline import OfflineBenchSettings, write_model_dir
    from framework.cli_quantize import quantize_checkpoint

    paths = {name: root / name for name in ("float32", "int8", "gptq")}
    paths["float32"].mkdir()
    write_model_dir(OfflineBenchSettings(layers=args.layers, hidden=args.hidden,
                                         heads=args.hidden // 64,
                                         intermediate=args.intermediate), paths["float32"])
    quantize_checkpoint(paths["float32"], paths["int8"], "int8")
    quantize_checkpoint(paths["float32"], paths["gptq"], "gptq", group_size=128)
    return paths


def start_once(model_path: str, options: dict[str, Any], device: str) -> dict[str, Any]:
    """Start one ModelRunner here (a fresh process) twice, the first to load the libraries
    its start needs; what the second start took: the growth of the peak resident memory
    (``VmHWM``, reset before it), the resident memory after it and the weights."""
    import gc

    import torch

    from framework.config import ServerArgs
    from framework.model_executor.model_runner import ModelRunner, weight_bytes

    torch.set_num_threads(1)
    server_args = ServerArgs(model_path=model_path, dtype="float32", device=device,
                             max_total_tokens=256, log_level="warning", **options)
    del ModelRunner(server_args, model_path).model
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again
    before, anon_before = _status_bytes("VmRSS"), _status_bytes("RssAnon")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with AnonPeak() as anon:
        runner = ModelRunner(server_args, model_path)
    result = {"peak_growth_mib": round((_status_bytes("VmHWM") - before) / MIB, 1),
              "anon_peak_growth_mib": round((anon.peak - anon_before) / MIB, 1),
              "anon_after_mib": round((_status_bytes("RssAnon") - anon_before) / MIB, 1),
              "weight_mib": round(weight_bytes(runner.model)[1] / MIB, 1)}
    if device == "cuda":
        result["gpu_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
    return result


class AnonPeak:
    """The largest anonymous resident memory (``RssAnon``: the process's own pages, not the
    checkpoint's mapped file pages) seen every millisecond by a thread while in ``with``."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_bytes("RssAnon"))

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status_bytes("RssAnon"))


def _status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (given in kB), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(paths: dict[str, Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per configuration, each started in a process of its own."""
    # A fixed mmap threshold: freed blocks of 128 KiB or more go back to the system at
    # once, so the second start cannot reuse the first's freed heap and hide its growth.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    if args.framework_root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.framework_root,
                                                          env.get("PYTHONPATH")]))
    rows = []
    for label, checkpoint, options in CONFIGURATIONS:
        child = json.dumps({"model_path": str(paths[checkpoint]), "options": options,
                            "device": args.device})
        done = subprocess.run([sys.executable, __file__, "--child", child], env=env,
                              cwd=args.framework_root or None, capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{label}: {done.stderr.strip()[-2000:]}")
        rows.append({"configuration": label, **json.loads(done.stdout.splitlines()[-1])})
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table."""
    gpu = any("gpu_peak_mib" in row for row in rows)
    lines = ["# Peak memory of a start", "", f"- Machine: {meta['machine']}",
             f"- Commit: {meta['commit']}" + (f" (framework from {meta['framework_root']})"
                                               if meta["framework_root"] else ""),
             f"- Run: {meta['started_at']}", f"- Model: {meta['model']}", "",
             "| configuration | weights (MiB) | anonymous memory: peak growth (MiB) | "
             "anonymous memory: growth kept (MiB) | peak RSS growth (MiB) |"
             + (" GPU peak (MiB) |" if gpu else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
    for row in rows:
        lines.append(f"| {row['configuration']} | {row['weight_mib']:,.1f} | "
                     f"{row['anon_peak_growth_mib']:,.1f} | {row['anon_after_mib']:,.1f} | "
                     f"{row['peak_growth_mib']:,.1f} |"
                     + (f" {row['gpu_peak_mib']:,.1f} |" if gpu else ""))
    return "\n".join(lines) + "\n"


def _commit_of(root: str) -> str:
    """``root`` and the commit checked out there."""
    done = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return f"{root} at commit {done.stdout.strip() or 'unknown'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--framework-root", default=None,
                        help="a checkout whose framework package the starts import")
    parser.add_argument("--output", default="benchmarks/results/load_memory")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(start_once(spec["model_path"], spec["options"], spec["device"])))
        return 0
    meta = {**run_stamp(), "framework_root": args.framework_root and _commit_of(
                args.framework_root),
            "model": f"random Llama, {args.layers} layers, hidden {args.hidden}, "
                     f"intermediate {args.intermediate}, float32"}
    with tempfile.TemporaryDirectory() as root:
        rows = measure(write_checkpoints(args, Path(root)), args)
    for path in write_results(args.output, "load_memory", {**meta, "rows": rows},
                              render(rows, meta)):
        print(path)
    print(render(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
