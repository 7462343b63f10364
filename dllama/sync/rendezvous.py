"""Rendezvous: how the ranks of a group find each other and form the full mesh of connections a
ProcessGroup runs on (who dials whom, who listens, which incoming connections belong to the group).
"""

from __future__ import annotations

import asyncio
import os

from ..errors import ProtocolError
from ..net import ConnectionInbox, Listener, PeerRef, connect
from ..net.connection import DEFAULT_MAX_FRAME
from .group import DEFAULT_CHUNK, DEFAULT_SPIN, DEFAULT_TIMEOUT, ProcessGroup, algo_name


def peers_of(session: str, inbox: ConnectionInbox):
    """A Listener's connection handler that parks the peers of `session` in `inbox` for their group
    and refuses anything else (another session's peer would wait there for ever)."""
    def on_connection(conn, hello):
        if hello.role != "peer" or hello.session != session:
            raise ProtocolError(f"not a peer of session {session!r}", conn.peer)
        inbox.put(conn, hello)

    return on_connection


def _dialer(i: int, j: int, addrs) -> int:
    """Which of ranks i < j opens their connection: the higher one, unless the lower one does not
    listen (e.g. a root that only connects out)."""
    if addrs[i] is None:
        if addrs[j] is None:
            raise ValueError(f"ranks {i} and {j} both have no address; one of them must listen")
        return i
    return j


async def init_process_group(rank: int, world: int, addrs, *, session: str = "dllama", algo: str = "auto",
                             secret=None, timeout: float | None = DEFAULT_TIMEOUT, heartbeat: float | None = None,
                             connect_timeout: float = 30.0, incoming: ConnectionInbox | None = None,
                             listen_host: str | None = None, chunk_bytes: int | None = None,
                             max_frame: int = DEFAULT_MAX_FRAME, spin: float | None = None) -> ProcessGroup:
    """Connect this rank to every other rank (full mesh) and return its ProcessGroup.

    addrs[r]: (host, port) where rank r accepts peer connections, or None for a rank that only
        connects out (a root without a listener). Between two listening ranks the higher rank
        connects to the lower one.
    incoming: where accepted peer connections arrive when someone else owns the listener (a
        worker daemon puts role="peer" connections into a ConnectionInbox). Without it, and if
        any rank must connect to us, we listen on addrs[rank] ourselves (on `listen_host` if
        given, e.g. "0.0.0.0") until the group is closed.
    timeout: seconds a peer may stay silent while we wait on it; heartbeat (default timeout/4)
        keeps idle-but-alive peers from looking silent.
    algo: star, ring, mesh, rd, rabenseifner or auto (measures alpha/beta now).
    chunk_bytes: pipelining unit; every rank must use the same. Default: DEFAULT_CHUNK, or with
        auto about CHUNK_LINK_TIME of transfer on the measured link.
    spin: seconds to busy-poll for an awaited frame before sleeping in the event loop (wake-ups
        cost tens of microseconds; 0 disables). Default: DEFAULT_SPIN, unless more ranks share
        this host's address than it has cores (then spinning would steal their CPU): 0.
        Ranks sharing one event loop must use 0.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    addrs = [None if a is None else (str(a[0]), int(a[1])) for a in addrs]
    if len(addrs) != world:
        raise ValueError(f"need {world} addresses (None for ranks that do not listen), got {len(addrs)}")
    algo = algo_name(algo)
    if spin is None:
        here = addrs[rank][0] if addrs[rank] else None
        local = sum(1 for a in addrs if a is not None and a[0] == here) if here else 1
        spin = DEFAULT_SPIN if local <= (os.cpu_count() or 1) else 0.0
    if heartbeat is None and timeout is not None:
        heartbeat = timeout / 4
    dial = [j for j in range(world) if j != rank and _dialer(min(rank, j), max(rank, j), addrs) == rank]
    accept = [j for j in range(world) if j != rank and j not in dial]
    listener = None
    if accept and incoming is None:
        if addrs[rank] is None:
            raise ValueError(f"rank {rank} must accept connections but has no address")
        incoming = ConnectionInbox()
        listener = await Listener(peers_of(session, incoming), secret=secret, rank=rank, session=session,
                                  max_frame=max_frame).start(
            listen_host or addrs[rank][0], addrs[rank][1])

    async def dial_one(j):
        host, port = addrs[j]
        return await connect(host, port, role="peer", rank=rank, world=world, session=session, secret=secret,
                             peer_rank=j, addr=addrs[rank], timeout=timeout, heartbeat=heartbeat,
                             connect_timeout=connect_timeout, retry=True, max_frame=max_frame, same_session=True)

    async def accept_one(j):
        expect = PeerRef(j, *(addrs[j] if addrs[j] else ("?", 0)))
        conn = await incoming.take(session, j, timeout=connect_timeout, expect=expect)
        if conn.hello is not None and conn.hello.world not in (None, world):
            conn.abort(f"world size mismatch: {conn.hello.world} != {world}")
            raise ProtocolError(f"thinks the group has {conn.hello.world} ranks, we think {world}", conn.peer)
        conn.liveness.timeout = timeout
        conn.liveness.heartbeat = heartbeat
        conn.max_frame = max_frame
        return conn

    tasks = {j: asyncio.ensure_future(dial_one(j) if j in dial else accept_one(j)) for j in range(world) if j != rank}
    try:
        await asyncio.gather(*tasks.values())
    except BaseException:
        for t in tasks.values():
            t.cancel()
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        for res in results:
            if not isinstance(res, BaseException):
                res.abort(f"rank {rank} could not join the group")
        if listener is not None:
            await listener.close()
        raise
    conns = [None if j == rank else tasks[j].result() for j in range(world)]
    group = ProcessGroup(rank, world, conns, algo=algo, session=session,
                         chunk_bytes=chunk_bytes or DEFAULT_CHUNK, listener=listener, addrs=addrs, spin=spin)
    if algo == "auto":
        await group.calibrate(size_chunks=chunk_bytes is None)
    return group
