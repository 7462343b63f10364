"""Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling
(its cost: docs/sync.md#algorithms).

Recursive halving: in round i (distance p2/2, p2/4, ... 1) each rank keeps half of the range it
is responsible for, sends the other half to its partner and adds the partner's copy of the
kept half. Each value ends reduced on exactly one rank (its owner), which (with a codec)
encodes it once; the all-gather relays those bytes unchanged.

p not a power of two: fold-in as in recursive doubling; the folded-out ranks get the exact
result (all-reduce) or their block (reduce-scatter) from their partner.
"""

from __future__ import annotations

from .base import chunks, contribute_and_wait, fold, split
from .recursive_doubling import RecursiveDoubling
from .reducer import Reducer


class Rabenseifner(RecursiveDoubling):
    name = "rabenseifner"

    @staticmethod
    def encodings(p: int) -> int:
        p2 = 1 << (p.bit_length() - 1)
        return p2.bit_length() - 1 + 1 + (p != p2)  # halving rounds, the owner's result, fold-in

    async def all_reduce(self, red: Reducer) -> None:
        c = self.comm
        r, n = c.rank, red.n
        p2, rem, newrank, realrank = fold(c.size)
        v = newrank(r)
        step = c.chunk_values(red)
        if v < 0:
            await contribute_and_wait(c, red, list(chunks(0, n, step)))
            return
        if r < 2 * rem:
            await self._fold_in(red, r - 1, list(chunks(0, n, step)))
        segs = split(n, p2, red.codec.granule)  # segment v ends up owned by new rank v
        await self._halve(red, segs, v, realrank, p2)
        await self._double(red, segs, v, realrank, p2)
        if r < 2 * rem:
            for lo, hi in chunks(0, n, step):
                c.send(r - 1, red.raw(lo, hi))

    async def _halve(self, red: Reducer, segs, v, realrank, p2) -> None:
        c = self.comm
        step = c.chunk_values(red)
        lo_v, hi_v = 0, p2
        mask = p2 >> 1
        while mask:
            partner = realrank(v ^ mask)
            mid = (lo_v + hi_v) // 2
            keep, give = ((mid, hi_v), (lo_v, mid)) if v & mask else ((lo_v, mid), (mid, hi_v))
            mine = list(chunks(segs[keep[0]], segs[keep[1]], step))
            futs = [c.irecv(partner, red.partial_buffer(lo, hi)) for lo, hi in mine]
            for lo, hi in chunks(segs[give[0]], segs[give[1]], step):
                c.send(partner, red.send_partial(lo, hi))
            for (lo, hi), f in zip(mine, futs):
                await f
                red.accumulate(lo, hi)
            lo_v, hi_v = keep
            mask >>= 1

    async def _double(self, red: Reducer, segs, v, realrank, p2) -> None:
        c = self.comm
        step = c.chunk_values(red)
        own = list(chunks(segs[v], segs[v + 1], step))
        mask = 1
        while mask < p2:
            partner = realrank(v ^ mask)
            base, pbase = v & ~(mask - 1), (v ^ mask) & ~(mask - 1)
            theirs = list(chunks(segs[pbase], segs[pbase + mask], step))
            futs = [c.irecv(partner, red.final_buffer(lo, hi)) for lo, hi in theirs]
            if mask == 1:  # our own segment: the owner encodes it, once
                for lo, hi in own:
                    c.send(partner, red.send_final(lo, hi))
            else:
                for lo, hi in chunks(segs[base], segs[base + mask], step):
                    c.send(partner, red.forward_final(lo, hi))
            for (lo, hi), f in zip(theirs, futs):
                await f
                red.final_received(lo, hi)
            mask <<= 1

    async def reduce_scatter(self, red: Reducer, offs) -> None:
        c = self.comm
        r, n = c.rank, red.n
        p2, rem, newrank, realrank = fold(c.size)
        v = newrank(r)
        step = c.chunk_values(red)
        if v < 0:
            for lo, hi in chunks(0, n, step):
                c.send(r + 1, red.send_partial(lo, hi))
            for f in [c.irecv(r + 1, red.raw(lo, hi)) for lo, hi in chunks(offs[r], offs[r + 1], step)]:
                await f
            return
        if r < 2 * rem:
            await self._fold_in(red, r - 1, list(chunks(0, n, step)))
        # New rank w is responsible for the blocks of the real ranks it stands for.
        segs = [offs[2 * w if w < rem else w + rem] for w in range(p2)] + [n]
        await self._halve(red, segs, v, realrank, p2)
        if r < 2 * rem:
            for lo, hi in chunks(offs[r - 1], offs[r], step):
                c.send(r - 1, red.raw(lo, hi))

    async def reduce(self, red: Reducer, root):
        """Reduce-scatter, then gather the reduced blocks at root."""
        c = self.comm
        offs = split(red.n, c.size, 1)
        await self.reduce_scatter(red, offs)
        b = [o * red.isz for o in offs]
        await self.gather(red.a8, red.a8[b[c.rank]:b[c.rank + 1]], b, root)

    async def broadcast(self, buf, root):
        """Scatter from root, then all-gather (van de Geijn): ~2n bytes per rank instead of n log p."""
        c = self.comm
        offs = split(buf.size, c.size, 1)
        own = buf[offs[c.rank]:offs[c.rank + 1]]
        await self.scatter(buf if c.rank == root else None, own, offs, root)
        await self.all_gather(buf, offs)

