"""``framework quantize``: a GPTQ, AWQ, FP8 or int8 copy of a float checkpoint.

The linear layers' weights are quantized (framework/layers/quantization/checkpoint_writer.py;
with ``--calibration-data``, rounded with their errors compensated on that text:
framework/layers/quantization/calibration.py),
``config.json`` gains the format's ``quantization_config``, and the tokenizer's and every
other file are copied, so that the copy serves with ``framework serve --model-path DST``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from framework.layers.quantization.calibration import CalibrationSettings
    from framework.layers.quantization.checkpoint_writer import WriteFormat
    from framework.layers.quantization.grid import QuantGrid

#: The formats written (as ``checkpoint_writer.WRITE_FORMATS``, without importing torch).
FORMATS = ("gptq", "awq", "fp8", "int8")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``framework quantize``."""
    parser.add_argument("--model-path", required=True, help="the float checkpoint's directory")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="gptq, awq: 4-bit with group scales; fp8: E4M3 with per-channel "
                             "(or --block-size) scales; int8: weight-only with per-channel "
                             "scales")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input features per scale, gptq and awq (-1: one group)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="fp8: one scale per block of this many rows and columns of a "
                             "weight (weight_block_size, e.g. 128) instead of one per output "
                             "channel")
    parser.add_argument("--act-order", action="store_true",
                        help="gptq: group input features by descending weight norm, or with "
                             "--calibration-data by descending input energy (desc_act)")
    parser.add_argument("--calibration-data", nargs="+", default=None, metavar="PATH",
                        help="text files or directories: round each layer with its errors "
                             "compensated on this text (GPTQ's method, every format) instead "
                             "of to nearest")
    parser.add_argument("--calibration-samples", type=int, default=128,
                        help="windows of tokens cut from the calibration data")
    parser.add_argument("--calibration-seq-len", type=int, default=512,
                        help="tokens per calibration window")
    parser.add_argument("--dampening", type=float, default=0.01,
                        help="added to each layer's input Gram matrix's diagonal, as a "
                             "fraction of its mean")
    parser.add_argument("--rounding-steps", type=int, default=0,
                        help="with --calibration-data: then learn each weight's rounding (to "
                             "a neighbouring code) over this many batches of the windows, "
                             "towards the float model's next-token distributions (0: off)")


def run_from_cli(args: argparse.Namespace) -> int:
    """Run ``framework quantize``; one line on success."""
    calibration = None
    if args.rounding_steps and not args.calibration_data:
        raise ValueError("--rounding-steps needs --calibration-data")
    if args.calibration_data:
        from framework.layers.quantization.calibration import CalibrationSettings

        calibration = CalibrationSettings(
            tuple(Path(p) for p in args.calibration_data), samples=args.calibration_samples,
            seq_len=args.calibration_seq_len, damp=args.dampening,
            rounding_steps=args.rounding_steps)
    count = quantize_checkpoint(args.model_path, args.output, args.format,
                                group_size=args.group_size, act_order=args.act_order,
                                block_size=args.block_size, calibration=calibration)
    how = "calibrated" if calibration else "rounded to nearest"
    print(f"wrote {args.output}: {count} linear weights in {args.format} ({how})")
    return 0


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, *, group_size: int = 128,
                        act_order: bool = False, block_size: int | None = None,
                        calibration: CalibrationSettings | None = None) -> int:
    """Write a copy of the checkpoint at ``src`` to ``dst`` with its linear layers' weights
    in ``fmt`` (with ``calibration``, rounded with their errors compensated on its text);
    returns how many weights were quantized. ``group_size``, ``act_order`` and
    ``block_size`` are ``WriteFormat``'s options.

    Raises:
        ValueError: bad arguments (``check_arguments``), bad calibration data, or a weight
            ``fmt`` cannot hold.
    """
    from framework.layers.quantization.checkpoint_writer import (
        INDEX_FILE,
        WriteFormat,
        write_quantized_shards,
    )
    from framework.model_executor.weight_loader import find_safetensors_files

    src, dst = Path(src), Path(dst)
    target = WriteFormat(fmt, group_size, act_order, block_size)
    config = check_arguments(src, dst, target)
    if calibration is not None:
        check_calibration(calibration)
    files = find_safetensors_files(src)
    calibrated = None if calibration is None else calibrate_weights(
        src, files, target, calibration)
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        count = write_quantized_shards(files, dst, target, index=(src / INDEX_FILE).is_file(),
                                       calibrated=calibrated)
    except BaseException:
        # No half-written copy: the output is as it was (absent, or empty).
        shutil.rmtree(dst)
        if not created:
            dst.mkdir()
        raise
    config["quantization_config"] = target.quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for path in src.iterdir():  # tokenizer, generation config, chat template, ...
        if path.is_file() and path.suffix != ".safetensors" \
                and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, dst / path.name)
    return count


def calibrate_weights(src: Path, files: list[Path], fmt: WriteFormat,
                      calibration: CalibrationSettings
                      ) -> dict[str, tuple[torch.Tensor, QuantGrid]]:
    """Every target weight of the checkpoint rounded onto its ``fmt`` grid on the
    calibration text (act-order: the inputs by descending energy, as GPTQ orders them)."""
    from framework.layers.quantization.calibration import calibrate
    from framework.layers.quantization.checkpoint_writer import target_names

    def fit(name: str, weight: torch.Tensor, order: torch.Tensor) -> QuantGrid:
        return fmt.grid(name, weight, order if fmt.act_order else None)

    return calibrate(src, target_names(files, fmt), fit, calibration)


def check_calibration(calibration: CalibrationSettings) -> None:
    """Raises ValueError: calibration settings out of range, or data that does not exist."""
    from framework.layers.quantization.calibration import text_files

    text_files(calibration.paths)
    if calibration.samples <= 0 or calibration.seq_len <= 0:
        raise ValueError("--calibration-samples and --calibration-seq-len must be positive")
    if not 0 < calibration.damp < 1:
        raise ValueError(f"--dampening must lie in (0, 1), got {calibration.damp}")
    if calibration.rounding_steps < 0:
        raise ValueError(f"--rounding-steps must be 0 or more, got {calibration.rounding_steps}")


def check_arguments(src: Path, dst: Path, fmt: WriteFormat) -> dict[str, Any]:
    """The source's ``config.json``, once the arguments are checked.

    Raises:
        ValueError: an unknown format, act-order with another format than GPTQ, a block
            size with another than FP8, a bad group or block size, a source that is not a
            float checkpoint, or a destination in use.
    """
    if fmt.name not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt.name!r}")
    if fmt.act_order and fmt.name != "gptq":
        raise ValueError(f"--act-order is a gptq option, not one of {fmt.name}")
    if fmt.block is not None and fmt.name != "fp8":
        raise ValueError(f"--block-size is an fp8 option, not one of {fmt.name}")
    if fmt.block is not None and fmt.block <= 0:
        raise ValueError(f"block size must be positive, got {fmt.block}")
    if fmt.group_size != -1 and fmt.group_size <= 0:
        raise ValueError(f"group size must be positive or -1, got {fmt.group_size}")
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
