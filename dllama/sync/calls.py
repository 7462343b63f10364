"""One collective call at a time on a group, and what a failed call does to the group.

Each call gets the next call number (on the wire in every frame's tag, so ranks that call
collectives out of step fail loudly), its time and count go into the group's statistics, and
its arrays are flushed before it returns (the caller may reuse them). A failure fails the call
on every rank: the rank that sees it aborts its connections to the others with the reason (they
raise PeerAborted naming the failed peer), and the group refuses every later call.
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from ..errors import NetworkError, PeerAborted, PeerError
from .base import Comm


class SyncStats(NamedTuple):
    calls: int
    seconds: float  # wall time spent inside collectives
    bytes_sent: int  # on the wire, headers included
    bytes_recv: int


class Calls:
    def __init__(self, rank: int, comm: Comm, conns: list):
        self._rank = rank
        self._comm = comm
        self._conns = conns
        self._seq = 0
        self._busy = False
        self.failed: BaseException | None = None
        self.closing = False  # the group closes: peers saying goodbye are no failure
        self._calls = 0
        self._seconds = 0.0
        self._base = (0, 0.0, 0, 0)
        # One lost peer makes the whole group unusable: fail it at once, even if the call now
        # running waits on another peer (which would otherwise wait for its own timeout).
        for c in conns:
            if c is not None:
                c.on_fail.append(self._connection_failed)

    # ------------------------------------------------------------ statistics
    @property
    def stats(self) -> SyncStats:
        sent = sum(c.bytes_sent for c in self._conns if c is not None)
        recv = sum(c.bytes_recv for c in self._conns if c is not None)
        b = self._base
        return SyncStats(self._calls - b[0], self._seconds - b[1], sent - b[2], recv - b[3])

    def reset_stats(self) -> None:
        b = self._base
        s = self.stats
        self._base = (s.calls + b[0], s.seconds + b[1], s.bytes_sent + b[2], s.bytes_recv + b[3])

    # ------------------------------------------------------------ running a call
    async def run(self, coro):
        if self.failed is not None or self._busy:
            coro.close()
            if self._busy:
                raise RuntimeError("collectives on one process group must not overlap; await each call")
            failed = self.failed
            if isinstance(failed, PeerError):  # the same kind of error, naming the same peer, as the failure
                raise type(failed)(f"process group unusable after an earlier failure: {failed.reason}", failed.peer)
            raise NetworkError(f"process group unusable after an earlier failure: {failed}")
        self._busy = True
        self._seq += 1
        self._comm.tag = self._seq & 0xFFFFFFFF
        t0 = time.perf_counter()
        try:
            await coro
            for c in self._conns:
                if c is not None and not c.flushed:
                    await c.flush()  # the caller may reuse its arrays once we return
        except BaseException as e:
            lost = self.failed if isinstance(e, PeerAborted) and isinstance(self.failed, NetworkError) else None
            self.fail(e)
            if lost is not None and lost is not e:
                raise lost from None  # what really happened, not our own abort of the other peers
            raise
        finally:
            self._busy = False
            self._calls += 1
            self._seconds += time.perf_counter() - t0

    # ------------------------------------------------------------ failure
    def _connection_failed(self, exc: BaseException) -> None:
        # a peer that finished and said goodbye is no failure: only a later call that needs it is
        if getattr(exc, "orderly", False) or self.closing or self.failed is not None:
            return
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Give up on the group and tell every peer why (their calls raise PeerAborted)."""
        if self.failed is not None:
            return
        self.failed = exc
        if isinstance(exc, NetworkError):  # names the peer, and for PeerAborted the whole chain
            reason = str(exc)
        elif isinstance(exc, asyncio.CancelledError):
            reason = f"rank {self._rank}: collective cancelled"
        else:
            reason = f"rank {self._rank}: {type(exc).__name__}: {exc}"
        for c in self._conns:
            if c is not None and not c.closed:
                c.abort(reason)
