"""What the server holds and how it is doing, apart from any one generation: GET /v1/models
(the base model and its loaded LoRA adapters), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (serving/loras.py), GET /health, /version and /metrics (Prometheus
text)."""

from __future__ import annotations

import functools

from aiohttp import web

from jaxserve import __version__
from jaxserve.serving.loras import LoRAError
from jaxserve.serving.openai.errors import lora_error
from jaxserve.serving.openai.front import Front


def add_routes(app: web.Application, front: Front) -> None:
    for path, handler in (("/v1/models", models), ("/health", health), ("/version", version),
                          ("/metrics", metrics)):
        app.router.add_get(path, functools.partial(handler, front))
    for path, handler in (("/v1/load_lora_adapter", load_lora_adapter),
                          ("/v1/unload_lora_adapter", unload_lora_adapter)):
        app.router.add_post(path, functools.partial(handler, front))


async def models(front: Front, request: web.Request) -> web.Response:
    """The base model, then each loaded LoRA adapter (vLLM's shape: `root` its path,
    `parent` the model it adapts)."""
    loras = front.server.loras
    base = {"object": "model", "created": 0, "owned_by": "jaxserve",
            "max_model_len": front.server.engine.config.max_model_len}
    return web.json_response({"object": "list", "data": [
        base | {"id": front.server.config.model_name, "root": front.server.config.model_name,
                "parent": None}] + [
        base | {"id": name, "root": lora.lora_path, "parent": loras.parents[name]}
        for name, lora in loras.loaded.items()]})


async def load_lora_adapter(front: Front, request: web.Request) -> web.Response:
    """vLLM's runtime load: {"lora_name", "lora_path"} -> plain-text success."""
    body = await front.body(request)
    try:
        await front.server.loras.load(body.get("lora_name"), body.get("lora_path"))
    except LoRAError as e:
        raise lora_error(e) from None
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added "
                             f"successfully.")


async def unload_lora_adapter(front: Front, request: web.Request) -> web.Response:
    """vLLM's runtime unload: {"lora_name"}; refused (409) while a request runs it."""
    body = await front.body(request)
    try:
        await front.server.loras.unload(body.get("lora_name"))
    except LoRAError as e:
        raise lora_error(e) from None
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed "
                             f"successfully.")


async def health(front: Front, request: web.Request) -> web.Response:
    replicas = front.server.replicas
    body = replicas.health()  # with remote engines: each one's state, by name
    if not replicas.is_alive:
        return web.json_response({"status": "error"} | body, status=503)
    return web.json_response({"status": "ok"} | body)


async def version(front: Front, request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(front: Front, request: web.Request) -> web.Response:
    """Prometheus text. Behind the API key when one is set, unless `public_metrics`."""
    await front.server.replicas.poll()
    return web.Response(body=front.server.exporter.render(),
                        content_type="text/plain", charset="utf-8")
