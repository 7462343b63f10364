"""Auto: measure the network once, then pick the algorithm per call with the alpha-beta model.

At group setup every rank ping-pongs with its ring neighbour (small frames: latency alpha;
256 KiB frames: seconds per byte beta) and times a local add (gamma, seconds per reduced byte);
the ranks then agree on the worst of each (an all-reduce max), so every rank computes the same
costs and makes the same choice. The model's formulas are `_COST` below (the all-reduce's, in a
table with what each algorithm is the choice for: docs/sync.md#algorithms). `decisions` records
every choice made.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .base import Algorithm, Comm
from .codecs import CODECS
from .ops import OPS
from .reducer import Reducer

CANDIDATES = {
    "all_reduce": ("mesh", "rd", "star", "ring", "rabenseifner"),
    "reduce_scatter": ("mesh", "rd", "star", "ring", "rabenseifner"),
    "all_gather": ("mesh", "rd", "star", "ring"),
    "broadcast": ("star", "rd", "ring", "rabenseifner"),
    "reduce": ("star", "rd", "rabenseifner"),
}
# algorithms that sum each element over the ranks in rank order whatever the message's size: a
# reduction through them gives a token's values the same bits in a step of any size (ring, recursive
# doubling and Rabenseifner start each block's sum at a rank that depends on where the block falls)
IN_RANK_ORDER = ("mesh", "star")
SLOW_OPS = {"maxloc": 8.0, "minloc": 8.0}  # numpy `where` merges cost more per byte than ufuncs


def _fold(p):
    p2 = 1 << (p.bit_length() - 1)
    return p2, math.log2(p2), (1.0 if p != p2 else 0.0)


def _all_reduce(algo, n, p, a, b, g):
    p2, L, f = _fold(p)
    fold = f * (2 * a + 2 * n * b + n * g)
    return {
        "star": 2 * a + 2 * (p - 1) * n * b + (p - 1) * n * g,
        "mesh": a + (p - 1) * n * b + (p - 1) * n * g,
        "ring": 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g,
        "rd": L * (a + n * b + n * g) + fold,
        "rabenseifner": 2 * L * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + fold,
    }[algo]


def _reduce_scatter(algo, n, p, a, b, g):
    p2, L, f = _fold(p)
    return {
        "star": 2 * a + (p - 1) * n * b + (p - 1) * n * g + (p - 1) / p * n * b,
        "mesh": a + (p - 1) / p * n * (b + g),
        "ring": (p - 1) * a + (p - 1) / p * n * (b + g),
        "rd": _all_reduce("rd", n, p, a, b, g),
        "rabenseifner": L * a + (p2 - 1) / p2 * n * (b + g) + f * (2 * a + n * (b + g)),
    }[algo]


def _all_gather(algo, n, p, a, b, g):
    p2, L, f = _fold(p)
    return {
        "star": 2 * a + (p - 1) / p * n * b + (p - 1) * n * b,
        "mesh": a + (p - 1) / p * n * b,
        "ring": (p - 1) * a + (p - 1) / p * n * b,
        "rd": L * a + (p - 1) / p * n * b + f * (2 * a + n * b),
    }[algo]


def _broadcast(algo, n, p, a, b, g):
    p2, L, f = _fold(p)
    return {
        "star": a + (p - 1) * n * b,
        "ring": (p - 1) * a + n * b,
        "rd": math.ceil(math.log2(p)) * (a + n * b),
        "rabenseifner": a + (p - 1) / p * n * b + _all_gather("rd", n, p, a, b, g),
    }[algo]


def _reduce(algo, n, p, a, b, g):
    return {
        "star": a + (p - 1) * n * (b + g),
        "rd": math.ceil(math.log2(p)) * (a + n * (b + g)),
        "rabenseifner": _reduce_scatter("rabenseifner", n, p, a, b, g) + a + (p - 1) / p * n * b,
    }[algo]


_COST = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
         "broadcast": _broadcast, "reduce": _reduce}


# An algorithm with no version of its own of a collective runs another's: Rabenseifner's all-gather is
# recursive doubling's (its base class), mesh's and ring's broadcast/reduce the linear (star) ones of base.py
_RUNS_AS = {("all_gather", "rabenseifner"): "rd", ("broadcast", "mesh"): "star", ("reduce", "mesh"): "star",
            ("reduce", "ring"): "star"}


def candidates(collective: str, in_rank_order: bool = False) -> tuple[str, ...]:
    """The algorithms auto weighs for a collective (in_rank_order: those of IN_RANK_ORDER only)."""
    return tuple(name for name in CANDIDATES[collective] if not in_rank_order or name in IN_RANK_ORDER)


def predicted_seconds(collective: str, algo: str, nbytes: float, p: int, alpha: float, beta: float,
                      gamma: float, in_rank_order: bool = False) -> float:
    """The model's time for one collective of nbytes on p ranks with `algo` ("auto": the cheapest
    candidate, as Auto would take; in_rank_order: among IN_RANK_ORDER)."""
    if p == 1:
        return 0.0
    if algo == "auto":
        return min(_COST[collective](name, nbytes, p, alpha, beta, gamma)
                   for name in candidates(collective, in_rank_order))
    return _COST[collective](_RUNS_AS.get((collective, algo), algo), nbytes, p, alpha, beta, gamma)


class Auto(Algorithm):
    """Delegates each collective to the algorithm the cost model picks for it."""

    name = "auto"

    def __init__(self, comm: Comm, algorithms: dict[str, Algorithm]):
        super().__init__(comm)
        self.algorithms = algorithms
        self.alpha: float | None = None  # s per message
        self.beta: float | None = None  # s per byte on the wire
        self.gamma: float | None = None  # s per byte reduced
        self.decisions: dict[tuple, str] = {}

    # ------------------------------------------------------------ measurement
    async def calibrate(self, small_iters: int = 10, large_iters: int = 3, large_bytes: int = 256 << 10) -> None:
        """Run at group setup (all ranks together). Ends with every rank holding the same a/b/g."""
        c = self.comm
        p, r = c.size, c.rank
        if p == 1:
            self.alpha, self.beta, self.gamma = 0.0, 0.0, self.time_reduce()
            return
        left, right = (r - 1) % p, (r + 1) % p
        small_rtt = min(await self._pingpong(left, right, 8, small_iters))
        large_rtt = min(await self._pingpong(left, right, large_bytes, large_iters))
        alpha = small_rtt / 2
        beta = max((large_rtt / 2 - alpha) / large_bytes, 1e-12)
        agreed = np.array([alpha, beta, self.time_reduce()], dtype=np.float64)
        await self.algorithms["mesh"].all_reduce(Reducer(agreed, OPS["max"], CODECS["exact"], c.scratch))
        self.alpha, self.beta, self.gamma = (float(x) for x in agreed)
        self.decisions.clear()

    async def _pingpong(self, left: int, right: int, nbytes: int, iters: int) -> list[float]:
        """Each rank pings its right neighbour and echoes its left one's pings."""
        c = self.comm
        ping = np.zeros(nbytes, dtype=np.uint8)
        theirs = np.empty(nbytes, dtype=np.uint8)
        echo = np.empty(nbytes, dtype=np.uint8)
        rtts = []
        for _ in range(iters):
            got_ping = c.irecv(left, theirs)
            got_echo = c.irecv(right, echo)
            t0 = time.perf_counter()
            c.send(right, ping)
            await got_ping
            c.send(left, theirs)
            await got_echo
            rtts.append(time.perf_counter() - t0)
            await c.flush_all()
        return rtts

    @staticmethod
    def time_reduce(n: int = 1 << 16) -> float:
        """Seconds per byte of a local float32 add (gamma)."""
        x = np.ones(n, dtype=np.float32)
        y = np.ones(n, dtype=np.float32)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            np.add(x, y, out=x)
            best = min(best, time.perf_counter() - t0)
        return best / x.nbytes

    # ------------------------------------------------------------ the model
    def costs(self, collective: str, nbytes: int, op: str | None = None,
              in_rank_order: bool = False) -> dict[str, float]:
        """Predicted seconds of each candidate algorithm (in_rank_order: of IN_RANK_ORDER's only)."""
        if self.alpha is None:
            raise RuntimeError("auto: not calibrated (the group measures alpha/beta at setup)")
        g = self.gamma * SLOW_OPS.get(op, 1.0)
        p = self.comm.size
        return {name: _COST[collective](name, nbytes, p, self.alpha, self.beta, g)
                for name in candidates(collective, in_rank_order)}

    def choose(self, collective: str, nbytes: int, op: str | None = None, in_rank_order: bool = False) -> str:
        key = (collective, nbytes, op, in_rank_order)
        name = self.decisions.get(key)
        if name is None:
            if collective not in CANDIDATES or self.comm.size == 1:
                name = "rd" if collective == "barrier" else "star"
            else:
                costs = self.costs(collective, nbytes, op, in_rank_order)
                name = min(costs, key=costs.get)
            if len(self.decisions) > 4096:
                self.decisions.clear()
            self.decisions[key] = name
        return name

    def describe(self) -> dict:
        return {"alpha_s": self.alpha, "beta_s_per_byte": self.beta, "gamma_s_per_byte": self.gamma,
                "bandwidth_bytes_per_s": (1.0 / self.beta) if self.beta else None,
                "decisions": {f"{k[0]}:{k[1]}B:{k[2] or '-'}{':in-rank-order' if k[3] else ''}": v
                              for k, v in self.decisions.items()}}

    # ------------------------------------------------------------ delegation
    def _pick(self, collective, nbytes, op=None) -> Algorithm:
        return self.algorithms[self.choose(collective, nbytes, op)]

    async def all_reduce(self, red):
        await self._pick("all_reduce", red.wire_total(), red.op.name).all_reduce(red)

    async def reduce_scatter(self, red, offs):
        await self._pick("reduce_scatter", red.wire_total(), red.op.name).reduce_scatter(red, offs)

    async def all_gather(self, out, offs):
        await self._pick("all_gather", out.size).all_gather(out, offs)

    async def broadcast(self, buf, root):
        await self._pick("broadcast", buf.size).broadcast(buf, root)

    async def reduce(self, red, root):
        await self._pick("reduce", red.wire_total(), red.op.name).reduce(red, root)

    async def gather(self, out, own, offs, root):
        await self.algorithms["star"].gather(out, own, offs, root)

    async def scatter(self, src, out, offs, root):
        await self.algorithms["star"].scatter(src, out, offs, root)

    async def barrier(self):
        await self.algorithms["rd"].barrier()
