"""The engine's LoRA adapters: which are known by id, and host copies of their weights.

An adapter is read (and checked) the first time a request or `add` names it. Up to
`max_cpu_loras` read adapters stay on the host, least recently used dropped first; one dropped
is read again from its path when a device slot needs it (core/lora.py decides the slots).
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.core.lora import LoRARequest
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import LoRAAdapter, load_adapter


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, max_rank: int, max_cpu_loras: int):
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.requests: dict[int, LoRARequest] = {}  # every adapter known, by lora_int_id
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read ones, LRU first

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Know `request`'s adapter (reading it if it is not on the host): ValueError naming
        the field where it cannot be served, or where its id already names another adapter."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path,
                                                                         request.lora_name):
            raise ValueError(f"lora_int_id: {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} from {known.lora_path!r}")
        adapter = self.adapter(request)
        self.requests[request.lora_int_id] = request
        return adapter

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The host copy of `request`'s adapter, read from its path if not held."""
        lora_id = request.lora_int_id
        adapter = self._host.get(lora_id)
        if adapter is None:
            adapter = load_adapter(request.lora_path, self.model_config, self.max_rank)
            self._host[lora_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora_id)
        return adapter

    def remove(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` (the caller checks that no request runs it); False if
        unknown."""
        self._host.pop(lora_id, None)
        return self.requests.pop(lora_id, None) is not None

    @property
    def num_on_host(self) -> int:
        return len(self._host)
