"""Busy-polling one connection's socket while a collective waits for a small frame.

Waking a sleeping process costs tens of microseconds (more in a VM); a short spin lets a small
frame be picked up as soon as it arrives (MPI polls too, and like Open MPI on shared cores we
yield the core between polls). The poller reads a dup of the connection's socket and feeds the
connection's get_buffer/buffer_updated exactly as the event loop would; if the loop later finds
the socket readable but empty it just sees EAGAIN.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time


class BusyPoller:
    def __init__(self, conn):
        self._conn = conn
        self._sock: socket.socket | None = None  # a dup of the connection's socket, made on first use

    def spin_until(self, fut: asyncio.Future, seconds: float) -> None:
        """Read the socket ourselves, without sleeping, until `fut` is done or `seconds` pass
        without it. Must run on the loop thread outside the loop's own callbacks (from a coroutine)."""
        conn = self._conn
        sock = self._sock
        if sock is None:
            if conn.transport is None or conn.error is not None:
                return
            fd = conn.transport.get_extra_info("socket").fileno()
            sock = self._sock = socket.socket(fileno=os.dup(fd))
        recv_into, get_buffer, fed = sock.recv_into, conn.get_buffer, conn.buffer_updated
        receives = conn._receives
        clock = time.perf_counter
        deadline = clock() + seconds
        while not fut.done() and conn.error is None and not receives.reading_paused:
            try:
                n = recv_into(get_buffer(-1))
            except BlockingIOError:
                if clock() > deadline:
                    return
                os.sched_yield()  # stay runnable, but let whoever else waits for this core go first
                continue
            except OSError:
                return  # reset etc.: the loop's own read reports it
            if n == 0:
                return  # EOF: the loop sees it too and fails the waits
            fed(n)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
