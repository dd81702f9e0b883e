"""Calibrating a quantized checkpoint on text (``framework quantize --calibration-data``).

The float checkpoint loads as a transformers model in float32, and windows of tokens cut
from the calibration text run through it. The decoder layers are then quantized in
order, keeping a float copy and a quantized copy of each: the inputs reaching a layer
through the quantized layers below it (``Xq``) and through the float ones (``Xf``) give,
for each set of projections that read one input (q/k/v, o, gate/up, down, in the order
the layer calls them), ``H = Xq^T Xq`` and ``C = Xq^T Xf``; each projection's weight is
corrected towards the float outputs, its grid fitted, and the weight rounded onto the
grid with its errors compensated (``error_compensation.py``) before the next set is
measured. A layer's MoE experts come last, each on the rows routed to it
(``calibration_experts.py``). Each set runs its layer (up to the set) twice over the
windows, and each layer runs twice more to feed the next: about ten forward passes of
the model in all. With ``rounding_steps``, the rounding is then learned on the same
windows, end to end (``learned_rounding.py``).
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.layers.quantization.calibration_experts import (
    ExpertPlace,
    calibrate_experts,
    expert_part,
    expert_places,
)
from framework.layers.quantization.error_compensation import GridFit, calibrated_rounding
from framework.layers.quantization.grid import QuantGrid
from framework.layers.quantization.layer_inputs import Stop, module_call, run_layer
from framework.layers.quantization.learned_rounding import learn_rounding


@dataclass(frozen=True)
class CalibrationSettings:
    """What to calibrate on and how.

    Attributes:
        paths: text files, or directories whose files that read as UTF-8 are taken.
        samples: windows of tokens.
        seq_len: tokens per window.
        damp: added to each Gram matrix's diagonal, as a fraction of its mean.
        batch: windows per forward pass.
        seed: picks the files and the windows' starts (and the batches of learned
            rounding).
        rounding_steps: batches of learned rounding after error compensation
            (``learned_rounding.py``; 0: none).
    """

    paths: tuple[Path, ...]
    samples: int = 128
    seq_len: int = 512
    damp: float = 0.01
    batch: int = 8
    seed: int = 0
    rounding_steps: int = 0


def text_files(paths: tuple[Path, ...]) -> list[Path]:
    """The files named, and every file under the directories named, sorted.

    Raises:
        ValueError: a path that does not exist, or no file at all.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"calibration data {path} does not exist")
    if not files:
        raise ValueError("the calibration data holds no file")
    return files


def _read_text(path: Path) -> str | None:
    """The file's text, or None where it is not UTF-8 (binary files under a directory)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def calibration_windows(tokenize: Callable[[str], list[int]], files: list[Path],
                        samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``samples`` windows of ``seq_len`` tokens ``[samples, seq_len]``: the files taken in
    a shuffled order, again and again, one window at a random start from each file long
    enough.

    Raises:
        ValueError: no file holds ``seq_len`` tokens.
    """
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    tokens: dict[Path, list[int]] = {}
    windows: list[list[int]] = []
    while len(windows) < samples:
        before = len(windows)
        for path in order:
            if path not in tokens:
                text = _read_text(path)
                tokens[path] = tokenize(text) if text else []
            ids = tokens[path]
            if len(ids) >= seq_len:
                start = rng.randrange(len(ids) - seq_len + 1)
                windows.append(ids[start:start + seq_len])
                if len(windows) == samples:
                    break
        if len(windows) == before:
            raise ValueError(f"no calibration file holds {seq_len} tokens "
                             "(lower --calibration-seq-len or add text)")
    return torch.tensor(windows)


@dataclass
class _Batch:
    """One batch's hidden states entering the current layer, float and quantized, and the
    other arguments the model passed its decoder layers."""

    float_x: torch.Tensor
    quant_x: torch.Tensor
    kwargs: dict[str, Any]


def _decoder_layers(model: torch.nn.Module, names: list[str]
                    ) -> tuple[str, torch.nn.ModuleList]:
    """The name and module of the layer list holding every projection in ``names``."""
    parts = names[0].split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    prefix = ".".join(parts[:digits[0]]) if digits else ""
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        layers = None
    if not isinstance(layers, torch.nn.ModuleList) or not all(
            name.startswith(prefix + ".") for name in names):
        raise ValueError(f"calibration: cannot find the decoder layers holding {names[0]}")
    return prefix, layers


def _first_layer_inputs(model: torch.nn.Module, layer: torch.nn.Module,
                        windows: torch.Tensor, batch: int) -> list[_Batch]:
    """Run the windows up to the first decoder layer, keeping what it is called with."""
    captured: list[_Batch] = []

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(_Batch(hidden, hidden, kwargs))
        raise Stop

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for chunk in windows.split(batch):
            with contextlib.suppress(Stop):
                model(chunk, use_cache=False)
    finally:
        handle.remove()
    return captured


