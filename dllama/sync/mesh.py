"""Mesh: every rank sends its whole partial to every other rank and each sums all p partials
itself, in rank order, so the results are bit-identical. One step, distributed-llama's scheme
(its cost: docs/sync.md#algorithms).

With a codec each rank encodes its partial once and sums the decoded values, its own included.
"""

from __future__ import annotations

from .base import Algorithm, _EMPTY, chunks
from .reducer import Reducer


class Mesh(Algorithm):
    name = "mesh"

    @staticmethod
    def encodings(p: int) -> int:
        return 1  # each partial once; everyone sums the same decoded partials

    async def all_reduce(self, red: Reducer) -> None:
        c = self.comm
        p, me = c.size, c.rank
        order = list(range(p))
        n = red.n
        plan = red.plans.get(("mesh", c.chunk_bytes))
        if plan is None:
            small = n <= c.chunk_values(red)
            direct = red.exact and red.op.ufunc is not None
            recvs = [(r, red.partial_buffer(0, n, r)) for r in range(p) if r != me] if small else None
            others = [None if r == me else red.slot_values(r, 0, n) for r in range(p)] if direct else None
            plan = red.plans[("mesh", c.chunk_bytes)] = (small, direct, recvs, others)
        small, direct, recvs, others = plan
        if small:  # the common case: one frame per peer
            futs = [c.irecv(r, view) for r, view in recvs]
            own = red.a8 if direct else red.stage_own(0, n, me)
            for r, _ in recvs:
                c.send(r, own)
            for f in futs:
                await f
            if direct:
                for conn in c.conns:  # `a` itself was sent: it must be out before we change it
                    if conn is not None and not conn.flushed:
                        await conn.flush()
                red.combine_own(0, n, me, p, others)
            else:
                red.combine(0, n, order)
            return
        pieces = list(chunks(0, red.n, c.chunk_values(red)))
        futs = {r: [c.irecv(r, red.partial_buffer(lo, hi, r)) for lo, hi in pieces] for r in range(p) if r != me}
        for lo, hi in pieces:
            own = red.stage_own(lo, hi, me)  # we send the staged copy, so `a` may change meanwhile
            for r in futs:
                c.send(r, own)
        for i, (lo, hi) in enumerate(pieces):
            for r in futs:
                await futs[r][i]
            red.combine(lo, hi, order)

    async def reduce_scatter(self, red: Reducer, offs: list[int]) -> None:
        c = self.comm
        p, me = c.size, c.rank
        step = c.chunk_values(red)
        mine = list(chunks(offs[me], offs[me + 1], step))
        futs = {r: [c.irecv(r, red.partial_buffer(lo, hi, r)) for lo, hi in mine] for r in range(p) if r != me}
        for r in futs:
            for lo, hi in chunks(offs[r], offs[r + 1], step):
                c.send(r, red.send_partial(lo, hi))
        order = list(range(p))
        for i, (lo, hi) in enumerate(mine):
            for r in futs:
                await futs[r][i]
            red.stage_own(lo, hi, me)
            red.combine(lo, hi, order)

    async def all_gather(self, out, offs):
        c = self.comm
        p, me = c.size, c.rank
        step = c.chunk_bytes
        futs = [c.irecv(r, out[lo:hi]) for r in range(p) if r != me for lo, hi in chunks(offs[r], offs[r + 1], step)]
        for lo, hi in chunks(offs[me], offs[me + 1], step):
            for r in range(p):
                if r != me:
                    c.send(r, out[lo:hi])
        for f in futs:
            await f

    async def barrier(self):
        c = self.comm
        futs = [c.irecv(r, _EMPTY) for r in range(c.size) if r != c.rank]
        for r in range(c.size):
            if r != c.rank:
                c.send(r, _EMPTY)
        for f in futs:
            await f
