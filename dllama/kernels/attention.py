"""Causal attention over an f16 KV cache and the softmax it sums with, numba kernels beside their
numpy references. Apart from ops.py's per-token ops because it alone reads across positions, with
rounding rules of its own, llama.cpp's single-token path: queries and softmax weights are rounded
to f16 before meeting the cache, dot products run in ggml_vec_dot_f16's order, exp is GGML's
polynomial (ops.expf), the softmax sums groups of 8 in double.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import intrinsic

from ..kv_cache import V_TILE
from . import CACHE, PARALLEL
from .activations import round_f16
from .matmul import f16_tail
from .ops import expf
from .sharing import ranges, take
from .simd_float import (F16_STRIP_ROWS, GROUP_QUERIES, f16_at, f16_bits, f16_round, hsum8, key_f16_f32, keys_f16_f32,
                          value_f16_f32, values_f16_f32)

# ------------------------------------------------------------------ softmax


@njit(nogil=True, cache=CACHE, inline="always")
def _softmax_row(x, lo, n):
    """softmax of x[lo:n] in place, as GGML's soft_max over a row where masked (-inf) entries
    fill [0, lo) and pad n to a multiple of 8: exp by its polynomial, then 8-lane group sums added
    in float64. x[:lo] and x[n:] up to the next multiple of 8 must be zeros (what the masked
    entries' exp gives)."""
    live = x[lo:n]  # loops from 0 over a view: LLVM vectorizes them, not loops from a runtime lo (~7x slower)
    # float32, as GGML's max: x - top rounded once. Eight lanes, then their tree: a maximum is the same
    # in any order (a +0 for a -0 changes no x - top), and one chain of dependent comparisons is slow
    whole = live.shape[0] - live.shape[0] % 8
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    for i in range(0, whole, 8):
        m0, m1, m2, m3 = max(m0, live[i]), max(m1, live[i + 1]), max(m2, live[i + 2]), max(m3, live[i + 3])
        m4, m5, m6, m7 = max(m4, live[i + 4]), max(m5, live[i + 5]), max(m6, live[i + 6]), max(m7, live[i + 7])
    top = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for i in range(whole, live.shape[0]):
        top = max(top, live[i])
    for i in range(live.shape[0]):
        live[i] = expf(live[i] - top)
    total = 0.0
    for g in range(lo - lo % 8, n, 8):
        total += hsum8(x, g)
    inv = np.float32(1.0 / total)
    for i in range(live.shape[0]):
        live[i] = live[i] * inv


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _softmax(x, out):
    T, n = x.shape
    for t in prange(T):
        row = np.zeros((n + 7) // 8 * 8, np.float32)
        row[:n] = x[t]
        _softmax_row(row, 0, n)
        out[t] = row[:n]


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of x (T, n) float32, computed as the attention computes it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _softmax(x, out)
    return out


def softmax_ref(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


# ------------------------------------------------------------------ attention

# The cache's values, transposed as llama.cpp keeps them without flash attention (a dot per output
# dimension over the positions), in tiles of V_TILE positions: (tiles, head_dim, V_TILE). A dot's
# step of 32 values reads one tile's row, so a head's values over the positions attended are one
# contiguous run, as its keys are. Rows of the whole capacity (head_dim, capacity) made each dot a
# short stream of its own, capacity * 2 bytes from the next. (V_TILE: kv_cache.py, which sizes the caches)
assert V_TILE == 32, "a tile's row is one step of the f16 dot"


def values_in_tiles(v_t: np.ndarray) -> np.ndarray:
    """Transposed values (..., head_dim, capacity) as the cache holds them: (..., capacity / V_TILE,
    head_dim, V_TILE)."""
    *lead, D, n = v_t.shape
    return np.ascontiguousarray(np.moveaxis(v_t.reshape(*lead, D, n // V_TILE, V_TILE), -2, -3))


@njit(inline="always", nogil=True, cache=CACHE)
def _key_dots(keys, first, stop, queries, g, n, out):
    """out[j, r] = the dot of keys[r] (f16) and queries[j] (f32 values of f16s), first n values (a
    multiple of 32), for first <= r < stop and j < g (query heads that read these keys), in strips
    of F16_STRIP_ROWS adjacent keys (each query vector loaded once for them, each key vector
    converted once for the g queries), the last strip overlapping the one before (its keys computed
    twice, the same bits) rather than reading past stop. Each dot in dot_f16's order."""
    if stop - first < F16_STRIP_ROWS:
        for r in range(first, stop):
            key_f16_f32(keys, r, 1, queries, 0, g, n, out)
        return
    for r in range(first, stop - F16_STRIP_ROWS + 1, F16_STRIP_ROWS):
        keys_f16_f32(keys, r, 1, queries, 0, g, n, out)
    if (stop - first) % F16_STRIP_ROWS:
        keys_f16_f32(keys, stop - F16_STRIP_ROWS, 1, queries, 0, g, n, out)


@njit(inline="always", nogil=True, cache=CACHE)
def _value_dots(values, D, probs, g, n, out):
    """out[j, d] = the dot of value row d (tiles of V_TILE positions: see CacheSpans) with probs[j]
    over the first n positions (a multiple of 32), for d < D and j < g, in strips as _key_dots."""
    if D < F16_STRIP_ROWS:
        for d in range(D):
            value_f16_f32(values, d, 1, D, probs, 0, g, n, out)
        return
    for d in range(0, D - F16_STRIP_ROWS + 1, F16_STRIP_ROWS):
        values_f16_f32(values, d, 1, D, probs, 0, g, n, out)
    if D % F16_STRIP_ROWS:
        values_f16_f32(values, D - F16_STRIP_ROWS, 1, D, probs, 0, g, n, out)


def _f16_at_address(typingctx, address, *shape):
    """The f16 values (uint16 bits) at an address, as a C-contiguous array of `shape` that owns
    nothing: no reference count to update (an atomic, when the parallel loop's threads share it)."""
    sig = types.Array(types.uint16, len(shape), "C")(address, *shape)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.return_type)(context, builder)
        item = context.get_constant(types.intp, 2)
        pointer = builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint16)))
        dims = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
        strides = [item]
        for dim in reversed(dims[1:]):
            strides.insert(0, builder.mul(dim, strides[0]))
        context.populate_array(array, data=pointer, shape=dims, strides=strides, itemsize=item, meminfo=None)
        return array._getvalue()

    return sig, codegen


@intrinsic
def _f16_array_at(typingctx, address, size):
    """`size` f16 values at an address, a 1-D array (_f16_at_address)."""
    return _f16_at_address(typingctx, address, size)


@intrinsic
def _f16_rows_at(typingctx, address, rows, cols):
    """rows x cols f16 values at an address, a 2-D array (_f16_at_address): a head's keys
    (positions x head_dim) or values (tiles x head_dim rows of V_TILE)."""
    return _f16_at_address(typingctx, address, rows, cols)


@njit(inline="always", nogil=True, cache=CACHE)
def _store_kv(k_new, v_new, k_base, v_base, ctx, starts, offsets, sequence, layer, D, t, h):
    """Token t's key and value of KV head h into its sequence's cache (f16, V in tiles)."""
    Hkv = k_new.shape[1]
    j = sequence[t]
    n_ctx, p = ctx[j], starts[j] + t - offsets[j]
    size = (layer + 1) * Hkv * n_ctx * D
    k_cache, v_cache = _f16_array_at(k_base[j], size), _f16_array_at(v_base[j], size)
    head = (layer * Hkv + h) * n_ctx * D
    for d in range(D):
        k_cache[head + p * D + d] = f16_bits(k_new[t, h, d])
        v_cache[head + p // V_TILE * D * V_TILE + d * V_TILE + p % V_TILE] = f16_bits(v_new[t, h, d])


@njit(inline="always", nogil=True, cache=CACHE)
def _span(t, h, sequence, starts, offsets, ctx, k_base, v_base, kv_of_head, layer, Hkv, D, window):
    """What token t's head h reads (see _attention): the addresses of its KV head's keys and values
    in its sequence's cache, its positions n (itself included), the first it sees, n rounded up to
    the dot step (within the capacity), and the capacity."""
    j = sequence[t]
    n_ctx = ctx[j]
    n = starts[j] + t - offsets[j] + 1
    lo = max(0, n - window) if window > 0 else 0  # masked before: weight 0 in its cache cell
    n_pad = min((n + 31) // 32 * 32, n_ctx)  # (the dot's step: the masked cells past n add exact zeros, as GGML's)
    head = (layer * Hkv + kv_of_head[h]) * n_ctx * D
    return k_base[j] + 2 * head, v_base[j] + 2 * head, n, lo, n_pad, n_ctx


ATTENTION_TOKENS = 16  # tokens per job of one head, at most (see _attention)
JOBS_PER_THREAD = 8  # at least, where the tokens allow: whole jobs split unevenly between threads


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _attention(q, k_new, v_new, k_base, v_base, ctx, starts, offsets, copies, layer, Hq, D, kv_of_head, scale,
               window, threads, out):
    """Causal attention of several sequences' queries, each against its own cache (over the last
    `window` positions if window > 0), after writing their new keys and values into it, then
    making the copies: each row of copies (k, v addresses and capacity of the source cache, the
    same of the destination, n) gives the destination the source's first n positions.
    Sequence j: tokens offsets[j]..offsets[j+1]-1 of q (T, Hq * D) f32 (rounded to f16 here, as
    llama.cpp rounds its queries), at positions starts[j]..; its cache at addresses k_base[j] /
    v_base[j]: K (layers, Hkv, ctx[j], D) and V in tiles (layers, Hkv, ctx[j] / V_TILE, D, V_TILE), f16 bits, of
    which layer `layer` is read. k_new, v_new (T, Hkv, D) f32: the tokens' keys and values, stored
    first (f16, rounded to nearest even), or none (0 rows). threads: how many run the jobs (they
    are sized for it). out (T, Hq, D) f32. The caches are addressed by offsets from their starts (a
    view per row would cost an atomic reference count update in the parallel loop). Each (token,
    head) is computed as llama.cpp computes a single token: the result does not depend on how
    the tokens were batched, nor on the other sequences."""
    T = q.shape[0]
    Hkv = k_new.shape[1]
    sequence = np.empty(T, np.int64)
    for j in range(len(starts)):
        for t in range(offsets[j], offsets[j + 1]):  # (a slice assignment here is a thread team's job each)
            sequence[t] = j
    if k_new.shape[0] == 1:  # one token (decode): a few stores, less than a thread team's start
        for h in range(Hkv):
            _store_kv(k_new, v_new, k_base, v_base, ctx, starts, offsets, sequence, layer, D, 0, h)
    elif k_new.shape[0] > 1:
        for job in prange(k_new.shape[0] * Hkv):
            _store_kv(k_new, v_new, k_base, v_base, ctx, starts, offsets, sequence, layer, D, job // Hkv, job % Hkv)
    if copies.shape[0] > 0:  # (rarely: a prompt start shared; no thread team started otherwise)
        for job in prange(copies.shape[0] * Hkv):
            c, h = job // Hkv, job % Hkv
            k_src, v_src, src_ctx, k_dst, v_dst, dst_ctx, n = copies[c]
            src_size, dst_size = (layer + 1) * Hkv * src_ctx * D, (layer + 1) * Hkv * dst_ctx * D
            k_from, k_to = _f16_array_at(k_src, src_size), _f16_array_at(k_dst, dst_size)
            v_from, v_to = _f16_array_at(v_src, src_size), _f16_array_at(v_dst, dst_size)
            src_head, dst_head = (layer * Hkv + h) * src_ctx * D, (layer * Hkv + h) * dst_ctx * D
            for i in range(n * D):
                k_to[dst_head + i] = k_from[src_head + i]
            whole = n // V_TILE * V_TILE * D  # V: whole tiles, then the last one's first positions
            for i in range(whole):
                v_to[dst_head + i] = v_from[src_head + i]
            for d in range(D):
                for i in range(n % V_TILE):
                    v_to[dst_head + whole + d * V_TILE + i] = v_from[src_head + whole + d * V_TILE + i]
    # The query heads that read one KV head (GQA), in blocks of up to GROUP_QUERIES, as even as
    # possible: a block's dots convert each key and value once for all its heads, and its rows are
    # read once. SmolLM2 (3 query heads a KV head, 1 block with AVX-512), one layer, hot, AMD Zen 4,
    # 2 threads: 8 decoding sequences at 64 positions 32 -> 29 us, at 1000 positions 251 -> 170 us;
    # one sequence at 64 positions 9.2 -> 9.5 us (3 jobs for 2 threads, against 9)
    blocks = np.empty((Hq, 2), np.int64)  # (first head, heads)
    n_blocks = 0
    h = 0
    while h < Hq:
        end = h + 1
        while end < Hq and kv_of_head[end] == kv_of_head[h]:
            end += 1
        parts = (end - h + GROUP_QUERIES - 1) // GROUP_QUERIES
        for part in range(parts):
            blocks[n_blocks, 0] = h + (end - h) * part // parts
            blocks[n_blocks, 1] = h + (end - h) * (part + 1) // parts - blocks[n_blocks, 0]
            n_blocks += 1
        h = end
    # Jobs of one block x up to ATTENTION_TOKENS tokens, block-major: a thread's share is whole heads
    # (token-major gave one thread the early tokens, the other the late ones, which see more
    # positions), and a job's scratch rows serve its tokens, not one (token, block) (numba's
    # allocation counters are shared by the threads). A 128-token prefill's attention
    # (32 heads) at 2 threads: 7.7-8.1 ms before, slower than 1 thread's 6.6; now 3.7-6.6 ms.
    # Fewer tokens per job where they would give each thread few jobs: 8 decoding sequences of
    # SmolLM2 (9 heads) were 9 jobs of 8 tokens, 5 for one thread and 4 for the other
    per_job = min(ATTENTION_TOKENS, max(1, T * n_blocks // (JOBS_PER_THREAD * threads)))
    chunks = (T + per_job - 1) // per_job
    longest = 0
    for j in range(len(starts)):
        longest = max(longest, ctx[j])
    main = D - D % 32  # the strips' part of a key; the rest added by f16_tail
    jobs = n_blocks * chunks
    # each job's scratch rows, allocated here, not five allocations a job (a step of 8 decoding
    # sequences of SmolLM2, at their first position: 40.5 -> 36.7 us a layer)
    all_weights = np.empty((jobs, GROUP_QUERIES, longest), np.float32)  # scores, then the softmax
    all_probs = np.empty((jobs, GROUP_QUERIES, longest), np.float32)  # the softmax rounded to f16 (its values)
    all_queries = np.empty((jobs, GROUP_QUERIES, D), np.float32)  # the queries' f16 values
    all_query16 = np.empty((jobs, GROUP_QUERIES, D), np.uint16)  # ... and bits (f16_tail's)
    all_results = np.empty((jobs, GROUP_QUERIES, D), np.float32)
    shares = ranges(jobs, threads)  # (jobs shared by work stealing: sharing.py)
    for part in prange(threads):
        first_job, stop_job = take(shares, part, threads, 1)
        while first_job < stop_job:
            for job in range(first_job, stop_job):
                b, first = job // chunks, job % chunks * per_job
                h0, g = blocks[b, 0], blocks[b, 1]
                weights, probs = all_weights[job], all_probs[job]
                queries, query16, result = all_queries[job], all_query16[job], all_results[job]
                for t in range(first, min(T, first + per_job)):
                    keys_at, values_at, n, lo, n_pad, n_ctx = _span(t, h0, sequence, starts, offsets, ctx, k_base,
                                                                    v_base, kv_of_head, layer, Hkv, D, window)
                    keys = _f16_rows_at(keys_at, n_ctx, D)  # (positions, D)
                    values = _f16_rows_at(values_at, n_ctx // V_TILE * D, V_TILE)  # (tiles x D, V_TILE)
                    for j in range(g):
                        h = h0 + j
                        if main == D:  # (a loop LLVM vectorizes: one conversion for 16 values)
                            for i in range(D):
                                queries[j, i] = f16_round(q[t, h * D + i])
                        else:  # f16_tail reads the bits
                            for i in range(D):
                                query16[j, i] = f16_bits(q[t, h * D + i])
                                queries[j, i] = f16_at(query16, j * D + i)
                        weights[j, :n_pad] = 0.0
                    _key_dots(keys, lo, n, queries, g, main, weights)
                    for j in range(g):
                        scores, rounded = weights[j, lo:n], probs[j, lo:n]  # (views: see _softmax_row)
                        if main == D:
                            for s in range(scores.shape[0]):
                                scores[s] = scores[s] * scale
                        else:
                            for s in range(scores.shape[0]):
                                scores[s] = f16_tail(scores[s], keys, (lo + s) * D, query16, j * D, main, D) * scale
                        _softmax_row(weights[j], lo, n)
                        probs[j, :n_pad] = 0.0
                        for s in range(rounded.shape[0]):
                            rounded[s] = f16_round(scores[s])
                    _value_dots(values, D, probs, g, n_pad, result)  # n_pad: a multiple of 32
                    for j in range(g):
                        for d in range(D):
                            out[t, h0 + j, d] = result[j, d]
            first_job, stop_job = take(shares, part, threads, 1)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class CacheSpans:
    """The caches a forward pass's sequences attend over: sequence j has counts[j] tokens at
    positions starts[j].., its cache K (layers, Hkv, capacity, D) and V in tiles (layers, Hkv,
    capacity / V_TILE, D, V_TILE), float16, C-contiguous, capacity a multiple of 32. copies: (source, destination,
    n), each a (K, V) pair of such caches: layer by layer, once the tokens' keys and values are
    written, the destination takes the source's first n positions (a shared prompt start, which a
    sequence of the same pass may be computing). Worked out once for all layers."""

    def __init__(self, k_caches: list[np.ndarray], v_caches: list[np.ndarray], starts, counts, copies=()):
        copied = [cache for src, dst, _n in copies for cache in (src, dst)]
        for k, v in [*zip(k_caches, v_caches, strict=True), *copied]:
            if k.dtype != np.float16 or v.dtype != np.float16 or not (k.flags.c_contiguous and v.flags.c_contiguous):
                raise ValueError("KV caches must be C-contiguous float16")
            if k.shape[2] % V_TILE or v.shape != (*k.shape[:2], k.shape[2] // V_TILE, k.shape[3], V_TILE):
                raise ValueError(f"KV caches must be (layers, heads, capacity, head_dim) and (layers, heads, "
                                 f"capacity / {V_TILE}, head_dim, {V_TILE}), the capacity a multiple of {V_TILE}")
        self.caches = (k_caches, v_caches, copied)  # kept alive while the kernel reads their addresses
        self.k_base = np.array([_address(k) for k in k_caches], np.int64)
        self.v_base = np.array([_address(v) for v in v_caches], np.int64)
        self.copies = np.array([(_address(sk), _address(sv), sk.shape[2], _address(dk), _address(dv), dk.shape[2], n)
                                for (sk, sv), (dk, dv), n in copies], np.int64).reshape(len(copies), 7)
        if any(not 0 <= n <= min(src[0].shape[2], dst[0].shape[2]) or src[0].shape[:2] != dst[0].shape[:2]
               for src, dst, n in copies):
            raise ValueError("a copy of more positions than its caches hold, or between caches of other shapes")
        self.threads = get_num_threads()  # (asked once for a pass's layers: ~3 us a call)
        capacities = [k.shape[2] for k in k_caches]
        if any(start + n > capacity for start, n, capacity in zip(starts, counts, capacities, strict=True)):
            raise ValueError("a sequence's tokens run past its cache")
        # (in Python, not numpy: a decode step's few numbers cost less so, and it is made every step)
        self.capacities = np.array(capacities, np.int64)
        self.layers = min((k.shape[0] for k in k_caches), default=0)
        self.starts = np.array(starts, np.int64)
        self.offsets = np.array([0, *itertools.accumulate(counts)], np.int64)


@functools.cache
def _default_scale(D: int) -> np.float32:
    return np.float32(1.0) / np.sqrt(np.float32(D))


def attend(q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None, spans: CacheSpans, layer: int,
           kv_of_head: np.ndarray, scale: float | None = None, window: int = 0) -> np.ndarray:
    """Store each sequence's new keys and values k, v (T, Hkv, D) float32 (None: nothing to store)
    in layer `layer` of its cache, make the spans' copies of that layer, then attend its queries
    q (T, Hq, D) to it -> (T, Hq, D) float32; the sequences one after another in q, k, v as
    `spans` counts them. As `attention` computes each sequence alone, bit for bit, in one kernel
    call for all of them (one call per layer, not one per sequence: a step of 8 sequences ~25%
    faster on SmolLM2)."""
    T, Hq, D = q.shape
    if D % 8:
        raise ValueError("head dimension must be a multiple of 8")
    if not 0 <= layer < spans.layers or spans.offsets[-1] != T:
        raise ValueError(f"layer {layer} of {spans.layers}, or {T} queries for {spans.offsets[-1]} tokens")
    if k is None:
        k = v = np.empty((0, spans.caches[0][0].shape[1], D), np.float32)
    out = np.empty((T, Hq, D), np.float32)
    scale = _default_scale(D) if scale is None else np.float32(scale)
    _attention(np.ascontiguousarray(q, np.float32).reshape(T, Hq * D), np.ascontiguousarray(k, np.float32),
               np.ascontiguousarray(v, np.float32), spans.k_base, spans.v_base, spans.capacities, spans.starts,
               spans.offsets, spans.copies, layer, Hq, D, kv_of_head, scale, window, spans.threads, out)
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache_t: np.ndarray, kv_of_head: np.ndarray,
              start: int, scale: float | None = None, window: int = 0) -> np.ndarray:
    """q (T, Hq, D) at positions start.., k_cache (Hkv, ctx, D) and transposed v_cache_t
    (Hkv, D, ctx), both float16, ctx a multiple of 32 -> (T, Hq, D) float32.
    kv_of_head[h] is the cache head that query head h reads (GQA). Scores are scaled by `scale`
    (default 1/sqrt(D)); window > 0: a query sees the last `window` positions, itself included
    (sliding-window attention). Batch-invariant: every query
    is summed in llama.cpp's one-token order (its decode), so a row of the result is the same
    bits whether computed alone or with other tokens."""
    T, Hq, D = q.shape
    if D % 8 or k_cache.shape[1] % 32:
        raise ValueError("head dimension must be a multiple of 8, cache length of 32")
    spans = CacheSpans([np.ascontiguousarray(k_cache)[None]], [values_in_tiles(v_cache_t)[None]], [start], [T])
    return attend(q, None, None, spans, 0, kv_of_head, scale, window)


def attention_ref(q, k_cache, v_cache_t, kv_of_head, start, scale=None, window=0):
    T, Hq, D = q.shape
    q16 = round_f16(q).astype(np.float64)
    scale = 1 / np.sqrt(D) if scale is None else scale
    out = np.empty((T, Hq, D), np.float32)
    for t in range(T):
        n = start + t + 1
        lo = max(0, n - window) if window else 0
        for h in range(Hq):
            k = k_cache[kv_of_head[h], lo:n].astype(np.float64)
            v = v_cache_t[kv_of_head[h], :, lo:n].astype(np.float64).T
            s = (k @ q16[t, h]) * scale
            p = np.exp(s - s.max())
            p = round_f16((p / p.sum()).astype(np.float32)).astype(np.float64)
            out[t, h] = p @ v
    return out
