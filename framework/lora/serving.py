"""The LoRA adapters one model runner serves: built from ``ServerArgs``, set per forward.

``LoraServing`` reads the ``--lora-paths`` adapters, wraps the model's targeted
layers (``apply_lora``) and loads the adapters into slots (``LoraSlots``). Each
forward, ``set_batch`` turns the ``ForwardBatch``'s per-request adapter names into
the slots of its packed rows. Every rank of a model builds one alike and loads
the same adapters in the same order, so a name means the same slot on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from framework.forward_batch import ForwardBatch
from framework.lora.adapter import LoraAdapter
from framework.lora.batch import NO_SLOT, LoraBatch
from framework.lora.layers import LoraModel, apply_lora
from framework.lora.names import lora_slot_count, parse_lora_paths
from framework.lora.slots import LoraSlots

#: Projections an adapter loaded at run time may target when no ``--lora-paths``
#: adapter narrows them.
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_lora_backend(name: str, device: torch.device) -> str:
    """The ``LORA_BACKENDS`` name ``--lora-backend`` means (``auto``: cpu on a CPU)."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" else "torch"


@dataclass
class LoraServing:
    """A model's LoRA wrappers and slots, and the adapters they serve."""

    lora_model: LoraModel
    slots: LoraSlots
    #: The directory each known adapter loads from.
    paths: dict[str, str]
    #: The adapters of the requests of the last step and of those holding KV beside it:
    #: pinned whenever another adapter loads, so that none of them is evicted.
    in_use: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def build(cls, model: nn.Module, entries: Sequence[str], *, max_loaded: int | None,
              max_rank: int | None, backend: str, device: torch.device) -> LoraServing:
        """Wrap ``model`` (its weights already loaded) and load the ``entries`` adapters.

        The slots hold ``max_loaded`` adapters (default: the ``--lora-paths`` ones, at
        least one); the rank is ``max_rank`` (default: the largest of them). The wrapped
        projections are those the adapters target (every one without adapters).

        Raises:
            ValueError: an adapter that does not load, fit the model or the slots.
        """
        paths = parse_lora_paths(entries)
        adapters = [LoraAdapter.load(path, name) for name, path in paths.items()]
        rank = max_rank if max_rank is not None else max((a.rank for a in adapters), default=16)
        loaded = lora_slot_count(max_loaded, entries)
        if len(adapters) > loaded:
            raise ValueError(f"{len(adapters)} --lora-paths adapters but --max-loaded-loras "
                             f"is {loaded}")
        targets = set().union(*(a.modules for a in adapters)) if adapters else set(ALL_TARGETS)
        lora_model = apply_lora(model, loaded, rank, targets,
                                backend=resolve_lora_backend(backend, device))
        slots = LoraSlots(lora_model, loaded)
        for adapter in adapters:
            slots.load(adapter)
        return cls(lora_model, slots, paths)

    def describe(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with the directory of each adapter it names (``lora_dirs``), so that
        every rank can load what was loaded at run time on rank 0."""
        if batch.lora_names is None:
            return batch
        names = {name for name in batch.lora_names if name is not None}
        return dataclasses.replace(batch, lora_dirs={name: self.paths[name] for name in names
                                                     if name in self.paths})

    def set_batch(self, batch: ForwardBatch) -> None:
        """Use ``batch``'s adapters (``ForwardBatch.lora_names``) in its forward pass."""
        names = batch.lora_names
        self.in_use = {name for name in names or () if name is not None}
        self.in_use.update(batch.lora_in_use or ())
        if names is None or all(name is None for name in names):
            self.lora_model.set_batch(None)
            return
        for name, path in (batch.lora_dirs or {}).items():
            if self.paths.get(name) != path:  # loaded at run time, on rank 0
                if name in self.paths:
                    self.unload(name)
                self.paths[name] = path
        slot_of = self._slots_of({name for name in names if name is not None})
        request_slots = [NO_SLOT if name is None else slot_of[name] for name in names]
        if batch.forward_mode.is_extend():
            assert batch.extend_seq_lens_cpu is not None, "an EXTEND batch has host lengths"
            new_tokens = list(batch.extend_seq_lens_cpu)
        else:
            new_tokens = [batch.num_tokens // batch.batch_size] * batch.batch_size
        self.lora_model.set_batch(LoraBatch.build(
            request_slots, new_tokens, batch.input_ids.device, _output_rows(batch, new_tokens)))

    def _slots_of(self, names: set[str]) -> dict[str, int]:
        """The slot of each adapter of a batch, reloading those the LRU evicted (the
        adapters in use, this batch's among them, are pinned while they load)."""
        for name in sorted(names):
            if name not in self.slots.loaded:
                if name not in self.paths:
                    raise KeyError(f"LoRA adapter {name!r} is not loaded")
                with self._in_use_pinned():
                    self.slots.load(LoraAdapter.load(self.paths[name], name))
        return {name: self.slots.use(name) for name in names}

    @contextlib.contextmanager
    def _in_use_pinned(self) -> Iterator[None]:
        """Pin the loaded adapters of ``in_use`` for the block (no load evicts them)."""
        # In LRU order (pinning marks an adapter used): the same order on every run.
        pinned = [name for name in self.slots.loaded if name in self.in_use]
        for name in pinned:
            self.slots.acquire(name)
        try:
            yield
        finally:
            for name in pinned:
                self.slots.release(name)

    def load(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` into a slot, evicting none in use
        (``ValueError`` if it does not fit or the name is taken; ``RuntimeError`` when
        every slot holds an adapter in use)."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        with self._in_use_pinned():
            self.slots.load(LoraAdapter.load(path, name))
        self.paths[name] = path

    def unload(self, name: str) -> None:
        """Free adapter ``name``'s slot (``KeyError`` if unknown, ``ValueError`` while pinned)."""
        if name not in self.paths:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        if name in self.slots.loaded:
            self.slots.unload(name)
        del self.paths[name]


def _output_rows(batch: ForwardBatch, new_tokens: list[int]) -> list[int] | None:
    """The packed rows the model keeps after its last layer's attention, on the host:
    each request's last new token, then the prompt-logprob rows (``logits_rows``); None
    where they are as many as the rows, which the last layer then keeps all
    (``LlamaForCausalLM.forward``)."""
    if not batch.forward_mode.is_extend():
        return None
    rows, end = [], 0
    for count in new_tokens:
        end += count
        rows.append(end - 1)
    if batch.prompt_logprob_rows is not None:
        rows.extend(batch.prompt_logprob_rows.tolist())
    return None if len(rows) == end else rows
