"""The serving process: the socket protocol (socket_front.py) and, optionally, OpenAI-style HTTP
(openai/), both over one serving core (core.py).

One engine thread per replica keeps a single continuous batch full for every connection of
either front.
"""

from __future__ import annotations

import asyncio

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.serving.core import ServerConfig, ServingCore
from jaxserve.serving.openai import app as http_app
from jaxserve.serving.socket_front import SocketFront

__all__ = ["Server", "ServerConfig"]


class Server(ServingCore):
    def __init__(self, engines: LLMEngine | list[LLMEngine], config: ServerConfig | None = None,
                 step_hooks: tuple = (), remote=None, secret: bytes | None = None):
        """`secret`: a prefill or decode engine's secret (serving/engine_secret.py)."""
        super().__init__(engines, config, step_hooks, remote)
        self.socket = SocketFront(self, secret)
        self._http_runner = None
        self.socket_port: int | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        super().start()
        await self.replicas.connect()
        await self.load_lora_modules()
        cfg = self.config
        self.socket_port = await self.socket.start(cfg.host, cfg.port)
        if cfg.http_port is not None:
            self._http_runner, self.http_port = await http_app.serve(self, cfg.host,
                                                                     cfg.http_port)

    def where(self) -> str:
        s = f"socket {self.config.host}:{self.socket_port}"
        if self.http_port is not None:
            s += f", OpenAI HTTP http://{self.config.host}:{self.http_port}/v1"
        return s

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish within the deadline, abort the rest,
        then close every connection, stuck ones included; returns within about
        `shutdown_timeout_s` + 2 s whatever the clients do."""
        self.socket.stop_accepting()
        await self.finish()
        await asyncio.sleep(0.2)  # let the final "abort" frames go out
        await self.socket.close_connections()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        self.stop()
