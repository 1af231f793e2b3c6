"""The server's LoRA adapters by name: `--lora-modules` loaded at start, and adapters loaded and
unloaded while it serves (/v1/load_lora_adapter, /v1/unload_lora_adapter).

Every replica's engine knows every adapter: loads and unloads run on the engine threads
between steps (ReplicaSet.add_lora, remove_lora), like any other engine operation. A request's
adapter name is looked up in the same event-loop turn that queues the request, and an unload
takes the name away before it asks the engines, so no request can reach an engine with an
adapter that is being removed.

Under prefill/decode disaggregation the front keeps the names (it reads each adapter once to
check it) and every frame it sends an engine names the adapter in full: name, id and path
(`from_frame`); a prefill or decode engine reads it the first time a frame names it, keeping up to
max_cpu_loras on the host like any engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random

from jaxserve.core.lora import LoRARequest


class LoRAError(ValueError):
    """An adapter operation refused; `status`: the HTTP status that says why (400, 404,
    409), `param`: the field at fault."""

    def __init__(self, message: str, param: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` entry, vLLM's two forms: `name=path` or a JSON object with `name`,
    `path` and optionally `base_model_name`; ValueError naming lora_modules."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules: {text!r} is not JSON: {e}") from None
        extra = set(obj) - {"name", "path", "base_model_name"}
        if extra or not all(isinstance(obj.get(k), str) and obj.get(k)
                            for k in ("name", "path")):
            raise ValueError(f"lora_modules: {text!r} must be an object with string name and "
                             f"path (and optionally base_model_name), nothing else")
        return LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules: {text!r} is neither name=path nor a JSON object")
    return LoRAModule(name, path)


def check_lora_options(enable_lora: bool, lora_modules) -> None:
    """ValueError naming the option where the server's adapters cannot be served."""
    if lora_modules and not enable_lora:
        raise ValueError("lora_modules: LoRA adapters need --enable-lora")


class ServerLoRAs:
    """The adapters a server's requests may name, kept in step with its engines."""

    def __init__(self, replicas, base_model_name: str, enabled: bool,
                 allowed_dir: str | None = None, role_engine: bool = False):
        """`replicas`: a ReplicaSet or a DisaggSet (add_lora, lora_in_use, remove_lora);
        `enabled`: the engines have enable_lora; `role_engine`: a prefill or decode engine,
        whose front names each request's adapter in full (`from_frame`)."""
        self.replicas = replicas
        self.base_model_name = base_model_name
        self.enabled = enabled
        self.allowed_dir = None if allowed_dir is None else os.path.realpath(allowed_dir)
        self.role_engine = role_engine
        self.loaded: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}  # adapter name -> the model /v1/models says it adapts
        self._loading: set[str] = set()  # names being loaded: a second load of one is refused
        # lora_int_id, never reused; from a random start, so engines that outlive a front
        # never meet one id meaning two adapters
        self._ids = itertools.count(random.randrange(1, 1 << 30))

    def get(self, name: str) -> LoRARequest | None:
        return self.loaded.get(name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model); LoRAError 404 for a
        name that is neither."""
        if model is None or model == self.base_model_name:
            return None
        lora = self.loaded.get(model) if isinstance(model, str) else None
        if lora is None:
            raise LoRAError(f"model {model!r} does not exist; this server serves "
                            f"{self.base_model_name!r} and the adapters {sorted(self.loaded)}",
                            "model", 404)
        return lora

    async def load(self, name, path, parent: str | None = None) -> LoRARequest:
        """Read and check adapter `name` from `path` on every engine; LoRAError naming why,
        with nothing changed."""
        if not self.enabled:
            raise LoRAError("LoRA adapters are off: start the server with --enable-lora",
                            "lora_name")
        if not isinstance(name, str) or not name:
            raise LoRAError("lora_name must be a non-empty string", "lora_name")
        if not isinstance(path, str) or not path:
            raise LoRAError("lora_path must be a non-empty string", "lora_path")
        if name == self.base_model_name:
            raise LoRAError(f"lora_name {name!r} is the base model's name", "lora_name")
        if name in self.loaded or name in self._loading:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._check_allowed(path)
        lora = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)
        try:
            await self.replicas.add_lora(lora)
        except ValueError as e:
            raise LoRAError(str(e), "lora_path") from None
        finally:
            self._loading.discard(name)
        self.loaded[name] = lora
        self.parents[name] = parent or self.base_model_name
        return lora

    async def unload(self, name) -> None:
        """Forget adapter `name` on every engine; LoRAError 400 when unknown, 409 while an
        unfinished request runs it (nothing changed)."""
        if not self.enabled:
            raise LoRAError("LoRA adapters are off: start the server with --enable-lora",
                            "lora_name")
        lora = self.loaded.pop(name, None) if isinstance(name, str) else None
        if lora is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", "lora_name")
        # No new request can name it now; those queued before are seen by this check.
        if await self.replicas.lora_in_use(lora.lora_int_id):
            self.loaded[name] = lora
            raise LoRAError(f"LoRA adapter {name!r} is in use by unfinished requests; unload "
                            f"it when they are done", "lora_name", 409)
        await self.replicas.remove_lora(lora.lora_int_id)
        self.parents.pop(name, None)

    def from_frame(self, req) -> LoRARequest | None:
        """The adapter a generate or accept frame (protocol.GenerateRequest) names in full
        (name, id, path), as a front names it to its prefill and decode engines; None for a
        frame without a path. LoRAError naming the field where this engine takes none."""
        if req.lora_path is None:
            return None
        if not self.role_engine:
            raise LoRAError("lora_path: only a prefill or decode engine takes an adapter's "
                            "path in a frame (from its front); name a loaded adapter",
                            "lora_path")
        if not self.enabled:
            raise LoRAError("LoRA adapters are off: start the engine with --enable-lora",
                            "lora_name")
        self._check_allowed(req.lora_path)
        try:
            return LoRARequest(req.lora_name, req.lora_int_id, req.lora_path)
        except ValueError as e:
            raise LoRAError(str(e), str(e).split()[0]) from None

    def _check_allowed(self, path: str) -> None:
        if self.allowed_dir is not None:
            real = os.path.realpath(path)
            if os.path.commonpath([real, self.allowed_dir]) != self.allowed_dir:
                raise LoRAError(f"lora_path {path!r} is outside the server's "
                                f"--lora-allowed-dir", "lora_path")
