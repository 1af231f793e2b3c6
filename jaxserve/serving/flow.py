"""Write-side flow control: what a client that stops reading may cost, and when it is cut off.

A server that keeps writing to a client that does not read sees nothing at first: the client's
kernel receive buffer and ours absorb the bytes, and the requests keep running for nobody. Two
bounds make that cost small and fixed:

- every accepted connection gets a fixed kernel send buffer (`SEND_BUFFER_BYTES`, which Linux
  doubles) instead of one that autotunes up to megabytes, and the transport stops accepting
  writes (`drain()` waits) above `WRITE_HIGH_WATER` bytes;
- `StallWatch` cuts off a connection whose unsent bytes stop moving: when bytes are waiting
  on our side (transport buffer plus the kernel's send queue) and none of them has gone to the
  client for `stall_timeout_s`, the client's receive window is closed because it stopped
  reading. A client that reads, however slowly, makes progress and is never cut off.

So a client that stops reading is cut off after at most (its own receive buffer + ours +
WRITE_HIGH_WATER) bytes and `stall_timeout_s` seconds, and its requests are aborted then.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable

logger = logging.getLogger("jaxserve.server")

SEND_BUFFER_BYTES = 64 << 10
WRITE_HIGH_WATER = 64 << 10
_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # Linux: bytes in a socket's send queue


def configure_transport(transport: asyncio.BaseTransport) -> None:
    """Fix the kernel send buffer and the transport's high-water mark of a new connection."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # a platform that refuses: the stall watch remains
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    if hasattr(transport, "set_write_buffer_limits"):
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)


def unsent_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes written for the client that it has not received yet, as far as this side can
    see: the transport's buffer plus the kernel's send queue (where the platform tells)."""
    if transport is None or transport.is_closing():
        return 0
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _TIOCOUTQ is not None:
        with contextlib.suppress(OSError):
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
    return n


class Watched:
    """One writer under watch: `written` counts the bytes handed to its transport."""

    __slots__ = ("transport", "cut_off", "written", "delivered", "since")

    def __init__(self, transport: asyncio.BaseTransport, cut_off: Callable[[], None]):
        self.transport = transport
        self.cut_off = cut_off
        self.written = 0
        self.delivered = 0  # written - unsent at the last check that saw progress
        self.since = time.monotonic()


class StallWatch:
    """Checks every watched writer a few times a second on the event loop."""

    def __init__(self, stall_timeout_s: float, interval_s: float = 0.1):
        self.stall_timeout_s = stall_timeout_s
        self.interval_s = interval_s
        self.watched: set[Watched] = set()
        self.num_cut_off = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def watch(self, transport: asyncio.BaseTransport, cut_off: Callable[[], None]) -> Watched:
        w = Watched(transport, cut_off)
        self.watched.add(w)
        return w

    def unwatch(self, w: Watched | None) -> None:
        self.watched.discard(w)

    def check(self, now: float) -> None:
        for w in list(self.watched):
            unsent = unsent_bytes(w.transport)
            delivered = w.written - unsent
            if unsent == 0 or delivered > w.delivered:
                w.delivered, w.since = delivered, now
            elif now - w.since > self.stall_timeout_s:
                logger.warning("cutting off a client that stopped reading (%d bytes unsent for "
                               "%.1fs)", unsent, now - w.since)
                self.watched.discard(w)
                self.num_cut_off += 1
                w.cut_off()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check(time.monotonic())
