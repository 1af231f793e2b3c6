"""LoRA requests and the device's adapter slots, as the scheduler sees them (host only, no jax).

A request names its adapter with a LoRARequest (vLLM's spelling). The device holds `max_loras`
slots of adapter weights, numbered 1..max_loras (0: no adapter). `LoRASlots` decides which
adapter sits in which slot: an adapter keeps its slot while it is used, and a slot is given to
a new adapter by evicting the least recently used adapter that no admitted sequence runs.
When every slot is in use, a request whose adapter has none waits.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict


@dataclasses.dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter for a request: `lora_name` (what a front calls it), `lora_int_id` (a
    positive int naming the adapter in the engine), `lora_path` (a PEFT adapter directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    adapter_id = id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclasses.dataclass(frozen=True, slots=True)
class SlotLoad:
    """Write adapter `lora_id`'s weights into device slot `slot` before the step runs."""

    slot: int
    lora_id: int


class LoRASlots:
    """Which adapter holds each of `num_slots` device slots (1..num_slots), least recently
    used first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self._free = list(range(num_slots, 0, -1))  # popped from the end: 1 first
        self.num_loads = 0  # adapters written into a slot

    def slot_of(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)

    @property
    def loaded(self) -> dict[int, int]:
        """lora id -> slot, least recently used first."""
        return dict(self._slot_of)

    def acquire(self, lora_id: int, in_use: set[int]) -> tuple[int, bool] | None:
        """A slot for `lora_id` and whether its weights must be written there first; None
        when every slot holds an adapter in `in_use` (those the admitted sequences run)."""
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot, False
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((i for i in self._slot_of if i not in in_use), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        self.num_loads += 1
        return slot, True

    def release(self, lora_id: int) -> None:
        """Forget `lora_id`'s slot (its adapter was removed); the slot is free again."""
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._free.append(slot)
