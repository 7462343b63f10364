"""What every algorithm shares: the communicator it talks through, array partitioning, and the
plain linear (root-centred) collectives an algorithm uses unless it has a better one.

An algorithm implements the collectives on flat byte/element ranges that the group has already
validated and laid out:

    all_reduce(red)                     red.a reduced in place on every rank
    reduce_scatter(red, offs)           red.a[offs[r]:offs[r+1]] reduced on rank r
    all_gather(out, offs)               out (bytes): block r at offs[r]:offs[r+1], own block in place
    broadcast(buf, root)                buf (bytes) in place
    reduce(red, root)                   red.a reduced on root (other ranks: a scratch copy)
    gather(out, own, offs, root)        root's out receives every block
    scatter(src, out, offs, root)       root's src blocks to every rank's out
    barrier()
"""

from __future__ import annotations

import numpy as np

from ..net import frames as F
from .reducer import Reducer, Scratch

ARRAY = F.ARRAY


def split(n: int, parts: int, granule: int = 1) -> list[int]:
    """Offsets (parts + 1) of `parts` near-equal ranges of n values, cut at multiples of granule.
    The first ranges get the extra units; a trailing partial granule goes to its range."""
    units = -(-n // granule)
    base, extra = divmod(units, parts)
    offs = [0]
    for i in range(parts):
        offs.append(min(n, offs[-1] + (base + (i < extra)) * granule))
    return offs


def chunks(lo: int, hi: int, step: int):
    """[lo, hi) cut into pieces of `step` values (step is a multiple of the codec granule)."""
    while lo < hi:
        yield lo, min(hi, lo + step)
        lo += step


class _Pending:
    """A posted receive; awaiting it first busy-polls the peer for up to `Comm.spin` seconds."""

    __slots__ = ("fut", "conn", "comm")

    def __init__(self, fut, conn, comm):
        self.fut = fut
        self.conn = conn
        self.comm = comm

    def __await__(self):
        if self.comm.spin and not self.fut.done():
            self.comm._spin(self.conn, self.fut)
        return self.fut.__await__()


class Comm:
    """Point-to-point messaging for one group; every frame carries the current call's tag so
    ranks that disagree on which collective they run fail loudly instead of mixing data."""

    def __init__(self, rank: int, size: int, conns: list, scratch: Scratch, chunk_bytes: int):
        self.rank = rank
        self.size = size
        self.conns = conns  # conns[r]: Connection to rank r (None for self)
        self.scratch = scratch
        self.chunk_bytes = chunk_bytes
        self.spin = 0.0  # seconds to busy-poll for a frame before sleeping in the event loop
        self.tag = 0

    def send(self, peer: int, payload) -> None:
        self.conns[peer].write_array(payload, self.tag)

    def irecv(self, peer: int, into) -> "_Pending":
        conn = self.conns[peer]
        return _Pending(conn.post_recv(into, ARRAY, self.tag), conn, self)

    async def recv(self, peer: int, into):
        return await self.irecv(peer, into)

    def _spin(self, conn, fut) -> None:
        # Only while nothing of ours waits in a send buffer: the loop must run to flush it.
        for c in self.conns:
            if c is not None and not c.flushed:
                return
        conn.spin_until(fut, self.spin)

    async def flush(self, peer: int) -> None:
        c = self.conns[peer]
        if not c.flushed:
            await c.flush()

    async def flush_all(self) -> None:
        for c in self.conns:
            if c is not None and not c.flushed:
                await c.flush()

    def chunk_values(self, red: Reducer | None = None, itemsize: int = 1) -> int:
        """Values per pipelined chunk: about chunk_bytes on the wire, a multiple of the granule."""
        if red is not None:
            per_value = red.codec.wire_nbytes(1024, red.isz) / 1024
            granule = red.codec.granule
        else:
            per_value, granule = itemsize, 1
        n = max(int(self.chunk_bytes / per_value) // granule * granule, granule)
        return n


class Algorithm:
    """Base: linear collectives through a root. Subclasses override what they do better."""

    name = "linear"

    @staticmethod
    def encodings(p: int) -> int:
        """How many times an all-reduce with a lossy codec may encode one value on its way to
        the result (each adds at most Codec.error_bound)."""
        return 1

    def __init__(self, comm: Comm):
        self.comm = comm

    # ---------------------------------------------------------------- all-reduce family
    async def all_reduce(self, red: Reducer) -> None:
        raise NotImplementedError

    async def reduce_scatter(self, red: Reducer, offs: list[int]) -> None:
        """Default: reduce to rank 0, then scatter the blocks."""
        c = self.comm
        await self.reduce(red, 0)
        await self.scatter(red.a8 if c.rank == 0 else None, red.raw(offs[c.rank], offs[c.rank + 1]),
                           [o * red.isz for o in offs], 0)

    async def reduce(self, red: Reducer, root: int) -> None:
        """Linear: every rank sends its values to root, which combines them in rank order."""
        c = self.comm
        if c.rank != root:
            for lo, hi in chunks(0, red.n, c.chunk_values(red)):
                c.send(root, red.send_partial(lo, hi))
            await c.flush(root)
            return
        peers = [r for r in range(c.size) if r != root]
        step = c.chunk_values(red)
        pieces = list(chunks(0, red.n, step))
        futs = {(r, lo): c.irecv(r, red.partial_buffer(lo, hi, r)) for r in peers for lo, hi in pieces}
        # Combine in rank order (x0 op x1 op ...) so the result does not depend on arrival order.
        for lo, hi in pieces:
            for r in peers:
                await futs[(r, lo)]
            red.stage_own(lo, hi, root)
            red.combine(lo, hi, list(range(c.size)))

    # ---------------------------------------------------------------- data movement
    async def broadcast(self, buf: np.ndarray, root: int) -> None:
        c = self.comm
        step = c.chunk_bytes
        if c.rank == root:
            for lo, hi in chunks(0, buf.size, step):
                for r in range(c.size):
                    if r != root:
                        c.send(r, buf[lo:hi])
            await c.flush_all()
        else:
            futs = [c.irecv(root, buf[lo:hi]) for lo, hi in chunks(0, buf.size, step)]
            for f in futs:
                await f

    async def gather(self, out, own: np.ndarray, offs: list[int], root: int) -> None:
        c = self.comm
        if c.rank != root:
            for lo, hi in chunks(0, own.size, c.chunk_bytes):
                c.send(root, own[lo:hi])
            await c.flush(root)
            return
        futs = []
        for r in range(c.size):
            if r != root:
                futs += [c.irecv(r, out[lo:hi]) for lo, hi in chunks(offs[r], offs[r + 1], c.chunk_bytes)]
        for f in futs:
            await f

    async def scatter(self, src, out: np.ndarray, offs: list[int], root: int) -> None:
        c = self.comm
        if c.rank == root:
            for r in range(c.size):
                if r != root:
                    for lo, hi in chunks(offs[r], offs[r + 1], c.chunk_bytes):
                        c.send(r, src[lo:hi])
            out[:] = src[offs[root]:offs[root + 1]]
            await c.flush_all()
        else:
            futs = [c.irecv(root, out[lo:hi]) for lo, hi in chunks(0, out.size, c.chunk_bytes)]
            for f in futs:
                await f

    async def all_gather(self, out: np.ndarray, offs: list[int]) -> None:
        """Default: gather to rank 0, then broadcast."""
        c = self.comm
        await self.gather(out, out[offs[c.rank]:offs[c.rank + 1]], offs, 0)
        await self.broadcast(out, 0)

    async def barrier(self) -> None:
        """Everyone reports to rank 0, rank 0 releases everyone."""
        c = self.comm
        empty = _EMPTY
        if c.rank == 0:
            futs = [c.irecv(r, empty) for r in range(1, c.size)]
            for f in futs:
                await f
            for r in range(1, c.size):
                c.send(r, empty)
        else:
            fut = c.irecv(0, empty)
            c.send(0, empty)
            await fut


_EMPTY = np.empty(0, dtype=np.uint8)


# ---------------------------------------------------------------- power-of-two folding
def fold(p: int):
    """Non-power-of-two p by fold-in (MPICH): with p2 = largest power of two <= p and
    rem = p - p2, ranks 0..2rem-1 pair up; the even one hands its data to the odd one and sits
    out. Returns (p2, rem, newrank(r), realrank(v))."""
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2

    def newrank(r):
        if r < 2 * rem:
            return -1 if r % 2 == 0 else r // 2
        return r - rem

    def realrank(v):
        return 2 * v + 1 if v < rem else v + rem

    return p2, rem, newrank, realrank


async def contribute_and_wait(c: Comm, red, pieces) -> None:
    """What a rank folded out of a power-of-two schedule does (recursive doubling, Rabenseifner):
    hand its partial to rank r+1, then receive the exact result from it. r+1 sends the result
    only once it has all of our partial, so it may land in our own buffer."""
    r = c.rank
    for lo, hi in pieces:
        c.send(r + 1, red.send_partial(lo, hi))
    futs = [c.irecv(r + 1, red.raw(lo, hi)) for lo, hi in pieces]
    for f in futs:
        await f
