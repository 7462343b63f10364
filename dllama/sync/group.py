"""ProcessGroup: the collective API (torch.distributed / mpi4py style, async, numpy arrays) over a
full mesh of dllama.net connections (`init_process_group`, in rendezvous.py, builds one).

    group = await init_process_group(rank, world, addrs, session="s1", algo="auto")
    await group.all_reduce(partial, op="sum", codec="q80")   # in place, returns `partial`

Every rank must call the same collectives in the same order with matching shapes, as in MPI;
frames carry the call number, so a mismatch fails loudly instead of mixing data. A network
failure fails the call on every rank and leaves the group unusable (calls.py). The algorithms
are in their own modules, the buffer layout of each collective in layout.py.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..errors import NetworkError
from ..net import Listener
from ..net import frames as F
from .auto import Auto
from .base import Comm, split
from .calls import Calls, SyncStats
from . import layout as L
from .codecs import CODECS, get_codec
from .mesh import Mesh
from .ops import check_op, get_op
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
        self._calls = Calls(rank, self._comm, conns)

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
        return self._calls.stats

    def reset_stats(self) -> None:
        self._calls.reset_stats()

    @property
    def chunk_bytes(self) -> int:
        """The pipelining unit on the wire (identical on every rank)."""
        return self._comm.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._comm.chunk_bytes = value

    @property
    def failed(self) -> BaseException | None:
        return self._calls.failed

    def choose(self, collective: str, nbytes: int, op: str | None = None) -> str:
        """Which algorithm this group runs for that call (the auto decision, or the fixed algo)."""
        return self.auto.choose(collective, nbytes, op) if self.algo == "auto" else self.algo

    async def calibrate(self, size_chunks: bool = True) -> None:
        """Measure the link for `auto` (a collective: every rank calls it); with `size_chunks`,
        choose the pipelining chunk from the measured bandwidth."""
        await self._calls.run(self.auto.calibrate())
        if size_chunks and self.auto.beta:
            # Every rank measured the same agreed beta, so every rank picks the same chunk size.
            chunk = int(CHUNK_LINK_TIME / self.auto.beta) >> 16 << 16
            self.chunk_bytes = min(max(chunk, CHUNK_RANGE[0]), CHUNK_RANGE[1])

    def _algorithm(self, algo):
        if algo is None:
            return self._default
        name = algo_name(algo)
        return self.auto if name == "auto" else self.algorithms[name]

    def abort(self, reason: str) -> None:
        """Give up on the group now: every peer's pending and later calls fail at once (with
        PeerAborted naming this rank and the reason), not after their timeouts."""
        self._calls.fail(NetworkError(reason))

    # ------------------------------------------------------------ collectives
    async def all_reduce(self, a: np.ndarray, op: str = "sum", codec: str | None = None, *,
                         algo: str | None = None, in_rank_order: bool = False) -> np.ndarray:
        """Reduce `a` across all ranks, in place; returns `a`. `codec` (f16, q80) compresses the
        payload of float arrays for sum/avg; every rank still ends bit-identical. in_rank_order:
        auto picks among the algorithms that sum each element in rank order whatever the size
        (auto.IN_RANK_ORDER), so that an element's result does not depend on what else `a` holds."""
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
            flat = L.flat(a)
            opx = get_op(op)
            check_op(opx, flat.dtype)
            cdc = _EXACT if codec is None else get_codec(codec, flat.dtype)
            if not cdc.exact and opx.name not in ("sum", "avg"):
                raise ValueError(f"codec {cdc.name!r} only serves sum and avg, not {opx.name!r}")
            if len(self._reducers) > 64:
                self._reducers.clear()
            red = self._reducers[(op, codec, a.dtype, a.size)] = Reducer(flat, opx, cdc, self._scratch)
        if self.size > 1 and flat.size:
            if algo is None and in_rank_order and self.algo == "auto":
                algo = self.auto.choose("all_reduce", red.wire_total(), red.op.name, in_rank_order=True)
            await self._calls.run(self._default.all_reduce(red) if algo is None else self._algorithm(algo).all_reduce(red))
        if red.op.finish is not None:
            red.op.finish(flat, self.size)
        return a

    async def reduce_scatter(self, a: np.ndarray, op: str = "sum", *, counts=None, out=None,
                             algo: str | None = None) -> np.ndarray:
        """Reduce `a` (flattened) across ranks and return this rank's block of the result
        (blocks: `counts`, default a near-equal split). `a` is left unchanged."""
        flat = L.flat(a, writable=False)
        opx = get_op(op)
        check_op(opx, flat.dtype)
        offs = split(flat.size, self.size) if counts is None else L.offsets(counts, self.size, "reduce_scatter")
        if offs[-1] != flat.size:
            raise ValueError(f"reduce_scatter: counts add up to {offs[-1]}, the array has {flat.size} values")
        work = flat.copy()
        if self.size > 1 and flat.size:
            red = Reducer(work, opx, _EXACT, self._scratch)
            await self._calls.run(self._algorithm(algo).reduce_scatter(red, offs))
        mine = work[offs[self.rank]:offs[self.rank + 1]]
        if opx.finish is not None:
            opx.finish(mine, self.size)
        return L.deliver(mine, out, "reduce_scatter")

    async def all_gather(self, a: np.ndarray, *, counts=None, algo: str | None = None) -> np.ndarray:
        """Every rank's `a`, on every rank: shape (p, *a.shape) (equal shapes), or with `counts`
        (values per rank) the 1-D concatenation."""
        flat = L.flat(a, writable=False)
        shape, offs = L.gathered(a, flat, counts, self.size, self.rank, "all_gather")
        out = np.empty(shape, dtype=a.dtype)
        out8 = out.reshape(-1).view(np.uint8)
        out8[offs[self.rank]:offs[self.rank + 1]] = flat.view(np.uint8)
        if self.size > 1 and offs[-1]:
            await self._calls.run(self._algorithm(algo).all_gather(out8, offs))
        return out

    async def broadcast(self, a: np.ndarray, root: int = 0, *, algo: str | None = None) -> np.ndarray:
        """Root's `a` into every rank's `a` (same shape and dtype everywhere), in place."""
        flat = L.flat(a)
        self._check_root(root)
        if self.size > 1 and flat.size:
            await self._calls.run(self._algorithm(algo).broadcast(flat.view(np.uint8), root))
        return a

    async def reduce(self, a: np.ndarray, op: str = "sum", root: int = 0, *,
                     algo: str | None = None) -> np.ndarray | None:
        """Reduce into root's `a` (in place); returns it on root and None elsewhere, where `a`
        is left unchanged."""
        flat = L.flat(a, writable=(self.rank == root))
        opx = get_op(op)
        check_op(opx, flat.dtype)
        self._check_root(root)
        work = flat if self.rank == root else flat.copy()
        if self.size > 1 and flat.size:
            red = Reducer(work, opx, _EXACT, self._scratch)
            await self._calls.run(self._algorithm(algo).reduce(red, root))
        if self.rank != root:
            return None
        if opx.finish is not None:
            opx.finish(work, self.size)
        return a

    async def gather(self, a: np.ndarray, root: int = 0, *, counts=None,
                     algo: str | None = None) -> np.ndarray | None:
        """Every rank's `a` on root: shape (p, *a.shape), or with `counts` the 1-D concatenation.
        Returns None on the other ranks."""
        flat = L.flat(a, writable=False)
        self._check_root(root)
        shape, offs = L.gathered(a, flat, counts, self.size, self.rank, "gather")
        own = flat.view(np.uint8)
        out = out8 = None
        if self.rank == root:
            out = np.empty(shape, dtype=a.dtype)
            out8 = out.reshape(-1).view(np.uint8)
            out8[offs[root]:offs[root + 1]] = own
        if self.size > 1 and offs[-1]:
            await self._calls.run(self._algorithm(algo).gather(out8, own, offs, root))
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
            flat = L.flat(a, writable=False)
            shapes, offs = L.scattered(a, flat, counts, self.size)
            src = flat.view(np.uint8)
            layout = (flat.dtype, shapes, offs)
            if self.size == 1:
                return L.deliver(src[:offs[1]].copy().view(flat.dtype).reshape(shapes[0]), out, "scatter")
        blocks = []

        async def body():
            if self.rank == root:
                dtype, shapes, offs = layout
                for r in range(self.size):
                    if r != root:
                        self._conns[r].write_frame(F.MESSAGE, L.block_header(dtype, shapes[r]), self._comm.tag)
                shape = shapes[root]
            else:
                _kind, _tag, header = await self._conns[root].post_recv(None, F.MESSAGE, self._comm.tag, 4096)
                dtype, shape = L.read_block_header(header, self._conns[root].peer, self._conns[root].max_frame * 64)
                offs = None
            block = np.empty(shape, dtype=dtype)
            await self._algorithm(algo).scatter(src, block.reshape(-1).view(np.uint8), offs, root)
            blocks.append(block)

        await self._calls.run(body())
        return L.deliver(blocks[0], out, "scatter")

    async def barrier(self, *, algo: str | None = None) -> None:
        """Returns once every rank has entered the barrier."""
        if self.size > 1:
            await self._calls.run(self._algorithm(algo).barrier())

    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root!r}")

    # ------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Close the sync connections (peers' pending calls raise PeerClosed) and the listener
        this group started, if any."""
        self._calls.closing = True
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
