"""Greedy agreement and perplexity of the quantized default model against the float32 one.

8 sets of 64 prompts of 4 to 30 code words, 16 greedy tokens each, through the Engine on the
embedded default model in float32 with ``--linear-backend torch`` (the reference), then
with int8 and FP8 quantized online and from GPTQ and AWQ checkpoints that
``framework quantize`` writes (round to nearest, group ``--group-size``; int8, GPTQ and
AWQ also on the ``cpu_a8`` quantized-linear kernel; int8 with the embedding table, which
the default model's LM head is tied to, in int8 too; and every format written by
``framework quantize --calibration-data`` on the standard library's top-level modules,
the default model's training text, at calibration seeds ``--seeds``; and with
``--rounding-steps`` of learned rounding, FP8 at every seed, the other formats at the
first): how many prompts of each set of 64 give the reference's tokens exactly (their mean
over the sets, and the fewest and most); and each one's perplexity on a held-out
code file (``HELD_OUT``: this project's own source, which the default model, trained on
the Python standard library, never saw), scored in windows of ``WINDOW`` tokens through
prompt logprobs. Writes ``agreement.md`` and ``agreement.json`` (machine, commit) to
``--output`` (default ``benchmarks/results/quant_agreement``). Run:
``python benchmarks/quant_agreement.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("def return class import for while if else print self value list dict data result "
         "index count name file")
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
HELD_OUT = ROOT / "framework/mem_cache/radix_cache.py"
WINDOW = 512
#: Prompts per set: the goal counts identical outputs of 64.
SET = 64


def prompts(count: int = 64, sets: int = 8) -> list[str]:
    """``sets`` sets of ``count`` prompts of random code words, each set fixed by its
    index as seed."""
    words = WORDS.split()
    texts = []
    for seed in range(sets):
        rng = random.Random(seed)
        texts += [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))
                  for _ in range(count)]
    return texts


def measure(texts: list[str], windows: list[list[int]], **engine_args: Any
            ) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens, and the perplexity over ``windows`` of token ids,
    from an Engine on the default model in float32."""
    from framework import Engine

    args = {"log_level": "warning", "launch_mode": "thread", "dtype": "float32",
            "linear_backend": "torch", **engine_args}
    with Engine(**args) as engine:
        tokens = [out["output_ids"] for out in engine.generate(texts, GREEDY)]
        scored = engine.generate(input_ids=windows, sampling_params={"max_new_tokens": 0},
                                 return_logprob=True, logprob_start_len=0)
    logprobs = [lp for out in scored for lp, _, _ in out["meta_info"]["input_token_logprobs"]
                if lp is not None]
    return tokens, math.exp(-sum(logprobs) / len(logprobs))


def held_out_windows() -> list[list[int]]:
    """``HELD_OUT``'s tokens in windows of ``WINDOW``."""
    from framework.default_model import default_model_path
    from framework.runtime.hf_tokenizer import load_tokenizer

    ids = load_tokenizer(default_model_path())(HELD_OUT.read_text())["input_ids"]
    return [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW) if len(ids[i:i + WINDOW]) > 1]


def stdlib_modules() -> tuple[Path, ...]:
    """The standard library's top-level ``.py`` files (the calibration text)."""
    return tuple(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


def main(argv: list[str] | None = None) -> int:
    """Measure every format; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="calibration seeds (each picks other windows)")
    parser.add_argument("--rounding-steps", type=int, default=200,
                        help="learned rounding's steps in the learned copies")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks/results/quant_agreement")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from framework.bench.environment import git_commit, machine_description
    from framework.cli_quantize import quantize_checkpoint
    from framework.default_model import default_model_path
    from framework.layers.quantization.calibration import CalibrationSettings

    texts, windows = prompts(), held_out_windows()
    reference, float_ppl = measure(texts, windows)
    results = {"int8 (online)": measure(texts, windows, quantization="int8"),
               "int8 (online), cpu_a8": measure(texts, windows, quantization="int8",
                                                quantized_linear_backend="cpu_a8"),
               "int8 (online), int8 embeddings": measure(texts, windows, quantization="int8",
                                                         quantize_embeddings=True),
               "int8 embeddings alone": measure(texts, windows, quantize_embeddings=True),
               "fp8 (online)": measure(texts, windows, quantization="fp8")}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("gptq", "awq"):
            directory = Path(tmp) / fmt
            quantize_checkpoint(default_model_path(), directory, fmt, group_size=args.group_size)
            results[f"{fmt} (group {args.group_size})"] = measure(
                texts, windows, model_path=str(directory))
            results[f"{fmt} (group {args.group_size}), cpu_a8"] = measure(
                texts, windows, model_path=str(directory), quantized_linear_backend="cpu_a8")
        learned = [("fp8", seed) for seed in args.seeds] + [
            (fmt, args.seeds[0]) for fmt in ("int8", "gptq", "awq")]
        copies = [(fmt, seed, 0) for fmt in ("fp8", "int8", "gptq", "awq")
                  for seed in args.seeds] + [
            (fmt, seed, args.rounding_steps) for fmt, seed in learned]
        for fmt, seed, steps in copies:
            directory = Path(tmp) / f"{fmt}-calibrated-{seed}-{steps}"
            calibration = CalibrationSettings(stdlib_modules(), seed=seed, rounding_steps=steps)
            quantize_checkpoint(default_model_path(), directory, fmt,
                                group_size=args.group_size, calibration=calibration)
            group = f"group {args.group_size}, " if fmt in ("gptq", "awq") else ""
            how = "calibrated, learned rounding" if steps else "calibrated"
            results[f"{fmt} ({group}{how}, seed {seed})"] = measure(
                texts, windows, model_path=str(directory))
    same = {name: [sum(a == b for a, b in zip(reference[i:i + SET], got[i:i + SET],
                                              strict=True))
                   for i in range(0, len(texts), SET)]
            for name, (got, _) in results.items()}
    ppl = {"float32": float_ppl, **{name: value for name, (_, value) in results.items()}}
    meta = {"machine": machine_description(), "commit": git_commit(),
            "prompts": len(texts), "set": SET, "new_tokens": GREEDY["max_new_tokens"],
            "rounding_steps": args.rounding_steps,
            "held_out": str(HELD_OUT.relative_to(ROOT)),
            "held_out_tokens": sum(len(w) for w in windows)}
    args.output.mkdir(parents=True, exist_ok=True)
    record = {**meta, "identical": same, "perplexity": ppl}
    (args.output / "agreement.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# Greedy agreement and perplexity against float32 (default model)", "",
             f"- Machine: {meta['machine']}", f"- Commit: {meta['commit']}",
             f"- {len(texts) // SET} sets of {SET} prompts, {GREEDY['max_new_tokens']} "
             "greedy tokens each; learned rounding: "
             f"{args.rounding_steps} steps",
             f"- Perplexity on {meta['held_out']} ({meta['held_out_tokens']} tokens, "
             f"windows of {WINDOW})", "",
             f"| format | identical of {SET} (mean) | fewest-most | first set | perplexity |",
             "|---|---:|---:|---:|---:|",
             f"| float32 | {SET} | {SET}-{SET} | {SET} | {float_ppl:.3f} |",
             *(f"| {name} | {sum(counts) / len(counts):.1f} | {min(counts)}-{max(counts)} | "
               f"{counts[0]} | {ppl[name]:.3f} |" for name, counts in same.items())]
    (args.output / "agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
