"""``framework quantize``: a GPTQ, AWQ, FP8 or int8 copy of a float checkpoint.

The linear layers' weights are quantized (framework/layers/quantization/checkpoint_writer.py),
``config.json`` gains the format's ``quantization_config``, and the tokenizer's and every
other file are copied, so that the copy serves with ``framework serve --model-path DST``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

#: The formats written (as ``checkpoint_writer.WRITE_FORMATS``, without importing torch).
FORMATS = ("gptq", "awq", "fp8", "int8")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``framework quantize``."""
    parser.add_argument("--model-path", required=True, help="the float checkpoint's directory")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="gptq, awq: 4-bit with group scales; fp8: E4M3 with per-channel "
                             "scales; int8: weight-only with per-channel scales")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input features per scale, gptq and awq (-1: one group)")
    parser.add_argument("--act-order", action="store_true",
                        help="gptq: group input features by descending weight norm (desc_act)")


def run_from_cli(args: argparse.Namespace) -> int:
    """Run ``framework quantize``; one line on success."""
    count = quantize_checkpoint(args.model_path, args.output, args.format,
                                group_size=args.group_size, act_order=args.act_order)
    print(f"wrote {args.output}: {count} linear weights in {args.format}")
    return 0


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, *, group_size: int = 128,
                        act_order: bool = False) -> int:
    """Write a copy of the checkpoint at ``src`` to ``dst`` with its linear layers' weights
    in ``fmt``; returns how many weights were quantized.

    Raises:
        ValueError: bad arguments (``check_arguments``) or a weight ``fmt`` cannot hold.
    """
    from framework.layers.quantization.checkpoint_writer import (
        INDEX_FILE,
        quantization_config,
        write_quantized_shards,
    )
    from framework.model_executor.weight_loader import find_safetensors_files

    src, dst = Path(src), Path(dst)
    config = check_arguments(src, dst, fmt, group_size, act_order)
    files = find_safetensors_files(src)
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        count = write_quantized_shards(files, dst, fmt, group_size=group_size,
                                       act_order=act_order, index=(src / INDEX_FILE).is_file())
    except BaseException:
        # No half-written copy: the output is as it was (absent, or empty).
        shutil.rmtree(dst)
        if not created:
            dst.mkdir()
        raise
    config["quantization_config"] = quantization_config(fmt, group_size, act_order)
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for path in src.iterdir():  # tokenizer, generation config, chat template, ...
        if path.is_file() and path.suffix != ".safetensors" \
                and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, dst / path.name)
    return count


def check_arguments(src: Path, dst: Path, fmt: str, group_size: int, act_order: bool
                    ) -> dict[str, Any]:
    """The source's ``config.json``, once the arguments are checked.

    Raises:
        ValueError: an unknown format, act-order with another format than GPTQ, a bad
            group size, a source that is not a float checkpoint, or a destination in use.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if act_order and fmt != "gptq":
        raise ValueError(f"--act-order is a gptq option, not one of {fmt}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group size must be positive or -1, got {group_size}")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{src} is not a model directory (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed {config_path}: {exc}") from exc
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"{src} is already quantized ({method}); quantize a float checkpoint")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError("the output directory must differ from the model directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"output {dst} exists and is not an empty directory")
    return config
