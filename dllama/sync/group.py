"""ProcessGroup: the collective API (torch.distributed / mpi4py style, async, numpy arrays) over a
full mesh of dllama.net connections, and `init_process_group` to build one.

    group = await init_process_group(rank, world, addrs, session="s1", algo="auto")
    await group.all_reduce(partial, op="sum", codec="q80")   # in place, returns `partial`

Every rank must call the same collectives in the same order with matching shapes, as in MPI;
frames carry the call number, so a mismatch fails loudly instead of mixing data. A network
failure fails the call on every rank: the rank that sees it tells the others (they raise
PeerAborted naming the failed peer), and the group is unusable afterwards.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import NamedTuple

import numpy as np

from ..errors import NetworkError, PeerAborted, PeerError, ProtocolError
from ..net import ConnectionInbox, Listener, PeerRef, connect
from ..net import frames as F
from ..net.connection import DEFAULT_MAX_FRAME
from .auto import Auto
from .base import Comm, split
from .codecs import CODECS, get_codec
from .mesh import Mesh
from .ops import NUMERIC_DTYPES, _is_loc, check_op, get_op
from .rabenseifner import Rabenseifner
from .recursive_doubling import RecursiveDoubling
from .reducer import Reducer, Scratch
from .ring import Ring
from .star import Star

ALGORITHMS = {"star": Star, "ring": Ring, "mesh": Mesh, "rd": RecursiveDoubling, "rabenseifner": Rabenseifner}
ALGO_NAMES = tuple(ALGORITHMS) + ("auto",)
_ALIASES = {"recursive_doubling": "rd", "recursive-doubling": "rd", "rab": "rabenseifner",
            "master-worker": "star", "master_worker": "star"}

DEFAULT_TIMEOUT = 60.0  # a peer silent this long while we wait on it is declared dead
DEFAULT_CHUNK = 1 << 20  # pipelining unit on the wire, until auto sizes it to the link
CHUNK_LINK_TIME = 2e-3  # auto: a chunk is about this much transfer time on the measured link
CHUNK_RANGE = (64 << 10, 4 << 20)
DEFAULT_SPIN = 200e-6  # busy-poll this long for a frame before sleeping (see Connection.spin_until)
_EXACT = CODECS["exact"]


def algo_name(algo: str) -> str:
    name = _ALIASES.get(str(algo).lower(), str(algo).lower())
    if name not in ALGO_NAMES:
        raise ValueError(f"unknown sync algorithm {algo!r}; choose from {', '.join(ALGO_NAMES)}")
    return name


class SyncStats(NamedTuple):
    calls: int
    seconds: float  # wall time spent inside collectives
    bytes_sent: int  # on the wire, headers included
    bytes_recv: int


def _flat(a, what="array", writable=True) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (np.ascontiguousarray makes it so)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only")
    if a.dtype.hasobject:
        raise TypeError(f"{what} has an object dtype; only plain numeric data can be sent")
    return a.reshape(-1)


def _offsets(counts, size, what) -> list[int]:
    counts = [int(x) for x in counts]
    if len(counts) != size or any(x < 0 for x in counts):
        raise ValueError(f"{what}: counts must be {size} non-negative integers, got {counts}")
    offs = [0]
    for x in counts:
        offs.append(offs[-1] + x)
    return offs


class ProcessGroup:
    """p ranks that run collectives together. Not safe for overlapping calls: await each one."""

    def __init__(self, rank: int, size: int, conns: list, *, algo: str = "auto", session: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK, listener: Listener | None = None, addrs=None,
                 spin: float = 0.0):
        self.rank = rank
        self.size = size
        self.session = session
        self.addrs = addrs
        self._conns = conns
        self._listener = listener  # owned: closed with the group
        self._scratch = Scratch()
        self._reducers: dict[tuple, Reducer] = {}
        self._comm = Comm(rank, size, conns, self._scratch, chunk_bytes)
        self._comm.spin = spin
        self.algorithms = {name: cls(self._comm) for name, cls in ALGORITHMS.items()}
        self.auto = Auto(self._comm, self.algorithms)
        self.algo = algo_name(algo)
        self._default = self.auto if self.algo == "auto" else self.algorithms[self.algo]
        self._seq = 0
        self._busy = False
        self._failed: BaseException | None = None
        self._calls = 0
        self._seconds = 0.0
        self._base = (0, 0.0, 0, 0)
        self._closing = False
        # One lost peer makes the whole group unusable: fail it at once, even if the call now
        # running waits on another peer (which would otherwise wait for its own timeout).
        for c in conns:
            if c is not None:
                c.on_fail.append(self._connection_failed)

    # ------------------------------------------------------------ info
    @property
    def world_size(self) -> int:
        return self.size

    @property
    def connections(self) -> list:
        """connections[r]: the Connection to rank r (None at our own rank)."""
        return list(self._conns)

    @property
    def stats(self) -> SyncStats:
        """Totals since creation (or the last reset_stats): calls, seconds in collectives,
        bytes sent/received on the sync connections (headers and heartbeats included)."""
        sent = sum(c.bytes_sent for c in self._conns if c is not None)
        recv = sum(c.bytes_recv for c in self._conns if c is not None)
        b = self._base
        return SyncStats(self._calls - b[0], self._seconds - b[1], sent - b[2], recv - b[3])

    def reset_stats(self) -> None:
        b = self._base
        s = self.stats
        self._base = (s.calls + b[0], s.seconds + b[1], s.bytes_sent + b[2], s.bytes_recv + b[3])

    @property
    def chunk_bytes(self) -> int:
        """The pipelining unit on the wire (identical on every rank)."""
        return self._comm.chunk_bytes

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def choose(self, collective: str, nbytes: int, op: str | None = None) -> str:
        """Which algorithm this group runs for that call (the auto decision, or the fixed algo)."""
        return self.auto.choose(collective, nbytes, op) if self.algo == "auto" else self.algo

    def _algorithm(self, algo):
        if algo is None:
            return self._default
        name = algo_name(algo)
        return self.auto if name == "auto" else self.algorithms[name]

    # ------------------------------------------------------------ running a call
    async def _run(self, coro):
        if self._failed is not None or self._busy:
            coro.close()
            if self._busy:
                raise RuntimeError("collectives on one process group must not overlap; await each call")
            failed = self._failed
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
            lost = self._failed if isinstance(e, PeerAborted) and isinstance(self._failed, NetworkError) else None
            self._fail(e)
            if lost is not None and lost is not e:
                raise lost from None  # what really happened, not our own abort of the other peers
            raise
        finally:
            self._busy = False
            self._calls += 1
            self._seconds += time.perf_counter() - t0

    def _connection_failed(self, exc: BaseException) -> None:
        # a peer that finished and said goodbye is no failure: only a later call that needs it is
        if getattr(exc, "orderly", False) or self._closing or self._failed is not None:
            return
        self._fail(exc)

    def abort(self, reason: str) -> None:
        """Give up on the group now: every peer's pending and later calls fail at once (with
        PeerAborted naming this rank and the reason), not after their timeouts."""
        self._fail(NetworkError(reason))

    def _fail(self, exc: BaseException) -> None:
        """Give up on the group and tell every peer why (their calls raise PeerAborted)."""
        if self._failed is not None:
            return
        self._failed = exc
        if isinstance(exc, NetworkError):  # names the peer, and for PeerAborted the whole chain
            reason = str(exc)
        elif isinstance(exc, asyncio.CancelledError):
            reason = f"rank {self.rank}: collective cancelled"
        else:
            reason = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        for c in self._conns:
            if c is not None and not c.closed:
                c.abort(reason)

    # ------------------------------------------------------------ collectives
    async def all_reduce(self, a: np.ndarray, op: str = "sum", codec: str | None = None, *,
                         algo: str | None = None) -> np.ndarray:
        """Reduce `a` across all ranks, in place; returns `a`. `codec` (f16, q80) compresses the
        payload of float arrays for sum/avg; every rank still ends bit-identical."""
        # The engine reduces the same shapes over and over: arguments are validated once per
        # (op, codec, dtype, size), and the reducer (with its scratch views) is kept.
        try:
            red = self._reducers.get((op, codec, a.dtype, a.size))
        except (AttributeError, TypeError):
            red = None  # not an array, or an unhashable op/codec: the checks below say what is wrong
        if red is not None and a.flags.c_contiguous and a.flags.writeable:
            flat = a.reshape(-1)
            red.bind(flat)
        else:
            flat = _flat(a)
            opx = get_op(op)
            check_op(opx, flat.dtype)
            cdc = _EXACT if codec is None else get_codec(codec, flat.dtype)
            if not cdc.exact and opx.name not in ("sum", "avg"):
                raise ValueError(f"codec {cdc.name!r} only serves sum and avg, not {opx.name!r}")
            if len(self._reducers) > 64:
                self._reducers.clear()
            red = self._reducers[(op, codec, a.dtype, a.size)] = Reducer(flat, opx, cdc, self._scratch)
        if self.size > 1 and flat.size:
            await self._run(self._default.all_reduce(red) if algo is None else self._algorithm(algo).all_reduce(red))
        if red.op.finish is not None:
            red.op.finish(flat, self.size)
        return a

    async def reduce_scatter(self, a: np.ndarray, op: str = "sum", *, counts=None, out=None,
                             algo: str | None = None) -> np.ndarray:
        """Reduce `a` (flattened) across ranks and return this rank's block of the result
        (blocks: `counts`, default a near-equal split). `a` is left unchanged."""
        flat = _flat(a, writable=False)
        opx = get_op(op)
        check_op(opx, flat.dtype)
        offs = split(flat.size, self.size) if counts is None else _offsets(counts, self.size, "reduce_scatter")
        if offs[-1] != flat.size:
            raise ValueError(f"reduce_scatter: counts add up to {offs[-1]}, the array has {flat.size} values")
        work = flat.copy()
        if self.size > 1 and flat.size:
            red = Reducer(work, opx, _EXACT, self._scratch)
            await self._run(self._algorithm(algo).reduce_scatter(red, offs))
        mine = work[offs[self.rank]:offs[self.rank + 1]]
        if opx.finish is not None:
            opx.finish(mine, self.size)
        if out is not None:
            o = _flat(out, "out")
            if o.size != mine.size or o.dtype != mine.dtype:
                raise ValueError(f"reduce_scatter: out must hold {mine.size} {mine.dtype} values")
            o[:] = mine
            return out
        return mine

    async def all_gather(self, a: np.ndarray, *, counts=None, algo: str | None = None) -> np.ndarray:
        """Every rank's `a`, on every rank: shape (p, *a.shape) (equal shapes), or with `counts`
        (values per rank) the 1-D concatenation."""
        flat = _flat(a, writable=False)
        isz = flat.dtype.itemsize
        if counts is None:
            out = np.empty((self.size,) + a.shape, dtype=a.dtype)
            offs = [r * flat.nbytes for r in range(self.size + 1)]
        else:
            eoffs = _offsets(counts, self.size, "all_gather")
            if eoffs[self.rank + 1] - eoffs[self.rank] != flat.size:
                raise ValueError(f"all_gather: counts[{self.rank}] must be this rank's size {flat.size}")
            out = np.empty(eoffs[-1], dtype=a.dtype)
            offs = [o * isz for o in eoffs]
        out8 = out.reshape(-1).view(np.uint8)
        out8[offs[self.rank]:offs[self.rank + 1]] = flat.view(np.uint8)
        if self.size > 1 and offs[-1]:
            await self._run(self._algorithm(algo).all_gather(out8, offs))
        return out

    async def broadcast(self, a: np.ndarray, root: int = 0, *, algo: str | None = None) -> np.ndarray:
        """Root's `a` into every rank's `a` (same shape and dtype everywhere), in place."""
        flat = _flat(a)
        self._check_root(root)
        if self.size > 1 and flat.size:
            await self._run(self._algorithm(algo).broadcast(flat.view(np.uint8), root))
        return a

    async def reduce(self, a: np.ndarray, op: str = "sum", root: int = 0, *,
                     algo: str | None = None) -> np.ndarray | None:
        """Reduce into root's `a` (in place); returns it on root and None elsewhere, where `a`
        is left unchanged."""
        flat = _flat(a, writable=(self.rank == root))
        opx = get_op(op)
        check_op(opx, flat.dtype)
        self._check_root(root)
        work = flat if self.rank == root else flat.copy()
        if self.size > 1 and flat.size:
            red = Reducer(work, opx, _EXACT, self._scratch)
            await self._run(self._algorithm(algo).reduce(red, root))
        if self.rank != root:
            return None
        if opx.finish is not None:
            opx.finish(work, self.size)
        return a

    async def gather(self, a: np.ndarray, root: int = 0, *, counts=None,
                     algo: str | None = None) -> np.ndarray | None:
        """Every rank's `a` on root: shape (p, *a.shape), or with `counts` the 1-D concatenation.
        Returns None on the other ranks."""
        flat = _flat(a, writable=False)
        self._check_root(root)
        isz = flat.dtype.itemsize
        if counts is None:
            offs = [r * flat.nbytes for r in range(self.size + 1)]
            shape = (self.size,) + a.shape
        else:
            eoffs = _offsets(counts, self.size, "gather")
            if eoffs[self.rank + 1] - eoffs[self.rank] != flat.size:
                raise ValueError(f"gather: counts[{self.rank}] must be this rank's size {flat.size}")
            offs = [o * isz for o in eoffs]
            shape = (eoffs[-1],)
        own = flat.view(np.uint8)
        out = out8 = None
        if self.rank == root:
            out = np.empty(shape, dtype=a.dtype)
            out8 = out.reshape(-1).view(np.uint8)
            out8[offs[root]:offs[root + 1]] = own
        if self.size > 1 and offs[-1]:
            await self._run(self._algorithm(algo).gather(out8, own, offs, root))
        return out

    async def scatter(self, a: np.ndarray | None, root: int = 0, *, counts=None, out=None,
                      algo: str | None = None) -> np.ndarray:
        """Root's `a` split into p blocks, block r to rank r; returns this rank's block.
        Blocks: `counts` (values per rank), or the rows of a 2-D+ `a` with p rows (the inverse
        of gather), else a near-equal split of the flattened `a` (1-D blocks). Other ranks pass a=None (or any array): they learn
        dtype and shape from root. `out`, if given, receives the block and is returned."""
        self._check_root(root)
        src = layout = None
        if self.rank == root:
            flat = _flat(a, writable=False)
            if counts is not None:
                eoffs = _offsets(counts, self.size, "scatter")
                if eoffs[-1] != flat.size:
                    raise ValueError(f"scatter: counts add up to {eoffs[-1]}, the array has {flat.size} values")
                shapes = [(eoffs[r + 1] - eoffs[r],) for r in range(self.size)]
            elif a.ndim >= 2 and a.shape[0] == self.size:
                shapes = [a.shape[1:]] * self.size
                eoffs = [r * (flat.size // self.size) for r in range(self.size + 1)]
            else:
                eoffs = split(flat.size, self.size)
                shapes = [(eoffs[r + 1] - eoffs[r],) for r in range(self.size)]
            src = flat.view(np.uint8)
            layout = (flat.dtype, shapes, [o * flat.dtype.itemsize for o in eoffs])
            if self.size == 1:
                return self._deliver(src[: layout[2][1]].copy().view(flat.dtype).reshape(shapes[0]), out)
        blocks = []

        async def body():
            if self.rank == root:
                dtype, shapes, offs = layout
                descr = dtype.descr if dtype.names else dtype.str
                for r in range(self.size):
                    if r != root:
                        header = F.pack_msg({"dtype": descr, "shape": list(shapes[r])})
                        self._conns[r].write_frame(F.MESSAGE, header, self._comm.tag)
                shape = shapes[root]
            else:
                _kind, _tag, header = await self._conns[root].post_recv(None, F.MESSAGE, self._comm.tag, 4096)
                dtype, shape = self._scatter_meta(header, root)
                offs = None
            block = np.empty(shape, dtype=dtype)
            await self._algorithm(algo).scatter(src, block.reshape(-1).view(np.uint8), offs, root)
            blocks.append(block)

        await self._run(body())
        return self._deliver(blocks[0], out)

    @staticmethod
    def _deliver(block, out):
        if out is None:
            return block
        o = _flat(out, "out")
        if o.size != block.size or o.dtype != block.dtype:
            raise ValueError(f"scatter: out must hold {block.size} {block.dtype} values, "
                             f"not {o.size} {o.dtype}")
        o[:] = block.reshape(-1)
        return out

    def _scatter_meta(self, body, root):
        peer = self._conns[root].peer
        try:
            msg = F.unpack_msg(body)
            descr = msg["dtype"]
            dtype = np.dtype([tuple(f) for f in descr] if isinstance(descr, list) else descr)
            shape = tuple(int(x) for x in msg["shape"])
        except Exception as e:
            raise ProtocolError(f"unreadable scatter header: {e}", peer) from None
        if not (dtype in NUMERIC_DTYPES or _is_loc(dtype) or dtype == np.dtype(np.uint8)):
            raise ProtocolError(f"scatter of unsupported dtype {dtype}", peer)
        if any(x < 0 for x in shape) or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > \
                self._conns[root].max_frame * 64:
            raise ProtocolError(f"scatter block of shape {shape} is too large", peer)
        return dtype, shape

    async def barrier(self, *, algo: str | None = None) -> None:
        """Returns once every rank has entered the barrier."""
        if self.size > 1:
            await self._run(self._algorithm(algo).barrier())

    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root!r}")

    # ------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Close the sync connections (peers' pending calls raise PeerClosed) and the listener
        this group started, if any."""
        self._closing = True
        await asyncio.gather(*(c.close() for c in self._conns if c is not None), return_exceptions=True)
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def __repr__(self):
        return f"<ProcessGroup rank {self.rank}/{self.size} algo={self.algo} session={self.session!r}>"


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

        def on_connection(conn, hello):
            if hello.role != "peer" or hello.session != session:
                raise ProtocolError(f"not a peer of session {session!r}", conn.peer)
            incoming.put(conn, hello)

        listener = await Listener(on_connection, secret=secret, rank=rank, max_frame=max_frame).start(
            listen_host or addrs[rank][0], addrs[rank][1])

    async def dial_one(j):
        host, port = addrs[j]
        return await connect(host, port, role="peer", rank=rank, world=world, session=session, secret=secret,
                             peer_rank=j, addr=addrs[rank], timeout=timeout, heartbeat=heartbeat,
                             connect_timeout=connect_timeout, retry=True, max_frame=max_frame)

    async def accept_one(j):
        expect = PeerRef(j, *(addrs[j] if addrs[j] else ("?", 0)))
        conn = await incoming.take(session, j, timeout=connect_timeout, expect=expect)
        if conn.hello is not None and conn.hello.world not in (None, world):
            conn.abort(f"world size mismatch: {conn.hello.world} != {world}")
            raise ProtocolError(f"thinks the group has {conn.hello.world} ranks, we think {world}", conn.peer)
        conn.timeout = timeout
        conn.heartbeat = heartbeat
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
        await group._run(group.auto.calibrate())
        if chunk_bytes is None and group.auto.beta:
            # Every rank measured the same agreed beta, so every rank picks the same chunk size.
            chunk = int(CHUNK_LINK_TIME / group.auto.beta) >> 16 << 16
            group._comm.chunk_bytes = min(max(chunk, CHUNK_RANGE[0]), CHUNK_RANGE[1])
    return group
