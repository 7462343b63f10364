"""Recursive doubling: log2(p) rounds; in round i rank v swaps its whole vector with v xor 2^i and
both combine (its cost: docs/sync.md#algorithms).
Both partners compute x (op) y from the same two vectors, and every op is commutative, so all
ranks end bit-identical. With a codec both partners encode before each swap and keep the
decoded value.

p not a power of two: fold-in (see base.fold): the even rank of each of the first `rem` pairs
hands its vector to its odd partner, sits out, and gets the exact result back at the end.

Also here: the recursive-doubling all-gather, binomial-tree broadcast and reduce, and the
dissemination barrier, which Rabenseifner shares.
"""

from __future__ import annotations

from .base import Algorithm, _EMPTY, chunks, contribute_and_wait, fold
from .reducer import Reducer


class RecursiveDoubling(Algorithm):
    name = "rd"

    @staticmethod
    def encodings(p: int) -> int:
        p2 = 1 << (p.bit_length() - 1)
        return p2.bit_length() - 1 + (p != p2)  # every round, plus the fold-in

    async def all_reduce(self, red: Reducer) -> None:
        c = self.comm
        r, n = c.rank, red.n
        p2, rem, newrank, realrank = fold(c.size)
        v = newrank(r)
        step = c.chunk_values(red)
        pieces = list(chunks(0, n, step))
        if v < 0:  # folded out: contribute, then receive the exact result
            await contribute_and_wait(c, red, pieces)
            return
        if r < 2 * rem:
            await self._fold_in(red, r - 1, pieces)
        mask = 1
        while mask < p2:
            partner = realrank(v ^ mask)
            futs = [c.irecv(partner, red.partial_buffer(lo, hi)) for lo, hi in pieces]
            for lo, hi in pieces:
                c.send(partner, red.requantize(lo, hi))
            await c.flush(partner)  # we are about to change what we just sent
            for (lo, hi), f in zip(pieces, futs):
                await f
                red.accumulate(lo, hi)
            mask <<= 1
        if r < 2 * rem:
            for lo, hi in pieces:
                c.send(r - 1, red.raw(lo, hi))

    async def _fold_in(self, red: Reducer, src: int, pieces) -> None:
        c = self.comm
        futs = [c.irecv(src, red.partial_buffer(lo, hi)) for lo, hi in pieces]
        for (lo, hi), f in zip(pieces, futs):
            await f
            red.accumulate(lo, hi)

    async def reduce_scatter(self, red: Reducer, offs) -> None:
        await self.all_reduce(red)  # small messages: the whole vector costs no more rounds

    async def all_gather(self, out, offs):
        c = self.comm
        r = c.rank
        p2, rem, newrank, realrank = fold(c.size)
        v = newrank(r)
        step = c.chunk_bytes

        def span(v0, v1):  # bytes of the blocks held by new ranks v0..v1-1
            first = 2 * v0 if v0 < rem else v0 + rem
            last = realrank(v1 - 1)
            return offs[first], offs[last + 1]

        def swap(peer, mine, theirs):
            futs = [c.irecv(peer, out[lo:hi]) for lo, hi in chunks(*theirs, step)]
            for lo, hi in chunks(*mine, step):
                c.send(peer, out[lo:hi])
            return futs

        if v < 0:
            for lo, hi in chunks(offs[r], offs[r + 1], step):
                c.send(r + 1, out[lo:hi])
            for f in [c.irecv(r + 1, out[lo:hi]) for lo, hi in chunks(0, offs[-1], step)]:
                await f
            return
        if r < 2 * rem:
            for f in [c.irecv(r - 1, out[lo:hi]) for lo, hi in chunks(offs[r - 1], offs[r], step)]:
                await f
        mask = 1
        while mask < p2:
            base = v & ~(mask - 1)
            pbase = (v ^ mask) & ~(mask - 1)
            for f in swap(realrank(v ^ mask), span(base, base + mask), span(pbase, pbase + mask)):
                await f
            mask <<= 1
        if r < 2 * rem:
            for lo, hi in chunks(0, offs[-1], step):
                c.send(r - 1, out[lo:hi])

    async def broadcast(self, buf, root):
        """Binomial tree: log2(p) hops."""
        c = self.comm
        p = c.size
        vr = (c.rank - root) % p
        pieces = list(chunks(0, buf.size, c.chunk_bytes))
        mask = 1
        while mask < p:
            if vr & mask:
                src = (vr - mask + root) % p
                for f in [c.irecv(src, buf[lo:hi]) for lo, hi in pieces]:
                    await f
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if vr + mask < p:
                dst = (vr + mask + root) % p
                for lo, hi in pieces:
                    c.send(dst, buf[lo:hi])
            mask >>= 1

    async def reduce(self, red: Reducer, root):
        """Binomial tree towards root (the group gives non-roots a scratch copy to reduce in)."""
        c = self.comm
        p = c.size
        vr = (c.rank - root) % p
        pieces = list(chunks(0, red.n, c.chunk_values(red)))
        mask = 1
        while mask < p:
            if vr & mask == 0:
                if vr | mask < p:
                    src = ((vr | mask) + root) % p
                    await self._fold_in(red, src, pieces)
            else:
                dst = ((vr & ~mask) + root) % p
                for lo, hi in pieces:
                    c.send(dst, red.send_partial(lo, hi))
                break
            mask <<= 1

    async def barrier(self):
        """Dissemination: in round i, signal rank + 2^i and wait for rank - 2^i."""
        c = self.comm
        p, r = c.size, c.rank
        dist = 1
        while dist < p:
            fut = c.irecv((r - dist) % p, _EMPTY)
            c.send((r + dist) % p, _EMPTY)
            await fut
            dist <<= 1
