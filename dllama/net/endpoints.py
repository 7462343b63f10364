"""Opening connections (`connect`), accepting them (`Listener`), and parking accepted peer
connections until the group that needs them asks (`ConnectionInbox`).

A worker daemon owns one Listener on one port. Its `on_connection(conn, hello)` callback sees
every authenticated connection with the peer's Hello (role "control" or "peer", rank, session)
and dispatches it: control connections to the daemon, peer connections to an inbox from which
`dllama.sync.init_process_group(..., incoming=inbox)` takes them.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import time

from ..errors import NetworkError, PeerTimeout, PeerUnreachable, ProtocolError
from .connection import DEFAULT_MAX_FRAME, Connection
from .peer import PeerRef
from .handshake import HANDSHAKE_TIMEOUT, Hello, client_handshake, server_handshake

log = logging.getLogger("dllama.net")

HANDSHAKE_MAX_FRAME = 64 << 10

_RETRYABLE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EAGAIN, errno.ECONNABORTED}
# attempts a refused connect gets with retry (backing off from 20 ms to 250 ms: about 7 s), so
# that an address given to dial is not knocked on for as long as a connect timeout allows
MAX_CONNECT_ATTEMPTS = 30


async def connect(host: str, port: int, *, role: str = "peer", rank: int | None = None,
                  world: int | None = None, session: str = "", secret=None, peer_rank: int | None = None,
                  addr: tuple[str, int] | None = None, timeout: float | None = None,
                  heartbeat: float | None = None, connect_timeout: float = 10.0, retry: bool = False,
                  max_frame: int = DEFAULT_MAX_FRAME, same_session: bool = False,
                  max_attempts: int = MAX_CONNECT_ATTEMPTS) -> Connection:
    """Open a connection and run the handshake; returns the ready Connection.

    role/rank/world/session/addr describe this node to the server (`addr`: where this node
    listens, if it does). `peer_rank` names the server in errors. `timeout`/`heartbeat` are the
    connection's liveness settings (see Connection). `retry`: retry a refused connect (the server
    may not be listening yet), within `connect_timeout` and `max_attempts`. `same_session`: the
    server must serve `session` (see handshake.py). Raises PeerUnreachable, VersionMismatch,
    AuthError, ProtocolError, PeerTimeout."""
    loop = asyncio.get_running_loop()
    peer = PeerRef(peer_rank, host, int(port))
    deadline = time.monotonic() + connect_timeout
    delay = 0.02
    attempts = 0
    while True:
        attempts += 1
        left = deadline - time.monotonic()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(peer, max_frame=HANDSHAKE_MAX_FRAME, timeout=timeout, heartbeat=heartbeat),
                    host, int(port)),
                max(left, 0.001))
            break
        except asyncio.TimeoutError:
            raise PeerUnreachable(f"no answer to connect within {connect_timeout:.3g} s", peer) from None
        except OSError as e:
            if retry and e.errno in _RETRYABLE and time.monotonic() + delay < deadline and attempts < max_attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            why = e.strerror or str(e)
            tries = f" ({attempts} attempts)" if attempts > 1 else ""
            raise PeerUnreachable(f"cannot connect: {why}{tries}", peer) from None
    conn.max_frame_after_welcome = max_frame
    left = max(deadline - time.monotonic(), 0.5)
    try:
        await client_handshake(conn, role=role, rank=rank, world=world, session=session, secret=secret,
                               addr=addr, timeout=min(left, HANDSHAKE_TIMEOUT), same_session=same_session)
    except BaseException:
        conn._fail(PeerUnreachable("handshake did not complete", conn.peer))
        raise
    return conn


class Listener:
    """Accepts connections on one port, runs the server handshake on each, and hands every
    authenticated connection to `on_connection(conn, hello)` (sync or async). A connection whose
    handshake fails is told why and closed; the listener keeps serving."""

    def __init__(self, on_connection, *, secret=None, rank: int | None = None, session=None,
                 timeout: float | None = None, heartbeat: float | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME, handshake_timeout: float = HANDSHAKE_TIMEOUT):
        self.on_connection = on_connection
        self.secret = secret
        self.rank = rank  # told to clients in the CHALLENGE, if known
        # ... with the session this node serves: a string, or a function that says (None: none yet)
        self.session = session
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.max_frame = max_frame
        self.handshake_timeout = handshake_timeout
        self.rejected = 0  # connections whose handshake failed
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.host: str | None = None
        self.port: int | None = None

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> "Listener":
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._new_connection, host, port, reuse_address=True)
        except OSError as e:
            raise NetworkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = host, int(sockname[1])
        return self

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _new_connection(self) -> Connection:
        # Until the handshake succeeds, nobody may make us allocate more than a handshake needs.
        conn = Connection(None, max_frame=HANDSHAKE_MAX_FRAME, timeout=self.timeout, heartbeat=self.heartbeat)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    async def _serve(self, conn: Connection):
        await conn._made
        try:
            session = self.session() if callable(self.session) else self.session
            hello = await server_handshake(conn, secret=self.secret, rank=self.rank, serving=session,
                                           timeout=self.handshake_timeout)
        except NetworkError as e:
            self.rejected += 1
            log.warning("rejected a connection from %s: %s", conn.peer, e)
            await conn.close()
            return
        except Exception as e:  # a bug in the handshake must not kill the listener
            self.rejected += 1
            log.exception("handshake with %s failed: %s", conn.peer, e)
            await conn.close()
            return
        conn.max_frame = self.max_frame
        try:
            result = self.on_connection(conn, hello)
            if inspect.isawaitable(result):
                await result
        except Exception as e:
            log.warning("connection handler failed for %s: %s", conn.peer, e)
            if not conn.closed:
                conn.abort(f"connection handler failed: {e}")

    async def close(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class ConnectionInbox:
    """Authenticated peer connections waiting for their group, keyed by (session, rank).
    Use `put` as (part of) a Listener's on_connection callback."""

    def __init__(self):
        self._ready: dict[tuple[str, int], Connection] = {}
        self._waiters: dict[tuple[str, int], asyncio.Future] = {}

    def put(self, conn: Connection, hello: Hello | None = None) -> None:
        hello = hello or conn.hello
        if hello is None or hello.role != "peer" or hello.rank is None:
            raise ProtocolError("only peer connections with a rank go to the sync inbox", conn.peer)
        key = (hello.session, hello.rank)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(conn)
            return
        if key in self._ready and not self._ready[key].closed:
            raise ProtocolError(f"a second connection claims rank {hello.rank} in session {hello.session!r}",
                                conn.peer)
        self._ready[key] = conn

    async def take(self, session: str, rank: int, timeout: float | None = None,
                   expect: PeerRef | None = None) -> Connection:
        """The connection from `rank` in `session`, waiting up to `timeout` seconds for it."""
        key = (session, rank)
        conn = self._ready.pop(key, None)
        if conn is not None:
            return conn
        if key in self._waiters:
            raise RuntimeError(f"already waiting for rank {rank} of session {session!r}")
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            who = expect if expect is not None else PeerRef(rank, "?", 0)
            raise PeerTimeout(f"did not connect within {timeout:.3g} s", who) from None
        finally:
            self._waiters.pop(key, None)

    def discard(self, session: str) -> None:
        """Close and forget parked connections of a session nobody will take."""
        for key in [k for k in self._ready if k[0] == session]:
            self._ready.pop(key).abort("session discarded")

    def __len__(self):
        return len(self._ready)
