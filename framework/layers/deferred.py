"""Float weights allocated only when a float tensor loads into them.

A quantized model's linear layers (and MoE experts) need their float weights briefly or
not at all: a pre-quantized checkpoint gives them quantized parts instead, and online
quantization quantizes each layer once its float weight is in. Allocated when the model
is built, the float weights would need the float model's memory free at start (on a GPU,
where memory is committed as it is allocated), only to be freed once the layers are
quantized. Such weights are built *deferred* instead: a tensor of the weight's shape,
dtype and device whose entries all share one element. A weight loader that copies a float
tensor into one allocates it first (``materialized``); one that keeps quantized parts
leaves it as it is, and the layer's float weight is then replaced by an empty one.
Writing into a deferred weight that was not materialized fails (its entries overlap), so
no path can fill it unnoticed.
"""

from __future__ import annotations

import torch
from torch import nn


def deferred(shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A deferred weight: ``shape``, ``dtype`` and ``device``, one element of memory."""
    return torch.empty(1, dtype=dtype, device=device).as_strided(shape, (0,) * len(shape))


def is_deferred(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a deferred weight (more than one entry, all of one element)."""
    return tensor.numel() > 1 and not any(tensor.stride())


def materialized(param: nn.Parameter) -> torch.Tensor:
    """``param``'s data, allocated (uninitialised) first if it was deferred."""
    if is_deferred(param):
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    return param.data


def place_on_device(model: nn.Module, device: torch.device) -> int:
    """Give a model built on the meta device its parameters and buffers on ``device``,
    uninitialised; the weights its modules name in ``deferrable_weights`` deferred.

    Modules holding buffers compute them again (``rebuild_buffers(device)``): a meta
    build has their shapes, not their values. Returns how many weights were deferred.

    Raises:
        TypeError: a module with buffers that cannot compute them again.
    """
    placed: dict[int, nn.Parameter] = {}  # a parameter shared by modules stays shared
    count = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in placed:
                deferring = name in getattr(module, "deferrable_weights", ())
                make = deferred if deferring else _empty
                new = nn.Parameter(make(param.shape, param.dtype, device), requires_grad=False)
                new.__dict__.update(param.__dict__)  # its weight loader
                placed[id(param)] = new
                count += deferring
            setattr(module, name, placed[id(param)])
        if next(module.buffers(recurse=False), None) is not None:
            rebuild = getattr(module, "rebuild_buffers", None)
            if rebuild is None:
                raise TypeError(f"{type(module).__name__} holds buffers but cannot compute "
                                "them again (rebuild_buffers) after a build on the meta device")
            rebuild(device)
    return count


def _empty(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
