"""Building a model and filling its weights from safetensors files or at random.

Checkpoints are read shard by shard (``model.safetensors``, or the shards
named by ``model.safetensors.index.json``, or every ``*.safetensors`` file),
tensor by tensor, so host memory holds one tensor at a time; each model's
``load_weights`` maps the Hugging Face names onto its own parameters. A model
that declares ``loads_checkpoint_slices`` gets each tensor unread, as a
``SafetensorsSlice``: its weight loaders read only their rank's rows or
columns of it, and nothing of a tensor another pipeline stage holds, so that
with N ranks the checkpoint is read about once in all, not N times. The
``dummy`` format fills the parameters at random instead, to run a model of a
given shape without its files.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from framework.layers.deferred import materialized, place_on_device
from framework.layers.quantization.checkpoint import CheckpointQuantization
from framework.layers.quantization.linear_method import OnlineQuantization, quantize_on_load
from framework.mem_cache.kv_scales import CheckpointKVScales
from framework.model_executor.model_config import ModelConfig, check_model_dir
from framework.models import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
DUMMY_WEIGHT_STD = 0.02


def find_safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint files of a model directory, in load order.

    Raises:
        ValueError: no safetensors files, a malformed index, or a shard the index
            names is missing.
    """
    path = check_model_dir(model_path)
    index_path = path / _INDEX_FILE
    if index_path.is_file():
        return _files_from_index(index_path)
    if (path / _SINGLE_FILE).is_file():
        return [path / _SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for pattern in ("*.bin", "*.pt") for p in path.glob(pattern))
        hint = f" (found {', '.join(others[:3])}; only safetensors is supported)" if others else ""
        raise ValueError(f"no *.safetensors files in model directory {str(path)!r}{hint}")
    return files


