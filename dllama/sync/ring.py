"""Ring: reduce-scatter then all-gather around the ring r -> r+1, 2(p-1) steps (its cost:
docs/sync.md#algorithms).

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
        # at step k, send segment (r - k + shift), receive segment (r - k - 1 + shift), add it to ours
        await self._around(offs, (self.comm.rank + shift) % self.comm.size, self.comm.chunk_values(red),
                           red.partial_buffer, red.send_partial, red.accumulate, red.send_partial)

    async def _all_gather_final(self, red: Reducer, offs, own: int) -> None:
        await self._around(offs, own, self.comm.chunk_values(red), red.final_buffer, red.send_final,
                           red.final_received, red.forward_final)

    async def all_gather(self, out, offs):
        def region(lo, hi):
            return out[lo:hi]

        await self._around(offs, self.comm.rank, self.comm.chunk_bytes, region, region, None, region)

    async def _around(self, offs, first: int, step: int, recv_into, send_first, arrived, forward) -> None:
        """The ring's p-1 steps: at step k send segment (first - k) to the right and receive segment
        (first - k - 1) from the left, in chunks of `step`. Each step receives a different segment,
        each into its own place, so every receive is posted up front; a chunk that arrives is handled
        (`arrived`) and, if it is what the next step sends, passed on at once (`forward`)."""
        c = self.comm
        p, r = c.size, c.rank
        left, right = (r - 1) % p, (r + 1) % p
        recv = []
        for k in range(p - 1):
            s = (first - k - 1) % p
            recv += [(k, lo, hi, c.irecv(left, recv_into(lo, hi))) for lo, hi in chunks(offs[s], offs[s + 1], step)]
        for lo, hi in chunks(offs[first], offs[first + 1], step):
            c.send(right, send_first(lo, hi))
        for k, lo, hi, f in recv:
            await f
            if arrived is not None:
                arrived(lo, hi)
            if k < p - 2:
                c.send(right, forward(lo, hi))

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
