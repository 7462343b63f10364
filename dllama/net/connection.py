"""One framed TCP connection to one peer.

`Connection` is an asyncio BufferedProtocol rather than a StreamReader/StreamWriter pair: the
event loop reads straight into buffers we hand it, so a payload lands in the numpy array that
a receive was posted for (zero-copy), and small frames arrive in one recv() into a staging
buffer. Receives are posted in order (`post_recv`, MPI-style irecv); frames that arrive before
a receive is posted are queued (bounded, with TCP back-pressure beyond the bound).

Writes go out with `transport.writelines((header, payload))`: uvloop hands both to one writev()
without copying. If the kernel does not take everything at once, the transport keeps a
*reference* to the payload, so the sender must not modify it until `flush()` returns; the
write-buffer limits are set to zero so pause_writing/resume_writing track exactly that.

Liveness (liveness.py): while anything waits on this peer (a posted receive or a flush), a
watchdog fails the wait with `PeerTimeout` once the peer has sent nothing for `timeout` seconds.
Peers send a PING after `heartbeat` seconds without other traffic, so a live but idle peer is
never silent.
An EOF or reset fails every wait at once with `PeerClosed`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from typing import NamedTuple

import numpy as np

from ..errors import (
    MalformedFrame,
    NetworkError,
    PeerAborted,
    PeerClosed,
    PeerTimeout,
    ProtocolError,
    VersionMismatch,
)
from . import frames as F
from .liveness import Liveness
from .parser import FrameParser

DEFAULT_MAX_FRAME = 64 << 20  # raw payloads (weight slices, arrays); the u32 field allows 4 GiB
SMALL_FRAME = 16 << 10  # frames up to this size are sent as one copied buffer
LINGER = 2.0  # after our last words, how long we wait for the peer to close before we reset


_MAGIC = F.MAGIC
_VERSION = F.PROTOCOL_VERSION


class PeerRef(NamedTuple):
    """Who is at the other end: rank (None if not known yet), host, port."""

    rank: int | None
    host: str
    port: int

    def __str__(self):
        addr = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return addr if self.rank is None else f"rank {self.rank} ({addr})"


class _Recv:
    """A posted receive: which kinds/tag it accepts, where the payload goes, who waits."""

    __slots__ = ("codes", "into", "tag", "max_len", "fut", "timer")

    def __init__(self, codes, into, tag, max_len, fut):
        self.codes = codes
        self.into = into
        self.tag = tag
        self.max_len = max_len
        self.fut = fut
        self.timer = None


def _as_bytes_view(buf) -> memoryview:
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


def _nbytes(payload) -> int:
    return len(payload) if isinstance(payload, (bytes, bytearray)) else payload.nbytes


class Connection(asyncio.BufferedProtocol):
    """A framed connection. Create it with `dllama.net.connect()` or receive it from a
    `dllama.net.Listener`; both run the handshake before handing it out."""

    def __init__(self, peer: PeerRef | None = None, *, max_frame: int = DEFAULT_MAX_FRAME,
                 timeout: float | None = None, heartbeat: float | None = None,
                 max_queued: int | None = None, kinds: F.KindRegistry = F.KINDS):
        if not 0 < max_frame <= F.MAX_FRAME_LIMIT:
            raise ValueError(f"max_frame must be in 1..{F.MAX_FRAME_LIMIT}")
        self._loop = asyncio.get_running_loop()
        self.peer = peer or PeerRef(None, "?", 0)
        self.max_frame = max_frame
        self.max_queued = max_queued if max_queued is not None else max(max_frame, 8 << 20)
        self.kinds = kinds
        self.hello = None  # the peer's handshake (dllama.net.handshake.Hello), set by the handshake
        self.max_frame_after_welcome: int | None = None  # a client's max_frame once authenticated
        self.transport: asyncio.Transport | None = None
        # counters, for bytes/token and throughput reports
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.frames_sent = 0
        self.frames_recv = 0
        # receive side
        self._parser = FrameParser(self)
        self._target: _Recv | None = None  # the posted receive the frame in progress is for (None: queued)
        self._receivers: collections.deque[_Recv] = collections.deque()
        self._queue: collections.deque = collections.deque()  # (kind, tag, bytearray) not yet asked for
        self._queued_bytes = 0
        self._reading_paused = False
        # send side
        self._unflushed = False
        self._flush_waiters: list[asyncio.Future] = []
        self._live = Liveness(self._loop, timeout, heartbeat, ping=self._ping, silent=self._silent,
                              waiting=lambda: self._error is None and bool(self._receivers or self._flush_waiters))
        # state
        self.on_fail: list = []  # callables(error), run once when the connection fails or closes
        self._error: NetworkError | None = None
        self._bye = False
        self._spin_sock: socket.socket | None = None  # a dup of our socket, for spin_until
        self._made = self._loop.create_future()
        self._lost = self._loop.create_future()

    # ------------------------------------------------------------------ settings
    @property
    def timeout(self) -> float | None:
        """Seconds the peer may stay silent while we wait on it (None: forever)."""
        return self._live.timeout

    @timeout.setter
    def timeout(self, value: float | None):
        self._live.timeout = value

    @property
    def heartbeat(self) -> float | None:
        """Seconds without traffic after which we send a PING (None: never)."""
        return self._live.heartbeat

    @heartbeat.setter
    def heartbeat(self, value: float | None):
        self._live.heartbeat = value

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> NetworkError | None:
        return self._error

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.peer.host == "?":
            name = transport.get_extra_info("peername")
            if name:
                self.peer = PeerRef(self.peer.rank, str(name[0]), int(name[1]))
        # Pause as soon as anything stays in user space: pause/resume then mean "unflushed/flushed".
        transport.set_write_buffer_limits(high=0, low=0)
        self._live.start()
        if not self._made.done():
            self._made.set_result(None)

    def connection_lost(self, exc):
        if self._error is None:
            if self._bye:  # (normally already failed by the BYE frame itself)
                why = "closed the connection"
            elif self._parser.kind is not None:
                why = "connection lost in the middle of a frame (peer died?)"
            else:
                why = "connection lost (peer died or dropped the connection)"
            if exc is not None:
                why += f": {exc}"
            self._fail(PeerClosed(why, self.peer), close=False)
        self.transport = None
        if self._spin_sock is not None:
            self._spin_sock.close()
            self._spin_sock = None
        if not self._lost.done():
            self._lost.set_result(None)

    def eof_received(self):
        return False  # half-open connections are of no use to us: close

    def pause_writing(self):
        self._unflushed = True

    def resume_writing(self):
        self._unflushed = False
        waiters, self._flush_waiters = self._flush_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # ------------------------------------------------------------------ receive path
    def get_buffer(self, sizehint):
        return self._parser.get_buffer()

    def buffer_updated(self, nbytes):
        self.bytes_recv += nbytes
        self._live.last_rx = self._loop.time()
        self._parser.fed(nbytes)

    def take_staged(self, magic, version, code, tag, length, start) -> bool:
        """The parser's fast path: a whole staged frame for the posted receive at the head goes
        straight into its buffer."""
        if not self._receivers:
            return False
        r = self._receivers[0]
        into = r.into
        if (into is None or magic != _MAGIC or version != _VERSION or code not in r.codes
                or (r.tag is not None and r.tag != tag) or length != len(into)):
            return False  # the slow path checks it and says what is wrong
        into[:] = self._parser.stage_mv[start:start + length]
        self.frames_recv += 1
        self._complete(r, into)
        return True

    def begin_frame(self, magic, version, code, tag, length):
        """Check a header and choose where its payload goes: (kind, destination), or None when the
        connection has failed."""
        if magic != F.MAGIC:
            self._fail(MalformedFrame(f"bad frame magic {bytes(magic)!r} (not a dllama peer?)", self.peer))
            return None
        if version != F.PROTOCOL_VERSION:
            err = VersionMismatch(f"speaks wire protocol version {version}, this node speaks {F.PROTOCOL_VERSION}",
                                  self.peer)
            # Say so in our own version before hanging up, so the other side can report it too.
            try:
                self.write_frame(F.REJECT, F.pack_msg({"reason": f"this node speaks wire protocol version "
                                                                 f"{F.PROTOCOL_VERSION}", "type": "VersionMismatch"}))
            except Exception:
                pass
            self._fail(err, close=False)
            if self.transport is not None:
                self.transport.close()
            return None
        kind = self.kinds.by_code(code)
        if kind is None:
            self._fail(MalformedFrame(f"unknown frame kind {code}", self.peer))
            return None
        limit = self.max_frame if kind.max_len is None else min(kind.max_len, self.max_frame)
        if length > limit:
            self._fail(MalformedFrame(
                f"{kind.name} frame of {length} bytes exceeds the limit of {limit} bytes", self.peer))
            return None
        self._target = None
        if code not in F.INTERNAL_CODES and self._receivers:
            r = self._receivers[0]
            err = self._mismatch(kind, tag, length, r.codes, r.into, r.tag, r.max_len)
            if err is not None:
                self._fail(err)
                return None
            self._target = r
            if r.into is not None:
                return kind, r.into
        return kind, memoryview(bytearray(length))

    def finish_frame(self, kind, tag, dest):
        target, self._target = self._target, None
        self.frames_recv += 1
        code = kind.code
        if code in F.INTERNAL_CODES:
            if code == F.ABORT.code:
                self._on_abort(dest)
            elif code == F.BYE.code:
                self._bye = True
                self._fail(PeerClosed("closed the connection", self.peer, orderly=True), close=False)
                if self.transport is not None:
                    self.transport.close()  # the peer half-closed and waits for us
            return  # PING: nothing to do, receiving it was the point
        if code == F.WELCOME.code and self.max_frame_after_welcome:
            # The handshake is done: lift the handshake's size limit before the next frame is parsed.
            self.max_frame, self.max_frame_after_welcome = self.max_frame_after_welcome, None
        if target is not None:
            self._complete(target, dest if target.into is not None else (kind, tag, dest.obj))
            return
        self._queue.append((kind, tag, dest.obj))
        self._queued_bytes += len(dest)
        if self._queued_bytes > self.max_queued and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _complete(self, r: _Recv, value) -> None:
        """The posted receive at the head of the queue got its frame."""
        self._receivers.popleft()
        if r.timer is not None:
            r.timer.cancel()
        if not r.fut.done():
            r.fut.set_result(value)

    def _on_abort(self, body):
        try:
            msg = F.unpack_msg(body)
            reason = str(msg.get("reason", "no reason given"))[:2000]
        except Exception:
            reason = "no readable reason"
        self._fail(PeerAborted(f"gave up: {reason}", self.peer))

    # ------------------------------------------------------------------ posting receives
    def post_recv(self, into=None, kind: F.FrameKind = F.ARRAY, tag: int | None = None,
                  max_len: int | None = None) -> asyncio.Future:
        """Post a receive for the next frame and return a future (the irecv of this layer).

        `into`: a writable byte memoryview (see `as_bytes_view`) that must be exactly the frame's
        length; the future then resolves to it. Without `into` the frame is allocated (bounded by
        `max_len` and the kind's limit) and the future resolves to (kind, tag, bytearray).
        `kind` may be one FrameKind or a tuple of them; `tag`, if given, must match."""
        codes = frozenset(k.code for k in kind) if isinstance(kind, tuple) else frozenset((kind.code,))
        fut = self._loop.create_future()
        if self._queue:
            self._take_queued(codes, into, tag, max_len, fut)
            return fut
        if self._error is not None:
            fut.set_exception(self._error)
            fut.exception()  # the awaiting caller sees it; don't log it as unretrieved
            return fut
        r = _Recv(codes, into, tag, max_len, fut)
        if not self._receivers:
            self._live.begin_wait()
            arriving = self._parser.kind
            if arriving is not None and self._target is None and arriving.code not in F.INTERNAL_CODES:
                # A frame nobody had asked for is arriving right now: it is this receive's.
                self._receivers.append(r)
                self._claim_inflight(r)
                return fut
        self._receivers.append(r)
        return fut

    def _claim_inflight(self, r: _Recv) -> None:
        parser = self._parser
        err = self._mismatch(parser.kind, parser.tag, len(parser.dest), r.codes, r.into, r.tag, r.max_len)
        if err is not None:
            self._fail(err)
            return
        self._target = r
        if r.into is not None:  # what has arrived so far moves, and the rest lands in place
            parser.redirect(r.into)

    def _mismatch(self, kind, tag, length, codes, into, want_tag, max_len):
        """The error for a frame that does not fit a posted receive, or None."""
        if kind.code not in codes:
            names = "/".join(sorted(self.kinds.by_code(c).name for c in codes))
            return ProtocolError(f"sent a {kind.name} frame where a {names} frame was expected", self.peer)
        if want_tag is not None and tag != want_tag:
            return ProtocolError(f"out of step: sent a frame of collective call #{tag}, expected call #{want_tag} "
                                 "(do all ranks call the same collectives in the same order?)", self.peer)
        if into is not None and length != len(into):
            return MalformedFrame(f"sent a {length}-byte {kind.name} frame, expected {len(into)} bytes "
                                  "(do all ranks pass arrays of the same size and dtype?)", self.peer)
        if into is None and max_len is not None and length > max_len:
            return MalformedFrame(f"{kind.name} frame of {length} bytes exceeds the expected maximum of {max_len}",
                                  self.peer)
        return None

    def _take_queued(self, codes, into, tag, max_len, fut):
        kind, ftag, buf = self._queue.popleft()
        self._queued_bytes -= len(buf)
        if self._reading_paused and self._queued_bytes <= self.max_queued and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        err = self._mismatch(kind, ftag, len(buf), codes, into, tag, max_len)
        if err is not None:
            self._fail(err)
            fut.set_exception(err)
            fut.exception()
            return
        if into is not None:
            into[:] = buf
            fut.set_result(into)
        else:
            fut.set_result((kind, ftag, buf))

    def _cancel_recv(self, r: _Recv, exc: NetworkError | None):
        """Withdraw a posted receive (timeout or cancellation). If its frame is already arriving,
        the stream position is lost and the connection fails."""
        if r.timer is not None:
            r.timer.cancel()
        if self._target is r:
            self._fail(exc or PeerTimeout("a receive was cancelled while its frame was arriving", self.peer))
        else:
            try:
                self._receivers.remove(r)
            except ValueError:
                pass
        if exc is not None and not r.fut.done():
            r.fut.set_exception(exc)

    async def _wait_recv(self, fut, timeout):
        if fut.done() or timeout is None:
            return await fut
        r = self._receivers[-1]  # post_recv just appended it
        r.timer = self._loop.call_later(
            timeout, lambda: self._cancel_recv(r, PeerTimeout(f"no reply within {timeout:.3g} s", self.peer)))
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_recv(r, None)
            raise

    # ------------------------------------------------------------------ busy-polling
    def spin_until(self, fut: asyncio.Future, seconds: float) -> None:
        """Read this peer's socket ourselves, without sleeping, until `fut` is done or `seconds`
        pass without it. Waking a sleeping process costs tens of microseconds (more in a VM);
        a short spin lets a small frame be picked up as soon as it arrives (MPI polls too, and
        like Open MPI on shared cores we yield the core between polls).
        Must run on the loop thread outside the loop's own callbacks (i.e. from a coroutine):
        it feeds get_buffer/buffer_updated exactly as the loop would; if the loop later finds
        the socket readable but empty it just sees EAGAIN."""
        sock = self._spin_sock
        if sock is None:
            if self.transport is None or self._error is not None:
                return
            fd = self.transport.get_extra_info("socket").fileno()
            sock = self._spin_sock = socket.socket(fileno=os.dup(fd))
        recv_into = sock.recv_into
        clock = time.perf_counter
        deadline = clock() + seconds
        while not fut.done() and self._error is None and not self._reading_paused:
            try:
                n = recv_into(self.get_buffer(-1))
            except BlockingIOError:
                if clock() > deadline:
                    return
                os.sched_yield()  # stay runnable, but let whoever else waits for this core go first
                continue
            except OSError:
                return  # reset etc.: the loop's own read reports it
            if n == 0:
                return  # EOF: the loop sees it too and fails the waits
            self.buffer_updated(n)

    # ------------------------------------------------------------------ high-level receive
    async def recv_msg(self, kinds=F.MESSAGE, timeout: float | None = None) -> tuple[str, dict]:
        """Receive the next control message; `kinds`: a kind (name, code or FrameKind) or a list.
        Returns (kind name, body dict)."""
        want = tuple(self.kinds.get(k) for k in (kinds if isinstance(kinds, (list, tuple, set)) else (kinds,)))
        for k in want:
            if k.body != F.MSG:
                raise ValueError(f"frame kind {k.name!r} carries raw bytes; use recv_bytes/recv_array")
        fut = self.post_recv(None, want, None, max(k.max_len or self.max_frame for k in want))
        kind, _tag, buf = await self._wait_recv(fut, timeout)
        try:
            return kind.name, F.unpack_msg(buf)
        except Exception as e:
            err = MalformedFrame(f"unreadable {kind.name} message: {e}", self.peer)
            self._fail(err)
            raise err from None

    async def recv_bytes(self, kind=F.ARRAY, max_len: int | None = None, timeout: float | None = None,
                         tag: int | None = None) -> bytearray:
        """Receive the next raw frame into a new bytearray (length bounded by `max_len`)."""
        k = self.kinds.get(kind)
        fut = self.post_recv(None, k, tag, max_len)
        _kind, _tag, buf = await self._wait_recv(fut, timeout)
        return buf

    async def recv_array(self, into=None, *, dtype=None, kind=F.ARRAY, max_len: int | None = None,
                         timeout: float | None = None, tag: int | None = None) -> np.ndarray:
        """Receive the next raw frame as an array. With `into` (a C-contiguous writable array) the
        payload lands in it and its size must match; otherwise a 1-D array of `dtype` is allocated
        (at most `max_len` bytes)."""
        k = self.kinds.get(kind)
        if into is not None:
            await self._wait_recv(self.post_recv(_as_bytes_view(into), k, tag), timeout)
            return into
        dt = np.dtype(dtype if dtype is not None else np.uint8)
        buf = await self._wait_recv(self.post_recv(None, k, tag, max_len), timeout)
        buf = buf[2]
        if len(buf) % dt.itemsize:
            err = MalformedFrame(f"{len(buf)}-byte frame is not a whole number of {dt} items", self.peer)
            self._fail(err)
            raise err
        return np.frombuffer(buf, dtype=dt)

    # ------------------------------------------------------------------ send path
    def write_frame(self, kind: F.FrameKind, payload=None, tag: int = 0) -> None:
        """Queue one frame without waiting. The payload (bytes, or a contiguous array/memoryview)
        is not copied: don't modify it before `flush()` unless `flushed` is true."""
        if self._error is not None:
            raise self._error
        n = 0 if payload is None else _nbytes(payload)
        limit = self.max_frame if kind.max_len is None else min(kind.max_len, self.max_frame)
        if n > limit:
            raise ValueError(f"{kind.name} frame of {n} bytes exceeds the limit of {limit} bytes")
        header = F.pack_header(kind, tag, n)
        if n:
            self.transport.writelines((header, payload))
        else:
            self.transport.write(header)
        self.bytes_sent += F.HEADER_SIZE + n
        self.frames_sent += 1
        self._live.last_tx = self._loop.time()

    def write_array(self, payload, tag: int = 0) -> None:
        """Hot path of the collectives: an ARRAY frame, no checks beyond the transport's."""
        if self._error is not None:
            raise self._error
        n = payload.nbytes
        header = F.pack_header(F.ARRAY, tag, n)
        if n > SMALL_FRAME:
            self.transport.writelines((header, payload))
        else:  # one small immutable buffer: a plain write(), and nothing of ours stays referenced
            self.transport.write(b"".join((header, payload)))
        self.bytes_sent += F.HEADER_SIZE + n
        self.frames_sent += 1
        self._live.last_tx = self._loop.time()

    @property
    def flushed(self) -> bool:
        """True when every written byte is in the kernel (written payloads may be reused)."""
        return not self._unflushed

    async def flush(self) -> None:
        """Wait until every written byte has left user space (bounded by the peer timeout)."""
        while self._unflushed:
            if self._error is not None:
                raise self._error
            fut = self._loop.create_future()
            self._flush_waiters.append(fut)
            if len(self._flush_waiters) == 1 and not self._receivers:
                self._live.begin_wait()
            else:
                self._live.arm()
            await fut
        if self._error is not None and self.transport is None:
            raise self._error

    async def send_msg(self, kind, body: dict) -> None:
        """Send a control message (a msgpack map) of a MSG kind."""
        k = self.kinds.get(kind)
        if k.body != F.MSG:
            raise ValueError(f"frame kind {k.name!r} carries raw bytes; use send_bytes/send_array")
        self.write_frame(k, F.pack_msg(body))
        await self.flush()

    async def send_array(self, array, kind=F.ARRAY, tag: int = 0) -> None:
        """Send a contiguous array (or any bytes-like) as one raw frame; returns when the buffer
        may be reused. Large weight payloads get TCP back-pressure this way."""
        k = self.kinds.get(kind)
        if k.body != F.RAW:
            raise ValueError(f"frame kind {k.name!r} carries a msgpack map; use send_msg")
        if isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                raise ValueError("send_array needs a C-contiguous array")
            array = array.reshape(-1).view(np.uint8)
        self.write_frame(k, array, tag)
        await self.flush()

    send_bytes = send_array

    # ------------------------------------------------------------------ liveness
    def _silent(self, timeout: float) -> None:
        self._fail(PeerTimeout(f"sent nothing for {timeout:.3g} s (stopped, hung or cut off?)", self.peer))

    def _ping(self) -> bool:
        if self._error is not None or self.transport is None:
            return False
        try:
            self.write_frame(F.PING)
        except (NetworkError, RuntimeError):
            return False
        return True

    # ------------------------------------------------------------------ failure and shutdown
    def _fail(self, exc: NetworkError, close: bool = True):
        """Record the first error, fail everything waiting, drop the transport."""
        if self._error is None:
            self._error = exc
        exc = self._error
        callbacks, self.on_fail = self.on_fail, []
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:  # a listener's bug must not stop the failure from spreading
                pass
        self._live.stop()
        self._parser.stop()
        receivers, self._receivers = self._receivers, collections.deque()
        for r in receivers:
            if r.timer is not None:
                r.timer.cancel()
            if not r.fut.done():
                r.fut.set_exception(exc)
                r.fut.exception()
        waiters, self._flush_waiters = self._flush_waiters, []
        for w in waiters:
            if not w.done():
                w.set_exception(exc)
                w.exception()
        if close and self.transport is not None:
            if isinstance(exc, ProtocolError):
                # The peer misbehaved: tell it what we saw (it raises PeerAborted with this).
                self._send_last_words(F.ABORT, F.pack_msg({"reason": str(exc)[:2000]}))
            elif isinstance(exc, PeerAborted):
                self.transport.close()
            else:
                self.transport.abort()

    def _send_last_words(self, kind, body) -> None:
        """Send a final frame and half-close: FIN after it, but keep reading (and dropping) until
        the peer closes too. Closing with unread input would make the kernel send RST, and an
        RST can destroy our final frame before the peer reads it."""
        try:
            self.transport.write(F.pack_header(kind, 0, len(body)) + body)
            self.transport.write_eof()
        except Exception:
            self.transport.abort()
            return
        transport = self.transport
        self._loop.call_later(LINGER, lambda: transport.is_closing() or transport.abort())

    def abort(self, reason: str) -> None:
        """Tell the peer why we give up (it raises PeerAborted naming us) and drop the connection."""
        if self._error is None and self.transport is not None:
            self._error = PeerAborted(f"connection given up locally: {reason}", self.peer)
            self._fail(self._error, close=False)
            self._send_last_words(F.ABORT, F.pack_msg({"reason": reason[:2000]}))

    async def close(self, timeout: float = 2.0) -> None:
        """Orderly shutdown: tell the peer (its waits raise PeerClosed 'closed the connection')."""
        if self.transport is not None and self._error is None:
            self._error = PeerClosed("connection closed locally", self.peer)
            self._fail(self._error, close=False)
            self._send_last_words(F.BYE, b"")
        elif self.transport is not None:
            self.transport.close()
        if not self._lost.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._lost), timeout)
            except asyncio.TimeoutError:
                if self.transport is not None:
                    self.transport.abort()

    def __repr__(self):
        state = "closed" if self._error is not None else "open"
        return f"<Connection {self.peer} {state} sent={self.bytes_sent} recv={self.bytes_recv}>"


as_bytes_view = _as_bytes_view