def _files_from_index(index_path: Path) -> list[Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed {index_path}: {type(exc).__name__}: {exc}") from exc
    files = [index_path.parent / name for name in names]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ValueError(f"{index_path} names shards that are missing: {', '.join(missing)}")
    return files


class SafetensorsSlice:
    """One tensor of an open safetensors file, read only as far as it is indexed.

    ``narrow`` and indexing (``[...]`` for all of it) read just the entries they
    return, on CPU; ``shape`` is known without reading. Valid while its file
    is open, that is until the next tensor of ``iterate_safetensors``'s file
    loop moves on to the next file.
    """

    def __init__(self, stored: Any) -> None:
        self._stored = stored  # safetensors' own slice object (``safe_open(...).get_slice``)
        self.shape = torch.Size(stored.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``length`` entries from ``start`` along ``dim``, read from the file."""
        return self._stored[(slice(None),) * dim + (slice(start, start + length),)]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The entries at ``index`` (``[...]``: the whole tensor), read from the file."""
        return self._stored[index]


def iterate_safetensors(
    files: list[Path], *, progress: bool = True
) -> Iterator[tuple[str, SafetensorsSlice]]:
    """``(name, unread slice)`` for every tensor of every file, with a progress bar."""
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
        with _open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, SafetensorsSlice(handle.get_slice(name))


def checkpoint_weights(model: nn.Module, files: list[Path]
                       ) -> Iterator[tuple[str, SafetensorsSlice | torch.Tensor]]:
    """What ``model.load_weights`` takes: unread slices if the model says it loads them
    (``loads_checkpoint_slices``), else every tensor read whole."""
    weights = iterate_safetensors(files)
    if getattr(model, "loads_checkpoint_slices", False):
        return weights
    return ((name, tensor[...]) for name, tensor in weights)


def iterate_safetensors_shapes(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, meta tensor of the stored shape)``: a checkpoint's layout, no data read."""
    for name, stored in _stored_tensors(files):
        yield name, torch.empty(stored.get_shape(), device="meta")


def _stored_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """``(name, safetensors slice)`` of every tensor of ``files``: shape and dtype, no data."""
    for file in files:
        with _open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_slice(name)


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for corrupt files
        raise ValueError(f"cannot read {file}: {exc}") from exc


def check_load_format(load_format: str) -> None:
    """``ValueError`` for an unknown ``--load-format``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {LOAD_FORMATS}, got {load_format!r}")


def create_model(
    model_config: ModelConfig, device: torch.device, *, tp_rank: int = 0, tp_size: int = 1,
    pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
) -> nn.Module:
    """An instance of the model class with uninitialized weights on ``device``.

    Options the class does not take are not passed; ``tp_size > 1`` needs a
    class that takes ``tp_size``, ``pp_size > 1`` one that takes ``pp_size``,
    ``ep_size > 1`` one that takes ``ep_size`` (a Mixture-of-Experts model).
    """
    model_cls = get_model_class(model_config.architecture)
    accepted = inspect.signature(model_cls).parameters
    options = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size,
               "ep_rank": ep_rank, "ep_size": ep_size, "model_dir": model_config.model_path}
    if tp_size > 1 and "tp_size" not in accepted:
        raise ValueError(f"{model_config.architecture} does not support tensor parallelism")
    if pp_size > 1 and "pp_size" not in accepted:
        raise ValueError(f"{model_config.architecture} does not support pipeline parallelism")
    if ep_size > 1 and "ep_size" not in accepted:
        raise ValueError(f"{model_config.architecture} has no experts to split "
                         "(--ep-size is for Mixture-of-Experts models)")
    kwargs = {name: value for name, value in options.items() if name in accepted}
    model = model_cls(model_config.hf_config, model_config.dtype, device, **kwargs)
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights: matrices ~ N(0, DUMMY_WEIGHT_STD), biases 0, other vectors (norms) 1."""
    generators: dict[torch.device, torch.Generator] = {}
    filled: set[int] = set()  # a parameter modules share is filled once
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in filled:
                continue
            filled.add(id(param))
            data = materialized(param)
            if name.endswith("bias"):
                data.zero_()
            elif param.dim() < 2:
                data.fill_(1.0)
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(
                        device=param.device).manual_seed(seed)
                data.normal_(0.0, DUMMY_WEIGHT_STD, generator=generators[param.device])
        when_loaded = getattr(module, "when_loaded", None)
        if when_loaded is not None:  # a layer quantized as it loads (``quantize_on_load``)
            when_loaded(module)


def load_weights(
    model: nn.Module, model_path: str | Path, load_format: str, *, seed: int = 0,
    quantization: CheckpointQuantization | None = None,
    online: OnlineQuantization | None = None,
    kv_scales: CheckpointKVScales | None = None,
) -> None:
    """Fill ``model``'s weights from ``model_path`` (or at random for ``dummy``).

    With the ``quantization`` of a pre-quantized checkpoint, each quantized layer's
    tensors reach the model as one weight (``CheckpointQuantization.group``); with
    ``online`` quantization of a float one, each linear and MoE layer is quantized as soon
    as its float weight is in (``quantize_on_load``). The checkpoint's KV cache scales
    never reach the model: they go to ``kv_scales`` when given (``mem_cache/kv_scales.py``).
    """
    check_load_format(load_format)
    if online is not None:
        quantize_on_load(model, online.format, online.backend)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
        return
    files = find_safetensors_files(model_path)
    kv_scales = CheckpointKVScales() if kv_scales is None else kv_scales
    weights = kv_scales.take(checkpoint_weights(model, files))
    if quantization is not None:
        names = (name for name, _ in iterate_safetensors_shapes(files))
        weights = quantization.group(weights, names)
    model.load_weights(weights)


def dry_run_load(model_config: ModelConfig, model_path: str | Path) -> None:
    """Check that a checkpoint fits the model (names and shapes) without reading its data.

    The model is built on the meta device, so this costs no memory.
    """
    meta_model = create_model(model_config, torch.device("meta"))
    shapes = iterate_safetensors_shapes(find_safetensors_files(model_path))
    meta_model.load_weights(CheckpointKVScales().take(shapes))


def check_same_layout(model_path: str | Path, other_path: str | Path) -> None:
    """Check that the checkpoint at ``model_path`` holds the tensors (names, shapes and
    dtypes) of the one at ``other_path``, reading no data: a pre-quantized checkpoint's
    check, where the meta model of ``dry_run_load`` cannot unpack quantized layers.

    Raises:
        ValueError: naming a tensor one holds and the other lacks or holds otherwise.
    """
    def layout(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (tuple(stored.get_shape()), stored.get_dtype())
                for name, stored in _stored_tensors(find_safetensors_files(path))}

    new, old = layout(model_path), layout(other_path)
    for name in sorted(new.keys() | old.keys()):
        if new.get(name) != old.get(name):
            raise ValueError(f"checkpoint tensor {name!r}: {_held(new.get(name))} in "
                             f"{model_path}, {_held(old.get(name))} in the running checkpoint")


def _held(entry: tuple[tuple[int, ...], str] | None) -> str:
    return "absent" if entry is None else f"{entry[1]} {list(entry[0])}"


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    load_format: str = "auto",
    *,
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    quantization: CheckpointQuantization | None = None,
    online: OnlineQuantization | None = None,
    kv_scales: CheckpointKVScales | None = None,
) -> nn.Module:
    """Build the model on ``device`` and fill its weights (this pipeline stage's share);
    ``quantization``: that of a pre-quantized checkpoint; ``online``: the quantization of a
    float one, layer by layer as it loads; ``kv_scales``: receives the checkpoint's KV cache
    scales (``load_weights``).

    Raises:
        ValueError: unknown load format, missing checkpoint files, or weights that
            do not fit the model.
    """
    check_load_format(load_format)
    if load_format != "dummy":
        find_safetensors_files(model_config.model_path)  # fail before building the model
    # A quantized model's layers get quantized parts (a pre-quantized checkpoint's) or are
    # quantized as they load (online): built on the meta device, the model allocates their
    # float weights only as a float tensor loads (framework/layers/deferred.py), so start
    # needs no float model's memory.
    quantized = quantization is not None or online is not None
    model = create_model(model_config, torch.device("meta") if quantized else device,
                         tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                         ep_rank=ep_rank, ep_size=ep_size)
    if quantized:
        place_on_device(model, device)
    load_weights(model, model_config.model_path, load_format, seed=seed,
                 quantization=quantization, online=online, kv_scales=kv_scales)
    return model
