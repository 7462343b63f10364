"""Matching frames to receives on one connection, as MPI matches messages to posted receives.

Receives are posted in order (`post`, the irecv of this layer) and take frames in arrival order:
a frame that meets a posted receive lands in its buffer (zero-copy when the receive gave one).
A frame that arrives before its receive waits in the unexpected queue, bounded: beyond
`max_queued` bytes reading pauses, so TCP back-pressure reaches the sender. A frame that does
not fit the receive it meets (other kind, other call number, other size) fails the connection:
after it the position in the stream cannot be trusted.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

import numpy as np

from ..errors import MalformedFrame, NetworkError, PeerTimeout, ProtocolError
from . import frames as F


@dataclass(slots=True)
class PostedRecv:
    """A posted receive: which kinds/tag it accepts, where the payload goes, who waits."""

    codes: frozenset
    into: memoryview | None
    tag: int | None
    max_len: int | None
    fut: asyncio.Future
    timer: asyncio.TimerHandle | None = None


def as_bytes_view(buf) -> memoryview:
    """A flat, writable byte view of a contiguous buffer (numpy array, bytearray, memoryview)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("receive buffer must be C-contiguous")
        buf = buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("receive buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _settle_with(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()  # the awaiting caller sees it; don't log it as unretrieved


class Receives:
    """The posted and the unexpected queue of one Connection (`conn`: for its peer name, frame
    kinds, transport, parser and failure)."""

    def __init__(self, conn, max_queued: int):
        self._conn = conn
        self.max_queued = max_queued
        self.posted: collections.deque[PostedRecv] = collections.deque()
        self.target: PostedRecv | None = None  # the receive the frame in progress is for (None: unexpected)
        self._unexpected: collections.deque = collections.deque()  # (kind, tag, bytearray)
        self._unexpected_bytes = 0
        self.reading_paused = False

    # ------------------------------------------------------------------ frames arriving
    def take_staged(self, code, tag, length, payload: memoryview) -> bool:
        """The fast path: a whole frame that fits the receive at the head exactly goes straight
        into its buffer. False: anything else (the slow path checks it and says what is wrong)."""
        if not self.posted:
            return False
        r = self.posted[0]
        into = r.into
        if into is None or code not in r.codes or (r.tag is not None and r.tag != tag) or length != len(into):
            return False
        into[:] = payload
        self._complete(r, into)
        return True

    def destination(self, kind: F.FrameKind, tag: int, length: int) -> memoryview | None:
        """Where a checked frame's payload goes (None: it did not fit, the connection failed)."""
        self.target = None
        if kind.code not in F.INTERNAL_CODES and self.posted:
            r = self.posted[0]
            err = self._mismatch(kind, tag, length, r)
            if err is not None:
                self._conn._fail(err)
                return None
            self.target = r
            if r.into is not None:
                return r.into
        return memoryview(bytearray(length))

    def deliver(self, kind: F.FrameKind, tag: int, dest: memoryview) -> None:
        """A whole frame: to its receive, or into the unexpected queue."""
        target, self.target = self.target, None
        if target is not None:
            self._complete(target, dest if target.into is not None else (kind, tag, dest.obj))
            return
        self._unexpected.append((kind, tag, dest.obj))
        self._unexpected_bytes += len(dest)
        transport = self._conn.transport
        if self._unexpected_bytes > self.max_queued and not self.reading_paused and transport is not None:
            self.reading_paused = True
            transport.pause_reading()

    def _complete(self, r: PostedRecv, value) -> None:
        self.posted.popleft()
        if r.timer is not None:
            r.timer.cancel()
        if not r.fut.done():
            r.fut.set_result(value)

    # ------------------------------------------------------------------ posting receives
    def post(self, codes: frozenset, into, tag, max_len) -> asyncio.Future:
        conn = self._conn
        fut = conn._loop.create_future()
        r = PostedRecv(codes, into, tag, max_len, fut)
        if self._unexpected:
            self._take_unexpected(r)
            return fut
        if conn.error is not None:
            _settle_with(fut, conn.error)
            return fut
        first = not self.posted
        self.posted.append(r)
        if first:
            conn.liveness.begin_wait()
            parser = conn._parser
            if parser.kind is not None and self.target is None and parser.kind.code not in F.INTERNAL_CODES:
                self._claim_inflight(r)  # a frame nobody had asked for is arriving right now: it is this one's
        return fut

    def _claim_inflight(self, r: PostedRecv) -> None:
        parser = self._conn._parser
        err = self._mismatch(parser.kind, parser.tag, len(parser.dest), r)
        if err is not None:
            self._conn._fail(err)
            return
        self.target = r
        if r.into is not None:  # what has arrived so far moves, and the rest lands in place
            parser.redirect(r.into)

    def _take_unexpected(self, r: PostedRecv) -> None:
        kind, tag, buf = self._unexpected.popleft()
        self._unexpected_bytes -= len(buf)
        transport = self._conn.transport
        if self.reading_paused and self._unexpected_bytes <= self.max_queued and transport is not None:
            self.reading_paused = False
            transport.resume_reading()
        err = self._mismatch(kind, tag, len(buf), r)
        if err is not None:
            self._conn._fail(err)
            _settle_with(r.fut, err)
        elif r.into is not None:
            r.into[:] = buf
            r.fut.set_result(r.into)
        else:
            r.fut.set_result((kind, tag, buf))

    def _mismatch(self, kind, tag, length, r: PostedRecv):
        """The error for a frame that does not fit the posted receive `r`, or None."""
        peer = self._conn.peer
        if kind.code not in r.codes:
            names = "/".join(sorted(self._conn.kinds.by_code(c).name for c in r.codes))
            return ProtocolError(f"sent a {kind.name} frame where a {names} frame was expected", peer)
        if r.tag is not None and tag != r.tag:
            return ProtocolError(f"out of step: sent a frame of collective call #{tag}, expected call #{r.tag} "
                                 "(do all ranks call the same collectives in the same order?)", peer)
        if r.into is not None and length != len(r.into):
            return MalformedFrame(f"sent a {length}-byte {kind.name} frame, expected {len(r.into)} bytes "
                                  "(do all ranks pass arrays of the same size and dtype?)", peer)
        if r.into is None and r.max_len is not None and length > r.max_len:
            return MalformedFrame(f"{kind.name} frame of {length} bytes exceeds the expected maximum of {r.max_len}",
                                  peer)
        return None

    # ------------------------------------------------------------------ waiting and withdrawing
    async def wait(self, fut: asyncio.Future, timeout: float | None):
        """Await a receive just posted; after `timeout` seconds it is withdrawn (PeerTimeout)."""
        if fut.done() or timeout is None:
            return await fut
        r = self.posted[-1]  # post() just appended it
        r.timer = self._conn._loop.call_later(
            timeout, lambda: self._cancel(r, PeerTimeout(f"no reply within {timeout:.3g} s", self._conn.peer)))
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel(r, None)
            raise

    def _cancel(self, r: PostedRecv, exc: NetworkError | None):
        """Withdraw a posted receive. If its frame is already arriving, the stream position is
        lost and the connection fails."""
        if r.timer is not None:
            r.timer.cancel()
        if self.target is r:
            self._conn._fail(exc or PeerTimeout("a receive was cancelled while its frame was arriving",
                                                self._conn.peer))
        else:
            try:
                self.posted.remove(r)
            except ValueError:
                pass
        if exc is not None and not r.fut.done():
            r.fut.set_exception(exc)

    def fail_all(self, exc: NetworkError) -> None:
        posted, self.posted = self.posted, collections.deque()
        for r in posted:
            if r.timer is not None:
                r.timer.cancel()
            _settle_with(r.fut, exc)
