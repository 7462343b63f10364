"""Work stealing among the kernels' threads (kernels/sharing.py): every iteration runs once, a slow
thread's share is taken by the others, and the kernels' bits do not depend on how many threads
share their loops."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from dllama.kernels import set_threads
from dllama.kernels.attention import attention
from dllama.kernels.matmul import matmul
from dllama.kernels.packing import PackedRows
from dllama.kernels.sharing import _load, _store, ranges, take
from dllama.quant import QType

from .test_kernels import activations, weight_matrix

TWO_CORES = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 threads")


@pytest.fixture
def threads():
    """set_threads for a test, restored after it."""
    before = numba.get_num_threads()
    yield set_threads
    set_threads(before)


@njit(parallel=True)
def _runs(total, parts, chunk):
    """How many times each iteration ran, and which part ran it."""
    runs = np.zeros(total, np.int64)
    owner = np.full(total, -1, np.int64)
    words = ranges(total, parts)
    for p in prange(parts):
        start, stop = take(words, p, parts, chunk)
        while start < stop:
            for i in range(start, stop):
                runs[i] += 1
                owner[i] = p
            start, stop = take(words, p, parts, chunk)
    return runs, owner


@pytest.mark.parametrize("total, parts, chunk", [(0, 2, 1), (1, 2, 1), (2, 3, 1), (97, 2, 1), (97, 2, 7),
                                                 (5, 2, 100), (1000, 5, 3), (4096, 2, 16)])
def test_every_iteration_runs_exactly_once(threads, total, parts, chunk):
    for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        threads(n)
        for _ in range(20):  # (threads race differently each time)
            runs, owner = _runs(total, parts, chunk)
            np.testing.assert_array_equal(runs, np.ones(total, np.int64))
            assert owner.min(initial=0) >= 0 and owner.max(initial=0) < parts


@njit(parallel=True)
def _part_zero_late(total, chunk, spin_limit):
    """Two parts; part 0 starts only once part 1 has found nothing left to take (or after
    spin_limit checks). Which part ran each iteration."""
    owner = np.full(total, -1, np.int64)
    part_one_done = np.zeros(8, np.int64)
    words = ranges(total, 2)
    for p in prange(2):
        if p == 0:
            spins = 0
            while _load(part_one_done, 0) == 0 and spins < spin_limit:
                spins += 1
        start, stop = take(words, p, 2, chunk)
        while start < stop:
            for i in range(start, stop):
                owner[i] = p
            start, stop = take(words, p, 2, chunk)
        if p == 1:
            _store(part_one_done, 0, 1)
    return owner


@TWO_CORES
def test_a_late_threads_share_is_taken_by_the_other(threads):
    """With prange's fixed halves, part 1 would run 500 of 1000 iterations whatever part 0 did;
    here it takes part 0's range while that one has not begun, all but its last chunk."""
    threads(2)
    total, chunk = 1000, 4
    owner = _part_zero_late(total, chunk, 10**9)
    assert (owner >= 0).all()
    assert (owner == 1).sum() >= total - chunk
    assert (owner[total // 2:] == 1).all()  # its own half, in the order it walks it


@TWO_CORES
@pytest.mark.parametrize("qtype, cols", [(QType.Q4_1, 576), (QType.Q8_0, 576), (QType.Q4_K, 1024),
                                         (QType.Q4_0, 8192)],  # 8192: rows of 4 spans (span by span under 5 tokens)
                         ids=lambda v: getattr(v, "name", str(v)))
def test_matmul_bits_do_not_depend_on_the_thread_count(threads, qtype, cols):
    w = weight_matrix(qtype, 203, cols, seed=5)  # 25 groups of 8 rows and 3 left
    packed = PackedRows.pack(w.data, qtype)
    for T in (1, 3, 8, 17):
        x = activations(T, cols, seed=T)
        results = []
        for n in (1, 2):
            threads(n)
            results.append([matmul(packed, qtype, x), matmul(packed, qtype, x, wide=True)])
        for one, two in zip(*results):
            np.testing.assert_array_equal(one, two, err_msg=f"{T} tokens")


@TWO_CORES
def test_attention_bits_do_not_depend_on_the_thread_count(threads):
    rng = np.random.default_rng(3)
    Hq, Hkv, D, ctx, T = 9, 3, 64, 96, 11
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, ctx, D)).astype(np.float16)
    v_t = rng.standard_normal((Hkv, D, ctx)).astype(np.float16)
    kv_of_head = np.repeat(np.arange(Hkv), Hq // Hkv)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(attention(q, k, v_t, kv_of_head, start=40))
    np.testing.assert_array_equal(results[0], results[1])
