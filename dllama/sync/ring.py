"""Ring: reduce-scatter then all-gather around the ring r -> r+1, 2(p-1) steps, each rank sending
and receiving 2(p-1)/p * n bytes: bandwidth-optimal, so the choice for big messages.

Segments travel in chunks: a chunk is reduced as soon as it arrives and passed on at once, so
receiving, reducing and sending overlap. Receives are posted a step ahead into alternating
scratch slots, so chunks land in place instead of being queued.

Why sending from `a` without copies is safe: a region of `a` is overwritten (all-gather) only by
data that has travelled around the ring after our right neighbour received what we sent from
that region; so by then those bytes have left our send buffer.
"""

from __future__ import annotations

from .base import _EMPTY, Algorithm, chunks, split
from .reducer import Reducer


class Ring(Algorithm):
    name = "ring"

    @staticmethod
    def encodings(p: int) -> int:
        return p  # p-1 reduce-scatter hops, then the owner's result

    async def all_reduce(self, red: Reducer) -> None:
        p, r = self.comm.size, self.comm.rank
        offs = split(red.n, p, red.codec.granule)
        await self._reduce_scatter(red, offs, shift=0)  # leaves rank r owning segment r+1
        await self._all_gather_final(red, offs, own=(r + 1) % p)

    async def reduce_scatter(self, red: Reducer, offs: list[int]) -> None:
        await self._reduce_scatter(red, offs, shift=-1)  # leaves rank r owning block r

    async def _reduce_scatter(self, red: Reducer, offs, shift: int) -> None:
        c = self.comm
        p, r = c.size, c.rank
        left, right = (r - 1) % p, (r + 1) % p
        step = c.chunk_values(red)
        # At step k we send segment (r - k + shift) and receive segment (r - k - 1 + shift).
        # Each step receives a different segment, so all receives are posted up front.
        recv = []
        for k in range(p - 1):
            s = (r - k - 1 + shift) % p
            recv += [(k, lo, hi, c.irecv(left, red.partial_buffer(lo, hi))) for lo, hi in chunks(offs[s], offs[s + 1], step)]
        s = (r + shift) % p
        for lo, hi in chunks(offs[s], offs[s + 1], step):
            c.send(right, red.send_partial(lo, hi))
        for k, lo, hi, f in recv:
            await f
            red.accumulate(lo, hi)
            if k < p - 2:  # this chunk is what we send at step k+1: pass it on now
                c.send(right, red.send_partial(lo, hi))

    async def _all_gather_final(self, red: Reducer, offs, own: int) -> None:
        c = self.comm
        p, r = c.size, c.rank
        left, right = (r - 1) % p, (r + 1) % p
        step = c.chunk_values(red)
        # At step k we send segment (own - k) and receive segment (own - k - 1); each lands in
        # its own place, so every receive can be posted up front.
        recv = []
        for k in range(p - 1):
            s = (own - k - 1) % p
            for lo, hi in chunks(offs[s], offs[s + 1], step):
                recv.append((k, lo, hi, c.irecv(left, red.final_buffer(lo, hi))))
        for lo, hi in chunks(offs[own], offs[own + 1], step):
            c.send(right, red.send_final(lo, hi))
        for k, lo, hi, f in recv:
            await f
            red.final_received(lo, hi)
            if k < p - 2:
                c.send(right, red.forward_final(lo, hi))

    async def all_gather(self, out, offs):
        c = self.comm
        p, r = c.size, c.rank
        left, right = (r - 1) % p, (r + 1) % p
        step = c.chunk_bytes
        recv = []
        for k in range(p - 1):
            s = (r - k - 1) % p
            recv += [(k, lo, hi, c.irecv(left, out[lo:hi])) for lo, hi in chunks(offs[s], offs[s + 1], step)]
        for lo, hi in chunks(offs[r], offs[r + 1], step):
            c.send(right, out[lo:hi])
        for k, lo, hi, f in recv:
            await f
            if k < p - 2:
                c.send(right, out[lo:hi])

    async def broadcast(self, buf, root):
        """A pipelined chain root -> root+1 -> ... : n bytes per link, (p-1) hops of latency."""
        c = self.comm
        p, r = c.size, c.rank
        vr = (r - root) % p
        right = (r + 1) % p
        pieces = list(chunks(0, buf.size, c.chunk_bytes))
        if vr == 0:
            for lo, hi in pieces:
                c.send(right, buf[lo:hi])
            return
        left = (r - 1) % p
        futs = [c.irecv(left, buf[lo:hi]) for lo, hi in pieces]
        for (lo, hi), f in zip(pieces, futs):
            await f
            if vr < p - 1:
                c.send(right, buf[lo:hi])

    async def barrier(self):
        """A token twice around the ring: the first lap (back to rank 0) proves everyone arrived,
        the second (0 -> 1 -> ... -> p-1) releases them."""
        c = self.comm
        p, r = c.size, c.rank
        left, right = (r - 1) % p, (r + 1) % p
        arrived = c.irecv(left, _EMPTY)
        if r == 0:
            c.send(right, _EMPTY)
            await arrived
            c.send(right, _EMPTY)
            return
        released = c.irecv(left, _EMPTY)
        await arrived
        c.send(right, _EMPTY)
        await released
        if r != p - 1:
            c.send(right, _EMPTY)
