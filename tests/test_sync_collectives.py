"""Every collective x every algorithm x p = 1..8 x awkward lengths x ops, nccl-tests style:
inputs whose reductions are exact in any order, compared with zero tolerance, and every rank's
result bit-identical. Each (algo, p) runs its whole matrix in one loopback cluster."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.sync import ALGORITHMS, loc_array, local_cluster
from dllama.sync.bench import codec_bound

from .sync_helpers import assert_identical, exact_inputs, on_all, small_factors

ALGOS = ["star", "ring", "mesh", "rd", "rabenseifner", "auto"]
PS = range(1, 9)

F32, F16, F64, I32, I64 = np.float32, np.float16, np.float64, np.int32, np.int64
OP_DTYPES = {
    "sum": (F32, F16, F64, I32, I64),
    "prod": (F32, I64),
    "min": (F32, I32),
    "max": (F64, I64),
    "avg": (F32, F64),
    "land": (I32, F32),
    "lor": (I64,),
    "band": (I32,),
    "bor": (I64,),
    "bxor": (I32, I64),
}


def lengths(p):
    return sorted({0, 1, max(p - 1, 0), p + 1, 33, 257})


def inputs(op, n, r, dtype):
    return small_factors(n, r, dtype) if op == "prod" else exact_inputs(n, r, dtype)


def reference(op, n, p, dtype):
    xs = np.stack([inputs(op, n, q, dtype).astype(np.int64) for q in range(p)]) if n else np.zeros((p, 0), np.int64)
    if op in ("sum", "avg"):
        out = xs.sum(axis=0).astype(dtype)
        return np.divide(out, dtype(p)).astype(dtype) if op == "avg" and p > 1 else out
    if op == "prod":
        return xs.prod(axis=0).astype(dtype)
    if op == "min":
        return xs.min(axis=0).astype(dtype)
    if op == "max":
        return xs.max(axis=0).astype(dtype)
    if op == "land":
        return (xs != 0).all(axis=0).astype(dtype)
    if op == "lor":
        return (xs != 0).any(axis=0).astype(dtype)
    ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return ufunc.reduce(xs, axis=0).astype(dtype)


async def check_all_reduce(groups, n):
    p = len(groups)
    for op, dtypes in OP_DTYPES.items():
        for dtype in dtypes:
            outs = await on_all(groups, lambda g, r: g.all_reduce(inputs(op, n, r, dtype), op))
            expect = reference(op, n, p, dtype)
            for r, out in enumerate(outs):
                assert out.dtype == dtype and np.array_equal(out, expect), f"{op} {np.dtype(dtype)} n={n} rank {r}"
            assert_identical(outs)
    # maxloc / minloc: ties everywhere (values repeat across ranks), resolved to the lowest rank
    vals = [exact_inputs(n, r, F32) for r in range(p)]
    for op, pick in (("maxloc", np.argmax), ("minloc", np.argmin)):
        outs = await on_all(groups, lambda g, r: g.all_reduce(loc_array(vals[r], r), op))
        stack = np.stack(vals) if n else np.zeros((p, 0), F32)
        expect_idx = pick(stack, axis=0) if n else np.zeros(0, np.int64)
        for out in outs:
            assert np.array_equal(out["index"], expect_idx), op
            assert np.array_equal(out["value"], stack[expect_idx, np.arange(n)]), op
        assert_identical(outs)


async def check_reduce_scatter(groups, n, algo):
    p = len(groups)
    expect = reference("sum", n, p, I64)
    outs = await on_all(groups, lambda g, r: g.reduce_scatter(exact_inputs(n, r, I64)))
    assert np.array_equal(np.concatenate(outs), expect)
    counts = [0] * p
    for i in range(n):  # ragged: everything on the last ranks, some ranks get nothing
        counts[p - 1 - (i % max(p // 2, 1))] += 1
    offs = np.concatenate([[0], np.cumsum(counts)])
    outs = await on_all(groups, lambda g, r: g.reduce_scatter(exact_inputs(n, r, F64), "max", counts=counts))
    mx = reference("max", n, p, F64)
    for r, out in enumerate(outs):
        assert np.array_equal(out, mx[offs[r]:offs[r + 1]]), f"ragged reduce_scatter rank {r}"


async def check_all_gather(groups, n):
    p = len(groups)
    outs = await on_all(groups, lambda g, r: g.all_gather(exact_inputs(n, r, I32)))
    expect = np.stack([exact_inputs(n, q, I32) for q in range(p)])
    for out in outs:
        assert out.shape == (p, n) and np.array_equal(out, expect)
    counts = [(n + q) % 5 for q in range(p)]
    outs = await on_all(groups, lambda g, r: g.all_gather(exact_inputs(counts[r], r, F16), counts=counts))
    expect = np.concatenate([exact_inputs(counts[q], q, F16) for q in range(p)])
    for out in outs:
        assert np.array_equal(out, expect)
    assert_identical(outs)


async def check_broadcast(groups, n):
    p = len(groups)
    for root in sorted({0, p - 1}):
        bufs = [exact_inputs(n, 99, F64) if r == root else np.zeros(n, F64) for r in range(p)]
        await on_all(groups, lambda g, r: g.broadcast(bufs[r], root))
        for b in bufs:
            assert np.array_equal(b, exact_inputs(n, 99, F64))


async def check_reduce(groups, n):
    p = len(groups)
    root = p // 2
    ins = [exact_inputs(n, r, I64) for r in range(p)]
    keep = [x.copy() for x in ins]
    outs = await on_all(groups, lambda g, r: g.reduce(ins[r], "sum", root))
    for r, out in enumerate(outs):
        if r == root:
            assert out is ins[r] and np.array_equal(out, reference("sum", n, p, I64))
        else:
            assert out is None and np.array_equal(ins[r], keep[r]), "reduce changed a non-root input"


async def check_gather_scatter(groups, n):
    p = len(groups)
    root = p - 1
    outs = await on_all(groups, lambda g, r: g.gather(exact_inputs(n, r, F32), root))
    for r, out in enumerate(outs):
        if r == root:
            assert np.array_equal(out, np.stack([exact_inputs(n, q, F32) for q in range(p)]))
        else:
            assert out is None
    # scatter: rows of a (p, n) array, a near-equal split of a flat one, explicit counts
    full = np.stack([exact_inputs(n, q, I32) for q in range(p)])
    outs = await on_all(groups, lambda g, r: g.scatter(full if r == 0 else None, 0))
    for r, out in enumerate(outs):
        assert out.shape == (n,) and np.array_equal(out, full[r])
    flat = exact_inputs(n, 5, F64)
    outs = await on_all(groups, lambda g, r: g.scatter(flat if r == 0 else None, 0))
    assert np.array_equal(np.concatenate(outs), flat)
    counts = [n if q == p - 1 else 0 for q in range(p)]
    outs = await on_all(groups, lambda g, r: g.scatter(flat if r == 0 else None, 0, counts=counts))
    assert np.array_equal(outs[-1], flat) and all(o.size == 0 for o in outs[:-1])


async def check_codecs(groups, n, algo):
    p = len(groups)
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(n).astype(F32) * 3 for _ in range(p)]
    exact = np.sum([x.astype(F64) for x in xs], axis=0)
    for codec in ("f16", "q80"):
        outs = await on_all(groups, lambda g, r: g.all_reduce(xs[r].copy(), "sum", codec))
        assert_identical(outs)
        names = [algo] if algo != "auto" else list(ALGORITHMS)
        bound = max(codec_bound(ALGORITHMS[a], codec, p, float(sum(np.abs(x).max() for x in xs))) for a in names)
        if p > 1:
            assert np.abs(outs[0] - exact).max() <= bound, f"{codec}: error above its bound"
        else:
            assert np.array_equal(outs[0], xs[0])


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algo", ALGOS)
async def test_every_collective(algo, p):
    async with local_cluster(p, algo=algo, timeout=20) as groups:
        for n in lengths(p):
            await check_all_reduce(groups, n)
            await check_reduce_scatter(groups, n, algo)
            await check_all_gather(groups, n)
            await check_broadcast(groups, n)
            await check_reduce(groups, n)
            await check_gather_scatter(groups, n)
            await on_all(groups, lambda g, r: g.barrier())
        for n in (1, 45, 1000):
            await check_codecs(groups, n, algo)
        assert all(g.failed is None for g in groups)


@pytest.mark.parametrize("algo", ["ring", "rabenseifner", "star", "mesh", "rd"])
async def test_large_pipelined(algo):
    """Several chunks per segment (small chunk size), so pipelining and in-place forwarding run."""
    p, n = 3, 50_001
    async with local_cluster(p, algo=algo, chunk_bytes=4096) as groups:
        outs = await on_all(groups, lambda g, r: g.all_reduce(exact_inputs(n, r, F32)))
        for out in outs:
            assert np.array_equal(out, reference("sum", n, p, F32))
        outs = await on_all(groups, lambda g, r: g.all_reduce(exact_inputs(n, r, F32), codec="q80"))
        assert_identical(outs)
        g = await on_all(groups, lambda g, r: g.all_gather(exact_inputs(n, r, I64)))
        assert np.array_equal(g[1], np.stack([exact_inputs(n, q, I64) for q in range(p)]))
        b = [exact_inputs(n, 3, F32) if r == 1 else np.zeros(n, F32) for r in range(p)]
        await on_all(groups, lambda g, r: g.broadcast(b[r], 1))
        assert all(np.array_equal(x, b[1]) for x in b)
