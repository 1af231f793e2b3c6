"""The OpenAI-compatible HTTP front (aiohttp): the app, its routes (one module per API, each on
the shared request handling of front.py), the API key and the errors of every route.

Routes: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events;
chat with tool calls), /v1/responses (stored responses readable and deletable by id),
/v1/embeddings, /tokenize and /detokenize, /v1/models, /v1/load_lora_adapter and
/v1/unload_lora_adapter, /health, /version, /metrics (Prometheus text); Anthropic's
/v1/messages on the same helpers (messages.py).

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}} (Anthropic's on its
routes), with 400 for bad fields, 401 for a missing or wrong key, 404 for an unknown model or
route, 409 for unloading a LoRA adapter that requests still run, 429 when the waiting queue is
full, 503 while shutting down.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.serving.core import ServingCore
from jaxserve.serving.openai import (
    admin,
    chat,
    completions,
    embeddings,
    messages,
    responses,
    tokenize,
)
from jaxserve.serving.openai.errors import ApiError
from jaxserve.serving.openai.front import Front

_KEYED = ("/v1/", "/tokenize", "/detokenize")  # the routes behind the API key
_APIS = (completions, chat, responses, embeddings, tokenize, admin, messages)


async def serve(core: ServingCore, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the HTTP front on host:port -> (its runner, to clean up at shutdown; the port)."""
    # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
    # aborts the request. The drain before shutdown has its own deadline.
    runner = web.AppRunner(build_app(core), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def build_app(server: ServingCore) -> web.Application:
    front = Front(server)
    app = web.Application(middlewares=[_middleware(server)],
                          client_max_size=server.config.max_frame_bytes)
    for api in _APIS:
        api.add_routes(app, front)
    return app


def _middleware(server: ServingCore):
    """The API key on the keyed routes; every error, aiohttp's own too, in its API's shape."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            if request.path.startswith(_KEYED) or (request.path == "/metrics"
                                                   and not server.config.public_metrics):
                auth = request.headers.get("Authorization", "")
                # Bearer, or Anthropic's header
                key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
                if not server.authorized(key):
                    raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                                   code="invalid_api_key")
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPException as e:
            if e.status == 404:
                error = ApiError(404, f"no route {request.method} {request.path}",
                                 kind="not_found_error")
            elif e.status == 405:
                error = ApiError(405, f"method {request.method} not allowed on {request.path}",
                                 kind="invalid_request_error")
            elif e.status == 413:
                error = ApiError(413, "request body too large")
            else:
                raise
        return (messages.error_response(error) if messages.serves(request.path)
                else error.response())

    return middleware
