"""A real server on loopback ports, running in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading

from jaxserve.serving.client import Client
from jaxserve.serving.server import Server, ServerConfig


class RunningServer:
    def __init__(self, engine, **server_kw):
        cfg = dict(host="127.0.0.1", port=0, http_port=0)
        cfg.update(server_kw)
        self.server = Server(engine, ServerConfig(**cfg))
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self._started.wait(60):
            raise RuntimeError("server did not start")

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.start())
        self._started.set()
        self.loop.run_forever()

    @property
    def port(self) -> int:
        return self.server.socket_port

    def client(self) -> Client:
        """A socket client, with the server's key when it has one."""
        return Client(port=self.port, api_key=self.server.config.api_key)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    def stop(self):
        fut = asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop)
        fut.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
