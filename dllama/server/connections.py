"""Connection limits that aiohttp's server lacks: a deadline for the request head, and a cap on
open connections.

aiohttp has no header read timeout (3.14: no option for one in web.Server or RequestHandler). Its
RequestHandler waits for a complete request head for as long as its keep-alive timer allows, which
is 3630 s by default under an AppRunner, and partial data does not count. It also takes every
connection the kernel hands it. A client that opens connections and sends half a request line
therefore holds them for an hour each, and enough of them exhaust the file descriptors.

`ConnectionGuard` is the protocol factory given to `loop.create_server`: each connection gets a
thin protocol that forwards everything to aiohttp's own RequestHandler, plus
- a refusal (a 503 with OpenAI's error body, then close) for a connection beyond `max_connections`,
  made at once rather than leaving it in the accept queue;
- a timer that closes a connection that spends `header_timeout` seconds without a request reaching
  the application: from its opening, and again from the end of each request (so it also closes
  idle keep-alive connections). The application calls `request_started`/`request_finished` (the
  middleware in app.py finds this protocol as `request.transport.get_protocol()`). Bytes that
  arrive do not re-arm it: dripping a request line byte by byte does not help;
- a send buffer of SEND_BUFFER bytes: the kernel would otherwise grow it to megabytes for a client
  that reads nothing, so that a streamed answer never waits to be written and its write timeout
  (event_stream.py) never starts. Tokens come far slower than even a small buffer drains on any network.
Only the public asyncio Protocol interface and aiohttp's documented protocol factory
(`AppRunner.server`) are used, so nothing depends on aiohttp's internals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass

log = logging.getLogger("dllama.server")

SEND_BUFFER = 32 << 10  # bytes (the kernel doubles it for its bookkeeping)


@dataclass
class ConnectionCounts:
    """What the guard saw, for /metrics."""

    open: int = 0
    refused: int = 0  # over max_connections
    header_timeouts: int = 0  # no complete request (head) in time
    body_timeouts: int = 0  # counted by the application (app.py)
    write_timeouts: int = 0  # streamed answers their clients stopped reading (event_stream.py)


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"The server has {max_connections} open connections, its limit; retry later.",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    """Protocol factory for `loop.create_server`: wraps the protocols `factory` makes (aiohttp's
    `AppRunner.server`) in the limits above."""

    def __init__(self, factory, *, header_timeout: float, max_connections: int,
                 counts: ConnectionCounts | None = None):
        self.factory = factory
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.counts = counts if counts is not None else ConnectionCounts()
        self.busy = _busy_response(max_connections)

    def __call__(self) -> asyncio.Protocol:
        return GuardedProtocol(self)


class GuardedProtocol(asyncio.Protocol):
    """One connection: the limits, around aiohttp's protocol (`inner`, None if refused)."""

    def __init__(self, guard: ConnectionGuard):
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.active = 0  # requests the application is handling (more than 1 when pipelined)

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport) -> None:
        guard = self.guard
        if guard.counts.open >= guard.max_connections:
            guard.counts.refused += 1
            # answered before the client's request is read: small enough for the socket buffer,
            # so close() sends it and a FIN at once
            transport.write(guard.busy)
            transport.close()
            return
        guard.counts.open += 1
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self.inner = guard.factory()
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self.inner is None:
            return  # refused
        self._disarm()
        self.guard.counts.open -= 1
        inner, self.inner, self.transport = self.inner, None, None
        inner.connection_lost(exc)

    # ------------------------------------------------------------------ called by the application

    def request_started(self) -> None:
        self.active += 1
        self._disarm()

    def request_finished(self) -> None:
        self.active -= 1
        if self.active == 0 and self.transport is not None:
            self._arm()  # the next request's head (or the client hanging up) is due in time

    # ------------------------------------------------------------------ the header timer

    def _arm(self) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or self.active:
            return
        self.guard.counts.header_timeouts += 1
        try:
            peer = transport.get_extra_info("peername")
        except Exception:  # a transport closing under us
            peer = None
        log.debug("closing a connection from %s: no request within %g s", peer, self.guard.header_timeout)
        # a response still unsent after the timeout is not being read: no point flushing it
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()
