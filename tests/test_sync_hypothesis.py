"""Hypothesis-generated collectives: any p, length, dtype, op, algorithm, chunk size (tiny chunks
force many-frame pipelining), checked exactly against numpy and for bit-identical ranks.
Each example runs in its own uvloop event loop."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dllama.net import run
from dllama.sync import ALGORITHMS, local_cluster
from dllama.sync.bench import codec_bound

from .sync_helpers import assert_identical, on_all

ALGOS = ["star", "ring", "mesh", "rd", "rabenseifner", "auto"]
OPS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "bxor": np.bitwise_xor}


@st.composite
def cases(draw):
    p = draw(st.integers(1, 7))
    n = draw(st.integers(0, 400))
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "int64"]))
    op = draw(st.sampled_from(["sum", "min", "max"] + (["bxor"] if dtype.startswith("int") else [])))
    algo = draw(st.sampled_from(ALGOS))
    chunk = draw(st.sampled_from([40, 128, 4096, 256 << 10]))
    seed = draw(st.integers(0, 2**31))
    return p, n, np.dtype(dtype), op, algo, chunk, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_all_reduce_and_friends(case):
    p, n, dtype, op, algo, chunk, seed = case
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-50, 50, n).astype(dtype) for _ in range(p)]
    expect = OPS[op].reduce(np.stack(xs), axis=0) if n else np.zeros(0, dtype)
    counts = list(rng.multinomial(n, [1 / p] * p)) if p > 0 else []

    async def body():
        async with local_cluster(p, algo=algo, chunk_bytes=chunk, timeout=20) as groups:
            outs = await on_all(groups, lambda g, r: g.all_reduce(xs[r].copy(), op))
            for out in outs:
                assert np.array_equal(out, expect)
            assert_identical(outs)
            blocks = await on_all(groups, lambda g, r: g.reduce_scatter(xs[r], op, counts=counts))
            assert np.array_equal(np.concatenate(blocks), expect)
            gathered = await on_all(groups, lambda g, r: g.all_gather(xs[r]))
            assert all(np.array_equal(gd, np.stack(xs)) for gd in gathered)
            root = int(rng.integers(0, p))
            bufs = [xs[r].copy() for r in range(p)]
            await on_all(groups, lambda g, r: g.broadcast(bufs[r], root))
            assert all(np.array_equal(b, xs[root]) for b in bufs)

    run(body())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 6), n=st.integers(1, 300), algo=st.sampled_from(ALGOS),
       codec=st.sampled_from(["f16", "q80"]), chunk=st.sampled_from([72, 4096, 256 << 10]),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**31))
def test_codecs_error_bound(p, n, algo, codec, chunk, scale, seed):
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(p)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    absmax = float(sum(np.abs(x).max() for x in xs))

    async def body():
        async with local_cluster(p, algo=algo, chunk_bytes=chunk, timeout=20) as groups:
            outs = await on_all(groups, lambda g, r: g.all_reduce(xs[r].copy(), "sum", codec))
            assert_identical(outs)
            names = list(ALGORITHMS) if algo == "auto" else [algo]
            bound = max(codec_bound(ALGORITHMS[a], codec, p, absmax) for a in names)
            assert float(np.abs(outs[0] - exact).max()) <= bound

    run(body())
