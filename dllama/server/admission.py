"""Fair shares of the engine between clients: each may have at most `running` requests in the
engine (generating, or waiting there for a slot or KV budget) and `queued` more waiting for one of
those to end; beyond that a request is refused at once (429), and a request that waits longer than
the queue timeout is given up (503). Both carry Retry-After.

A client is its API key where the server has several (one per user), else its address: behind a
proxy every request comes from the proxy's address, and shares one client's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from dataclasses import dataclass, field

from .api_errors import APIError


def default_running(slots: int) -> int:
    """Below half the slots (one at least): one client never holds most of the engine."""
    return max(1, (slots - 1) // 2)


def default_queued(max_queue: int) -> int:
    """Below half the server's queue places, for the same reason."""
    return max(0, (max_queue - 1) // 2)


@dataclass
class _Client:
    running: int = 0
    waiting: deque = field(default_factory=deque)  # futures, in order of arrival


class QueueTimeout(APIError):
    def __init__(self, timeout: float, where: str):
        super().__init__(503, f"The request waited {timeout:g} s {where} without starting; retry later.",
                         type="server_error", code="queue_timeout",
                         retry_after=max(1, math.ceil(timeout / 4)))  # (a queue that long drains slowly)


class Admission:
    def __init__(self, running: int, queued: int, queue_timeout: float):
        if running < 1 or queued < 0 or not queue_timeout > 0:
            raise ValueError(f"bad limits: running {running}, queued {queued}, queue timeout {queue_timeout}")
        self.running, self.queued, self.queue_timeout = running, queued, queue_timeout
        self.clients: dict[str, _Client] = {}

    @property
    def waiting(self) -> int:
        """Requests waiting for their client's turn (not yet in the engine's queue)."""
        return sum(len(c.waiting) for c in self.clients.values())

    @contextlib.asynccontextmanager
    async def turn(self, client: str, deadline: float):
        """Wait for one of the client's `running` places until `deadline` (the loop's clock), and hold
        it. APIError 429 at once when the client already has all its places and queue places."""
        c = self.clients.get(client) or _Client()
        if c.running + len(c.waiting) >= self.running + self.queued:
            raise APIError(429, f"Too many requests from this client: {c.running} are running and {len(c.waiting)} "
                                f"waiting (at most {self.running} and {self.queued}). Retry once one has finished.",
                           type="rate_limit_exceeded", code="too_many_requests_per_client", retry_after=1)
        self.clients[client] = c
        try:
            if c.running < self.running and not c.waiting:
                c.running += 1
            else:
                await self._wait(c, deadline)  # (the request that leaves hands its place over)
        except BaseException:
            self._forget_if_idle(client, c)
            raise
        try:
            yield
        finally:
            c.running -= 1
            self._wake(c)
            self._forget_if_idle(client, c)

    async def _wait(self, c: _Client, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        c.waiting.append(turn)
        try:
            await asyncio.wait_for(turn, max(0.0, deadline - loop.time()))
        except BaseException as e:
            if turn in c.waiting:
                c.waiting.remove(turn)
            elif turn.done() and not turn.cancelled():  # handed a place just as it gave up: pass it on
                c.running -= 1
                self._wake(c)
            if isinstance(e, asyncio.TimeoutError):
                raise QueueTimeout(self.queue_timeout, "behind this client's earlier requests") from None
            raise

    def _wake(self, c: _Client) -> None:
        """Free places go to the first waiters, in order of arrival (the place is taken here, so
        that a request arriving before the waiter resumes cannot take it)."""
        while c.waiting and c.running < self.running:
            turn = c.waiting.popleft()
            if not turn.done():
                c.running += 1
                turn.set_result(None)

    def _forget_if_idle(self, client: str, c: _Client) -> None:
        if not c.running and not c.waiting and self.clients.get(client) is c:
            del self.clients[client]
