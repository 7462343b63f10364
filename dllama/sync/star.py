"""Star (master-worker): every rank sends its partial to rank 0, which reduces and sends the
result back. Two steps; rank 0 carries (p-1)n bytes each way (its cost: docs/sync.md#algorithms).

Only all-reduce is its own; the other collectives are the base's linear ones (through a root).
"""

from __future__ import annotations

from .base import Algorithm, chunks
from .reducer import Reducer

ROOT = 0


class Star(Algorithm):
    name = "star"

    @staticmethod
    def encodings(p: int) -> int:
        return 2  # a worker's partial, then the root's result

    async def all_reduce(self, red: Reducer) -> None:
        c = self.comm
        pieces = list(chunks(0, red.n, c.chunk_values(red)))
        if c.rank != ROOT:
            for lo, hi in pieces:
                c.send(ROOT, red.send_partial(lo, hi))
            # The root answers chunk i only after it has all of our chunk i, so its result never
            # lands in a region we are still sending from.
            futs = [c.irecv(ROOT, red.final_buffer(lo, hi)) for lo, hi in pieces]
            for (lo, hi), f in zip(pieces, futs):
                await f
                red.final_received(lo, hi)
            return
        workers = range(1, c.size)
        futs = [[c.irecv(r, red.partial_buffer(lo, hi, r)) for lo, hi in pieces] for r in workers]
        for i, (lo, hi) in enumerate(pieces):
            for per_rank in futs:
                await per_rank[i]
            for r in workers:  # rank order: the result does not depend on arrival order
                red.accumulate(lo, hi, r)
            final = red.send_final(lo, hi)
            for r in workers:
                c.send(r, final)
