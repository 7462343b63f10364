"""Liveness of one connection: a watchdog that fails a wait once the peer has sent nothing for
`timeout` seconds, and a heartbeat that sends a PING after `heartbeat` seconds without other
traffic, so a live but idle peer never looks silent. Timers on the event loop, no threads."""

from __future__ import annotations

import asyncio
from typing import Callable


class Liveness:
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float | None, heartbeat: float | None, *,
                 waiting: Callable[[], bool], silent: Callable[[float], None], ping: Callable[[], bool]):
        """waiting(): whether anything waits on the peer; silent(timeout): the peer was silent
        too long; ping(): send a PING (False: the connection cannot send any more)."""
        self._loop = loop
        self._timeout = timeout
        self._heartbeat = heartbeat
        self._waiting, self._silent, self._ping = waiting, silent, ping
        self.last_rx = self.last_tx = self.wait_since = loop.time()
        self._watch: asyncio.TimerHandle | None = None
        self._beat: asyncio.TimerHandle | None = None
        self._running = False  # heartbeats go out only once the connection is made

    @property
    def timeout(self) -> float | None:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None):
        self._timeout = _positive_or_none("timeout", value)

    @property
    def heartbeat(self) -> float | None:
        return self._heartbeat

    @heartbeat.setter
    def heartbeat(self, value: float | None):
        self._heartbeat = _positive_or_none("heartbeat", value)
        if self._running and value is not None and self._beat is None:
            self._beat = self._loop.call_later(value, self._tick)

    def start(self) -> None:
        """The connection is made: traffic counts from now, heartbeats begin."""
        self.last_rx = self.last_tx = self._loop.time()
        self._running = True
        if self._heartbeat is not None:
            self._beat = self._loop.call_later(self._heartbeat, self._tick)

    def begin_wait(self) -> None:
        """Something starts waiting on the peer (the first posted receive, or a flush)."""
        self.wait_since = self._loop.time()
        self.arm()

    def arm(self) -> None:
        if self._watch is None and self._timeout is not None:
            self._watch = self._loop.call_at(self.wait_since + self._timeout, self._check)

    def stop(self) -> None:
        self._running = False
        for timer in (self._watch, self._beat):
            if timer is not None:
                timer.cancel()
        self._watch = self._beat = None

    def _check(self):
        self._watch = None
        if self._timeout is None or not self._waiting():
            return
        deadline = max(self.last_rx, self.wait_since) + self._timeout
        if self._loop.time() >= deadline - 0.002:
            self._silent(self._timeout)
        else:
            self._watch = self._loop.call_at(deadline, self._check)

    def _tick(self):
        self._beat = None
        if not self._running or self._heartbeat is None:
            return
        if self._loop.time() - self.last_tx >= self._heartbeat * 0.5 and not self._ping():
            return
        self._beat = self._loop.call_at(self.last_tx + self._heartbeat, self._tick)


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive or None")
    return value
