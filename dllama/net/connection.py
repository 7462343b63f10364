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

The parts: frame parsing (parser.py), receive matching (matching.py), liveness (liveness.py),
typed messages (messages.py), busy-polling (busy_poll.py). An EOF or reset fails every wait at
once with `PeerClosed`; a peer that breaks the protocol is told why before we hang up.
"""

from __future__ import annotations

import asyncio
import socket

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
from .busy_poll import BusyPoller
from .liveness import Liveness
from .matching import Receives
from .messages import MessageIO
from .parser import FrameParser
from .peer import PeerRef

DEFAULT_MAX_FRAME = 64 << 20  # raw payloads (weight slices, arrays); the u32 field allows 4 GiB
SMALL_FRAME = 16 << 10  # frames up to this size are sent as one copied buffer
LINGER = 2.0  # after our last words, how long we wait for the peer to close before we reset


class Connection(MessageIO, asyncio.BufferedProtocol):
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
        self._receives = Receives(self, max_queued if max_queued is not None else max(max_frame, 8 << 20))
        self._poller = BusyPoller(self)
        # send side
        self._unflushed = False
        self._flush_waiters: list[asyncio.Future] = []
        # `liveness.timeout`: seconds the peer may stay silent while we wait on it (None: forever);
        # `liveness.heartbeat`: seconds without traffic after which we send a PING (None: never)
        self.liveness = Liveness(self._loop, timeout, heartbeat, ping=self._ping, silent=self._silent, waiting=lambda: (
            self._error is None and bool(self._receives.posted or self._flush_waiters)))
        # state
        self.on_fail: list = []  # callables(error), run once when the connection fails or closes
        self._error: NetworkError | None = None
        self._bye = False
        self._lingering = False  # our last words are sent: reading (and dropping) until the peer closes
        self._made = self._loop.create_future()
        self._lost = self._loop.create_future()

    # ------------------------------------------------------------------ state
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
        self.liveness.start()
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
        self._poller.close()
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
        self.liveness.last_rx = self._loop.time()
        self._parser.fed(nbytes)

    def take_staged(self, magic, version, code, tag, length, start) -> bool:
        """The parser's fast path: a whole staged frame for the receive at the head."""
        if magic != F.MAGIC or version != F.PROTOCOL_VERSION:
            return False
        if self._receives.take_staged(code, tag, length, self._parser.stage_mv[start:start + length]):
            self.frames_recv += 1
            return True
        return False

    def begin_frame(self, magic, version, code, tag, length):
        """Check a header and choose where its payload goes: (kind, destination), or None when the
        connection has failed."""
        if magic == F.MAGIC and version != F.PROTOCOL_VERSION:
            self._reject_version(version)
            return None
        kind, problem = F.check_header(magic, code, length, self.kinds, self.max_frame)
        if problem is not None:
            self._fail(MalformedFrame(problem, self.peer))
            return None
        dest = self._receives.destination(kind, tag, length)
        return None if dest is None else (kind, dest)

    def _reject_version(self, version):
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

    def finish_frame(self, kind, tag, dest):
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
        self._receives.deliver(kind, tag, dest)

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
        return self._receives.post(codes, into, tag, max_len)

    def spin_until(self, fut: asyncio.Future, seconds: float) -> None:
        """Busy-poll this peer's socket until `fut` is done or `seconds` pass (busy_poll.py)."""
        self._poller.spin_until(fut, seconds)

    # ------------------------------------------------------------------ send path
    def write_frame(self, kind: F.FrameKind, payload=None, tag: int = 0) -> None:
        """Queue one frame without waiting. The payload (bytes, or a contiguous array/memoryview)
        is not copied: don't modify it before `flush()` unless `flushed` is true."""
        if self._error is not None:
            raise self._error
        n = 0 if payload is None else len(payload) if isinstance(payload, (bytes, bytearray)) else payload.nbytes
        limit = F.frame_limit(kind, self.max_frame)
        if n > limit:
            raise ValueError(f"{kind.name} frame of {n} bytes exceeds the limit of {limit} bytes")
        header = F.pack_header(kind, tag, n)
        if n:
            self.transport.writelines((header, payload))
        else:
            self.transport.write(header)
        self._count_sent(n)

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
        self._count_sent(n)

    def _count_sent(self, n: int) -> None:
        self.bytes_sent += F.HEADER_SIZE + n
        self.frames_sent += 1
        self.liveness.last_tx = self._loop.time()

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
            if len(self._flush_waiters) == 1 and not self._receives.posted:
                self.liveness.begin_wait()
            else:
                self.liveness.arm()
            await fut
        if self._error is not None and self.transport is None:
            raise self._error

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
        self.liveness.stop()
        self._parser.stop()
        self._receives.fail_all(exc)
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
        self._lingering = True
        if self._receives.reading_paused:  # (back-pressure on queued frames; what comes now is dropped)
            self._receives.reading_paused = False
            self.transport.resume_reading()
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
        elif self.transport is not None and not self._lingering:
            self.transport.close()
        # Lingering, we wait for the peer to close after reading our last words: closing now, with
        # its frames unread, would reset the connection, and a peer still writing to us would fail
        # on the reset (broken pipe) before it read why we gave up.
        if not self._lost.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._lost), timeout)
            except asyncio.TimeoutError:
                if self.transport is not None:
                    self.transport.abort()

    def __repr__(self):
        state = "closed" if self._error is not None else "open"
        return f"<Connection {self.peer} {state} sent={self.bytes_sent} recv={self.bytes_recv}>"

