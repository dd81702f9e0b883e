"""Which adapters are loaded into a model's LoRA slots, and which may be evicted.

``LoraSlots`` gives each loaded adapter a slot of every ``LoraLinear`` of the
model. Adapters that running requests use are pinned (``acquire``/``release``)
and never evicted; when a new adapter needs a slot and none is free, the least
recently used unpinned adapter makes room.
"""

from __future__ import annotations

from collections import OrderedDict

from framework.lora.adapter import LoraAdapter
from framework.lora.layers import LoraModel


class LoraSlots:
    """Adapter name -> slot, with an LRU of at most ``max_loaded`` loaded adapters."""

    def __init__(self, lora_model: LoraModel, max_loaded: int | None = None) -> None:
        self.lora_model = lora_model
        self.max_loaded = lora_model.max_slots if max_loaded is None else max_loaded
        if not 1 <= self.max_loaded <= lora_model.max_slots:
            raise ValueError(f"max_loaded must be in [1, {lora_model.max_slots}], "
                             f"got {self.max_loaded}")
        # Least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[str, int] = {}

    @property
    def loaded(self) -> list[str]:
        """The loaded adapters, least recently used first."""
        return list(self._slots)

    def slot_of(self, name: str) -> int:
        """The slot of loaded adapter ``name`` (``KeyError`` when it is not loaded)."""
        if name not in self._slots:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        return self._slots[name]

    def pins(self, name: str) -> int:
        """How many users hold adapter ``name``."""
        return self._pins.get(name, 0)

    def load(self, adapter: LoraAdapter) -> int:
        """Load ``adapter`` (checked against the model) unless it is loaded; return its slot.

        Raises:
            ValueError: the adapter does not fit the model.
            RuntimeError: every slot holds a pinned adapter.
        """
        if adapter.name in self._slots:
            self._slots.move_to_end(adapter.name)
            return self._slots[adapter.name]
        adapter.check(self.lora_model.spec)
        slot = self._free_slot(adapter.name)
        for layer in self.lora_model.layers:
            layer.load_slot(slot, adapter)
        self._slots[adapter.name] = slot
        return slot

    def use(self, name: str) -> int:
        """The slot of loaded adapter ``name``, marked as the most recently used."""
        slot = self.slot_of(name)
        self._slots.move_to_end(name)
        return slot

    def acquire(self, name: str) -> int:
        """Pin loaded adapter ``name`` for one user (a request); return its slot."""
        slot = self.use(name)
        self._pins[name] = self.pins(name) + 1
        return slot

    def release(self, name: str) -> None:
        """Drop one pin of adapter ``name``."""
        count = self.pins(name)
        if count == 0:
            raise ValueError(f"LoRA adapter {name!r} is not pinned")
        if count == 1:
            del self._pins[name]
        else:
            self._pins[name] = count - 1

    def unload(self, name: str) -> None:
        """Zero adapter ``name``'s slot and free it (``ValueError`` while it is pinned)."""
        slot = self.slot_of(name)
        if self.pins(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by {self.pins(name)} requests")
        for layer in self.lora_model.layers:
            layer.clear_slot(slot)
        del self._slots[name]

    def _free_slot(self, name: str) -> int:
        """A free slot, evicting the least recently used unpinned adapter if needed."""
        if len(self._slots) >= self.max_loaded:
            victim = next((loaded for loaded in self._slots if not self.pins(loaded)), None)
            if victim is None:
                raise RuntimeError(f"cannot load LoRA adapter {name!r}: all {self.max_loaded} "
                                   "loaded adapters are pinned by running requests")
            self.unload(victim)
        used = set(self._slots.values())
        return next(slot for slot in range(self.max_loaded) if slot not in used)
