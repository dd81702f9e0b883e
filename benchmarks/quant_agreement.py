"""Greedy agreement of the quantized default model with the float32 one.

64 prompts of 4 to 30 code words, 16 greedy tokens each, through the Engine on the
embedded default model in float32 with ``--linear-backend torch`` (the reference), then
with int8 and FP8 quantized online and from GPTQ and AWQ checkpoints that
``framework quantize`` writes (round to nearest, group ``--group-size``): how many
prompts give the reference's tokens exactly. Writes ``agreement.md`` and
``agreement.json`` (machine, commit) to ``--output`` (default
``benchmarks/results/quant_agreement``). Run: ``python benchmarks/quant_agreement.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("def return class import for while if else print self value list dict data result "
         "index count name file")
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def prompts(count: int = 64) -> list[str]:
    """The prompts: random code words, fixed by the seed."""
    rng = random.Random(0)
    words = WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))
            for _ in range(count)]


def outputs(texts: list[str], **engine_args: Any) -> list[list[int]]:
    """Each prompt's greedy tokens from an Engine on the default model, float32."""
    from framework import Engine

    args = {"log_level": "warning", "launch_mode": "thread", "dtype": "float32",
            "linear_backend": "torch", **engine_args}
    with Engine(**args) as engine:
        return [out["output_ids"] for out in engine.generate(texts, GREEDY)]


def main(argv: list[str] | None = None) -> int:
    """Measure every format; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks/results/quant_agreement")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from framework.bench.environment import git_commit, machine_description
    from framework.cli_quantize import quantize_checkpoint
    from framework.default_model import default_model_path

    texts = prompts()
    reference = outputs(texts)
    results = {"int8 (online)": outputs(texts, quantization="int8"),
               "fp8 (online)": outputs(texts, quantization="fp8")}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("gptq", "awq"):
            directory = Path(tmp) / fmt
            quantize_checkpoint(default_model_path(), directory, fmt, group_size=args.group_size)
            results[f"{fmt} (group {args.group_size})"] = outputs(texts,
                                                                  model_path=str(directory))
    same = {name: sum(a == b for a, b in zip(reference, got, strict=True))
            for name, got in results.items()}
    meta = {"machine": machine_description(), "commit": git_commit(),
            "prompts": len(texts), "new_tokens": GREEDY["max_new_tokens"]}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "agreement.json").write_text(json.dumps({**meta, "identical": same},
                                                           indent=2) + "\n")
    lines = ["# Greedy agreement with float32 (default model)", "",
             f"- Machine: {meta['machine']}", f"- Commit: {meta['commit']}",
             f"- {len(texts)} prompts, {GREEDY['max_new_tokens']} greedy tokens each", "",
             "| format | identical outputs |", "|---|---:|",
             *(f"| {name} | {count} of {len(texts)} |" for name, count in same.items())]
    (args.output / "agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