def _input_groups(layer: torch.nn.Module, names: list[str], probe: _Batch) -> list[list[str]]:
    """The layer's projections ``names`` (relative to it) in sets that read one input
    tensor, in the order the layer calls them."""
    seen: list[tuple[torch.Tensor, list[str]]] = []

    def record(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            for tensor, group in seen:
                if tensor is args[0]:
                    group.append(name)
                    return
            seen.append((args[0], [name]))
        return hook

    handles = [layer.get_submodule(name).register_forward_pre_hook(record(name))
               for name in names]
    try:
        run_layer(layer, probe.float_x, probe.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return [group for _, group in seen]


def _input_of(layer: torch.nn.Module, name: str, hidden: torch.Tensor,
              kwargs: dict[str, Any]) -> torch.Tensor:
    """The input (rows ``[tokens, in]``) projection ``name`` of ``layer`` reads."""
    args, _ = module_call(layer, layer.get_submodule(name), hidden, kwargs)
    return args[0].reshape(-1, args[0].shape[-1]).double()


def _gram(layer: torch.nn.Module, quant_layer: torch.nn.Module, name: str,
          batches: list[_Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """``Xq^T Xq`` and ``Xq^T Xf`` of projection ``name``'s input over every batch."""
    hessian = cross = torch.zeros((), dtype=torch.float64)  # broadcasts to [in, in]
    for item in batches:
        xf = _input_of(layer, name, item.float_x, item.kwargs)
        xq = _input_of(quant_layer, name, item.quant_x, item.kwargs)
        hessian = hessian + xq.t() @ xq
        cross = cross + xq.t() @ xf
    return hessian, cross


def _layer_names(names: list[str], prefix: str, count: int) -> Iterator[list[str]]:
    """For each decoder layer, its projections among ``names``, relative to the layer."""
    for index in range(count):
        head = f"{prefix}.{index}."
        yield [name[len(head):] for name in names if name.startswith(head)]


@torch.no_grad()
def calibrate(model_dir: Path, targets: list[str], fit: GridFit,
              settings: CalibrationSettings) -> dict[str, tuple[torch.Tensor, QuantGrid]]:
    """Each target's rounded weight (float32, on its grid) and grid.

    Args:
        model_dir: the float checkpoint.
        targets: the checkpoint names of the weights to quantize (``...q_proj.weight``).
        fit: the format's grid for a corrected weight.
        settings: the calibration text and its use.

    Raises:
        ValueError: unreadable calibration data, or a model whose projections do not sit
            in one list of decoder layers.
    """
    from transformers import AutoModelForCausalLM

    from framework.runtime.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    # Whole files are tokenized, then cut into windows: no warning about their length.
    tokenizer.model_max_length = 2**62
    windows = calibration_windows(
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        text_files(settings.paths), settings.samples, settings.seq_len, settings.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    modules = [name.removesuffix(".weight") for name in targets]
    prefix, layers = _decoder_layers(model, modules)
    batches = _first_layer_inputs(model, layers[0], windows, settings.batch)
    result: dict[str, tuple[torch.Tensor, QuantGrid]] = {}
    places: dict[str, ExpertPlace] = {}
    for index, names in enumerate(_layer_names(modules, prefix, len(layers))):
        layer = layers[index]
        quant_layer = copy.deepcopy(layer)
        experts = {name: part for name in names if (part := expert_part(name)) is not None}
        dense = [name for name in names if name not in experts]
        for group in _input_groups(layer, dense, batches[0]) if dense else []:
            hessian, cross = _gram(layer, quant_layer, group[0], batches)
            for name in group:
                full = f"{prefix}.{index}.{name}.weight"
                rounded, grid = calibrated_rounding(full, layer.get_submodule(name).weight,
                                                    hessian, cross, fit, settings.damp)
                quant_layer.get_submodule(name).weight.copy_(rounded)
                result[full] = (rounded, grid)
        if experts:
            result |= calibrate_experts(layer, quant_layer, experts, batches, fit,
                                        settings.damp, f"{prefix}.{index}.")
            places |= expert_places(f"{prefix}.{index}", layer, experts)
        for item in batches:
            item.float_x = run_layer(layer, item.float_x, item.kwargs)
            item.quant_x = run_layer(quant_layer, item.quant_x, item.kwargs)
    missing = sorted(set(targets) - set(result))
    if missing:
        raise ValueError(f"calibration: no decoder layer reached {missing[0]}")
    if settings.rounding_steps:
        result = learn_rounding(model, result, windows, settings.rounding_steps,
                                settings.batch, settings.seed, places)
    return result
