"""Helpers for the net/sync tests: exact-sum inputs, references, and the jobs that rank processes
run (ProcessCluster imports them as "tests.sync_helpers:<job>")."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from dllama.errors import NetworkError
from dllama.sync.procs import report


def exact_inputs(n: int, rank: int, dtype, salt: int = 0) -> np.ndarray:
    """Small integers (-8..8): sums and products of up to 8 of them are exact in every dtype and
    any order, so results are compared with zero tolerance."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 13 + salt * 5) % 17) - 8).astype(dtype)


def small_factors(n: int, rank: int, dtype) -> np.ndarray:
    """Values in {-2,-1,1,2}: products over 8 ranks stay exact (|x| <= 256)."""
    i = np.arange(n, dtype=np.int64)
    return np.array([-2, -1, 1, 2])[(i * 3 + rank * 5) % 4].astype(dtype)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_identical(arrays) -> None:
    first = bits(arrays[0])
    for r, a in enumerate(arrays[1:], 1):
        assert bits(a) == first, f"rank {r} differs from rank 0"


async def on_all(groups, fn):
    """Run fn(group, rank) on every rank concurrently; results in rank order."""
    return await asyncio.gather(*(fn(g, r) for r, g in enumerate(groups)))


# ---------------------------------------------------------------- jobs for rank processes
async def job_all_algorithms(group, n: int) -> dict:
    """Every collective with every algorithm on exact inputs, checked inside the rank; returns
    what must be identical on every rank (the all-reduced vector's head, per algorithm)."""
    from dllama.sync.base import split
    out = {}
    p, r = group.size, group.rank
    total = np.sum([exact_inputs(n, q, np.float64) for q in range(p)], axis=0)
    for algo in ("star", "ring", "mesh", "rd", "rabenseifner", "auto"):
        x = exact_inputs(n, r, np.float32)
        await group.all_reduce(x, algo=algo)
        assert np.array_equal(x, total), f"{algo}: all_reduce wrong"
        block = await group.reduce_scatter(exact_inputs(n, r, np.int64), algo=algo)
        offs = split(n, p)
        assert np.array_equal(block, total[offs[r]:offs[r + 1]]), f"{algo}: reduce_scatter wrong"
        g = await group.all_gather(exact_inputs(n, r, np.int32), algo=algo)
        assert np.array_equal(g, np.stack([exact_inputs(n, q, np.int32) for q in range(p)])), f"{algo}: all_gather"
        root = p - 1
        b = exact_inputs(n, 42, np.float64) if r == root else np.zeros(n)
        await group.broadcast(b, root=root, algo=algo)
        assert np.array_equal(b, exact_inputs(n, 42, np.float64)), f"{algo}: broadcast wrong"
        await group.barrier(algo=algo)
        out[algo] = x[:8].tolist()
    return out


async def job_loop(group, n: int, seconds: float) -> int:
    """All-reduce in a loop, reporting 'looping' after the first calls; errors are reported by
    the child wrapper (with the parent's receive time), so fault tests can time them."""
    x = np.ones(n, dtype=np.float32)
    calls = 0
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            x[:] = 1
            await group.all_reduce(x)
            calls += 1
            if calls == 20:
                report("looping")
    except NetworkError as e:
        report("failed", type=type(e).__name__, message=str(e))
        raise
    return calls


async def job_stats(group, n: int) -> dict:
    x = np.ones(n, dtype=np.float32)
    group.reset_stats()
    await group.barrier(algo="ring")  # bytes count on arrival: no all-reduce frame may predate the reset
    await group.all_reduce(x, algo="ring")
    s = group.stats
    return {"calls": s.calls - 1, "sent": s.bytes_sent, "recv": s.bytes_recv, "seconds": s.seconds,
            "value": float(x[0])}
