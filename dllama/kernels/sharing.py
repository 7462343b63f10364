"""Threads sharing a loop's iterations by work stealing, for the kernels' parallel loops.

numba's prange gives each thread an equal, fixed share, so a loop takes as long as its slowest
thread's share. A core that runs slower for a while (another program on it, a neighbour on a
shared host's core, a little core of a big.LITTLE board) then holds every step back. Measured on
this project's 2-vCPU AMD EPYC (Zen 4) VM, with rdtsc around each thread's half of a Q4_1 matmul
(SmolLM2's 3072 x 576, 8 tokens): most calls 233k cycles each, but in spells that come and go the
second thread's half took 340-385k, and the call with it: 143 us (median of 300 calls, 2 threads)
where 97 us without a spell. Shared as below, the same calls took 119 us in such spells, 97-99 us
without them.

Here each part (one per thread) starts on its own contiguous range, which it walks front to back
a chunk at a time, so that without a slow core the threads read what they read with prange, in
one sequential stream each. A part whose range is done takes the back half of the largest one
another part has left, and walks that. Every iteration runs exactly once, on whichever thread:
the kernels' results do not depend on which (each iteration writes its own outputs, in its own
order), so the bits are those of a static split.

A part's range [front, end) (total < 2^31) is one int64 (front << 32 | end) on a cache line of its
own, changed by compare-and-exchange: its owner moves the front, a thief the end; a part stores the
range it stole in its own word, empty until then, which no thief touches.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from . import CACHE

# A shared loop's parts: the most threads numba may run (set_threads may choose fewer, per calling
# thread). A team of fewer threads runs the parts left over after its own and steals from them, so
# every team size gets the same iterations; asking numba for the team's size costs ~3 us a call
# from Python, and inside a kernel it would keep numba from caching the kernel.
PARTS = numba.config.NUMBA_NUM_THREADS
_LINE = 8  # int64s a cache line: each part's range on a line of its own (no false sharing)
_HALF = 32
_LOW = (1 << _HALF) - 1


def _element(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, value=args[0])
    return builder.gep(array.data, [args[1]])


@intrinsic
def _load(typingctx, words, index):
    """words[index], read atomically (ordering: none needed, no data is handed over through it)."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature, args), "monotonic", 8)
    return types.int64(words, types.intp), codegen


@intrinsic
def _store(typingctx, words, index, value):
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element(context, builder, signature, args), "monotonic", 8)
        return context.get_dummy_value()
    return types.void(words, types.intp, types.int64), codegen


@intrinsic
def _compare_exchange(typingctx, words, index, expected, desired):
    """words[index] = desired if it holds expected (atomically); whether it did."""
    def codegen(context, builder, signature, args):
        result = builder.cmpxchg(_element(context, builder, signature, args), args[2], args[3], "monotonic",
                                 "monotonic")
        return builder.extract_value(result, 1)
    return types.boolean(words, types.intp, types.int64, types.int64), codegen


@njit(inline="always", nogil=True, cache=CACHE)
def ranges(total, parts):
    """Each of `parts` parts' own share of iterations 0 .. total-1, as prange would split them."""
    words = np.empty(parts * _LINE, np.int64)
    for p in range(parts):
        words[p * _LINE] = (p * total // parts) << _HALF | (p + 1) * total // parts
    return words


@njit(inline="always", nogil=True, cache=CACHE)
def take(words, p, parts, chunk):
    """Part p's next iterations (start, stop): up to `chunk` from the front of its range; when that
    is done, the back half of the largest range another part has left (more than a chunk), which
    becomes p's own; (0, 0) when nothing is left to take."""
    at = p * _LINE
    while True:
        word = _load(words, at)
        front, end = word >> _HALF, word & _LOW
        if front >= end:
            break
        stop = min(end, front + chunk)
        if _compare_exchange(words, at, word, stop << _HALF | end):
            return front, stop
    while True:
        victim, most = -1, chunk
        for v in range(parts):
            word = _load(words, v * _LINE)
            left = (word & _LOW) - (word >> _HALF)
            if v != p and left > most:
                victim, most = v, left
        if victim < 0:
            return 0, 0  # what is left is a chunk or less a part, each its owner's to finish
        word = _load(words, victim * _LINE)
        front, end = word >> _HALF, word & _LOW
        if end - front <= chunk:
            continue  # (its owner or another thief took it meanwhile: look again)
        middle = end - (end - front) // 2
        if _compare_exchange(words, victim * _LINE, word, front << _HALF | middle):
            stop = min(end, middle + chunk)
            _store(words, at, stop << _HALF | end)  # (p's own range was empty: no thief changes it)
            return middle, stop

