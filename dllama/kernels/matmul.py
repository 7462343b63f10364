"""Quantized matrix products, numba kernels beside their numpy reference.

As in llama.cpp, the activations are quantized per 32-block to 8 bits (GGML's Q8_0 / Q8_1:
int8 values, an f16 scale d and, for Q4_1, the f16 product d*sum(q); `activations.py`), so the
inner loop is an integer dot of one weight block with one activation block and scales are applied
once per block. The block dot products and their float accumulation order are in `simd_q8.py`
(K-quants: `simd_q8k.py`, against Q8_K activations).

`matmul(w, qtype, x)` takes x of shape (T, cols) and returns (T, rows): T = 1 is the decode
matvec, T > 1 the batched prefill, where each weight row is read once for all T tokens.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
from numba import njit, prange

from ..quant import FORMATS, QK, QType, dequantize
from . import CACHE, PARALLEL, read_only
from .activations import Activations, Q8Activations, Q8KActivations, round_f16
from .simd_float import (F16_STRIP_ROWS, F16_TILE_ROWS, F16_TILE_TOKENS, dot_f16_f16_vec, dot_f32_f32_vec, f16_at,
                          strip_f16_f32, tile_f16_f32)
from .packing import PackedRows, rows_per_group
from .sharing import PARTS, ranges, take
from .simd import CARRIED_PER_ROW
from .simd_q8 import (PACKED, PACKED_TAIL, PACKED_TAIL_TILE, PACKED_TILE, PAIR_BIAS, PAIRED_TILES, STARTS_TILES,
                      TAILED, TILE_ROWS, TILE_TOKENS, dot_iq4_nl_q8, dot_iq4_nl_q8_wide, dot_q4_0_q8, dot_q4_0_q8_wide,
                      dot_q4_1_q8, dot_q4_1_q8_wide, dot_q5_0_q8, dot_q5_0_q8_wide, dot_q5_1_q8, dot_q5_1_q8_wide,
                      dot_q8_0_q8, dot_q8_0_q8_wide, tile_iq4_nl_q8, tile_q4_0_q8, tile_q4_1_q8, tile_q5_0_q8,
                      tile_q5_1_q8, tile_q8_0_q8)
from .simd_q8k import (K_PACKED_TILE, K_TAIL_TILE, PACKED_K, PACKED_K_TAIL, dot_q4_k_q8k, dot_q4_k_q8k_wide,
                       dot_q5_k_q8k, dot_q5_k_q8k_wide, dot_q6_k_q8k, dot_q6_k_q8k_wide, tile_q4_k_q8k, tile_q5_k_q8k,
                       tile_q6_k_q8k)

# every f16 bit pattern -> f32. On aarch64 numpy casts in hardware, which quiets the signalling NaNs
# and flags it ("invalid value encountered in cast"); they stay NaNs, so the flag is noise.
with np.errstate(invalid="ignore"):
    F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ------------------------------------------------------------------ kernels
# out[t, r] = dot(row r of w, activation t). prange over rows: the weights are the big operand,
# and each row is read once for all T tokens.

_Q4_0, _Q4_1, _Q8_0, _Q5_0, _Q5_1, _IQ4_NL = 0, 1, 2, 3, 4, 5
_Q4_K, _Q6_K, _Q5_K = 0, 1, 2


@njit(inline="always", nogil=True, cache=CACHE)
def _dot_quant(w, fmt, xq, xd, xds, r, t):
    """One (row, token) dot."""
    if fmt == _Q4_1:
        return dot_q4_1_q8(w, r, xq, xd, xds, t)
    if fmt == _Q4_0:
        return dot_q4_0_q8(w, r, xq, xd, xds, t)
    if fmt == _Q5_0:
        return dot_q5_0_q8(w, r, xq, xd, xds, t)
    if fmt == _Q5_1:
        return dot_q5_1_q8(w, r, xq, xd, xds, t)
    if fmt == _IQ4_NL:
        return dot_iq4_nl_q8(w, r, xq, xd, xds, t)
    return dot_q8_0_q8(w, r, xq, xd, xds, t)


@njit(inline="always", nogil=True, cache=CACHE)
def _dot_quant_wide(w, fmt, xq, xd, xds, r, t):
    """One (row, token) dot, accumulated in float64."""
    if fmt == _Q4_1:
        return dot_q4_1_q8_wide(w, r, xq, xd, xds, t)
    if fmt == _Q4_0:
        return dot_q4_0_q8_wide(w, r, xq, xd, xds, t)
    if fmt == _Q5_0:
        return dot_q5_0_q8_wide(w, r, xq, xd, xds, t)
    if fmt == _Q5_1:
        return dot_q5_1_q8_wide(w, r, xq, xd, xds, t)
    if fmt == _IQ4_NL:
        return dot_iq4_nl_q8_wide(w, r, xq, xd, xds, t)
    return dot_q8_0_q8_wide(w, r, xq, xd, xds, t)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_quant(w, fmt, xq, xd, xds, r, t, out):
    if fmt == _Q4_1:
        tile_q4_1_q8(w, r, xq, xd, xds, t, out)
    elif fmt == _Q4_0:
        tile_q4_0_q8(w, r, xq, xd, xds, t, out)
    elif fmt == _Q5_0:
        tile_q5_0_q8(w, r, xq, xd, xds, t, out)
    elif fmt == _Q5_1:
        tile_q5_1_q8(w, r, xq, xd, xds, t, out)
    elif fmt == _IQ4_NL:
        tile_iq4_nl_q8(w, r, xq, xd, xds, t, out)
    else:
        tile_q8_0_q8(w, r, xq, xd, xds, t, out)


@njit(inline="always", nogil=True, cache=CACHE)
def _tiled_products(dot, tile, w, fmt, xq, xd, xs, out):
    """out[t, r] = dot(w, fmt, xq, xd, xs, r, t) for every row r and token t. Several tokens:
    tiles of TILE_ROWS x TILE_TOKENS (each pair summed as alone: the bits do not depend on the
    batch), the edges one pair at a time. One parallel loop for any T (fewer tokens than a tile:
    pairs only): numba compiles each loop with its own copy of every format's dot."""
    T = xq.shape[0]
    rows = w.shape[0]
    tiled_tokens = T - T % TILE_TOKENS
    for g in prange((rows + TILE_ROWS - 1) // TILE_ROWS):
        r0 = g * TILE_ROWS
        first_single = 0
        if r0 + TILE_ROWS <= rows:
            for t in range(0, tiled_tokens, TILE_TOKENS):
                tile(w, fmt, xq, xd, xs, r0, t, out)
            first_single = tiled_tokens
        for r in range(r0, min(r0 + TILE_ROWS, rows)):
            for t in range(first_single, T):
                out[t, r] = dot(w, fmt, xq, xd, xs, r, t)


@njit(inline="always", nogil=True, cache=CACHE)
def _pairwise_products(dot, w, fmt, xq, xd, xs, out):
    """out[t, r] = dot(w, fmt, xq, xd, xs, r, t), one pair at a time (the float64 dots: no tiles)."""
    for r in prange(w.shape[0]):
        for t in range(xq.shape[0]):
            out[t, r] = dot(w, fmt, xq, xd, xs, r, t)


# The float32 and float64 products are kernels of their own: numba compiles a kernel's every branch,
# and with a runtime `wide` flag each compiled the other's dots too (the warm-up of every format took
# 223 CPU-s that way, 189 this way, on a 2-core x86)
@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_quant(w, fmt, xq, xd, xds, out):
    """Quantized weights against Q8 activations."""
    _tiled_products(_dot_quant, _tile_quant, w, fmt, xq, xd, xds, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_quant_wide(w, fmt, xq, xd, xds, out):
    """_mm_quant accumulated in float64 (out is float64)."""
    _pairwise_products(_dot_quant_wide, w, fmt, xq, xd, xds, out)


# the same products over packed rows (packing.py), 4 or 8 to a group; same bits as above
strip_q4_0, strip_q4_0_wide, tile_q4_0_packed, span_q4_0, span_q4_0_wide, tile_span_q4_0 = PACKED["q4_0"]
strip_q4_1, strip_q4_1_wide, tile_q4_1_packed, span_q4_1, span_q4_1_wide, tile_span_q4_1 = PACKED["q4_1"]
strip_q8_0, strip_q8_0_wide, tile_q8_0_packed, span_q8_0, span_q8_0_wide, tile_span_q8_0 = PACKED["q8_0"]
strip_q5_0, strip_q5_0_wide, tile_q5_0_packed, span_q5_0, span_q5_0_wide, tile_span_q5_0 = PACKED["q5_0"]
strip_q5_1, strip_q5_1_wide, tile_q5_1_packed, span_q5_1, span_q5_1_wide, tile_span_q5_1 = PACKED["q5_1"]
strip_iq4_nl, strip_iq4_nl_wide, tile_iq4_nl_packed, span_iq4_nl, span_iq4_nl_wide, tile_span_iq4_nl = PACKED["iq4_nl"]
# the tail tiles (simd_q8.PACKED_TAIL): Q4_1's and Q8_0's alone may differ from their tiles
*_, tail_q4_1_packed, _, _, tail_span_q4_1 = PACKED_TAIL["q4_1"]
*_, tail_q8_0_packed, _, _, tail_span_q8_0 = PACKED_TAIL["q8_0"]
assert all(PACKED_TAIL_TILE[fmt] == PACKED_TILE[fmt] for fmt in PACKED_TILE if fmt not in TAILED)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip(wp, fmt, g, xq, xd, xs, t, out, col):
    if fmt == _Q4_1:
        strip_q4_1(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q4_0:
        strip_q4_0(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_0:
        strip_q5_0(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_1:
        strip_q5_1(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _IQ4_NL:
        strip_iq4_nl(wp, g, 0, xq, xd, xs, t, out, col)
    else:
        strip_q8_0(wp, g, 0, xq, xd, xs, t, out, col)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_wide(wp, fmt, g, xq, xd, xs, t, out, col):
    if fmt == _Q4_1:
        strip_q4_1_wide(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q4_0:
        strip_q4_0_wide(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_0:
        strip_q5_0_wide(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_1:
        strip_q5_1_wide(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _IQ4_NL:
        strip_iq4_nl_wide(wp, g, 0, xq, xd, xs, t, out, col)
    else:
        strip_q8_0_wide(wp, g, 0, xq, xd, xs, t, out, col)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col):
    if fmt == _Q4_1:
        tile_q4_1_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _Q4_0:
        tile_q4_0_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_0:
        tile_q5_0_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_1:
        tile_q5_1_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _IQ4_NL:
        tile_iq4_nl_packed(wp, g, i0, xq, xd, xs, t, out, col)
    else:
        tile_q8_0_packed(wp, g, i0, xq, xd, xs, t, out, col)


@njit(inline="always", nogil=True, cache=CACHE)
def _tail_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col):
    if fmt == _Q4_1:
        tail_q4_1_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _Q8_0:
        tail_q8_0_packed(wp, g, i0, xq, xd, xs, t, out, col)
    else:
        _tile_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col)


# A thread takes this many weight bytes x tokens of groups at a time from its share (sharing.py):
# a claim's compare-exchange is then well under 1% of the work, and a share's last claim short
# (SmolLM2's 3072 x 576 Q4_1: 11 groups a claim for 1 token, 1 for 8)
_CLAIM_WORK = 1 << 15


@njit(inline="always", nogil=True, cache=CACHE)
def _groups_a_claim(wp, T):
    return max(1, _CLAIM_WORK // max(1, wp.shape[0] * wp.shape[2] * T))


@njit(inline="always", nogil=True, cache=CACHE)
def _tail_end(T, tiled, tail_tokens):
    """Where the tail tiles of tail_tokens, after `tiled` tokens of whole tiles, end (tail_tokens 0:
    none)."""
    return tiled + (T - tiled) // tail_tokens * tail_tokens if tail_tokens else tiled


@njit(inline="always", nogil=True, cache=CACHE)
def _padded_group(strip, wp, fmt, g, rows, n, xq, xd, xs, out):
    """The rows of the last group g, fewer than n (padded), one strip per token through a scratch row."""
    T = xq.shape[0]
    col = g * n
    edge = np.empty((T, n), out.dtype)
    for t in range(T):
        strip(wp, fmt, g, xq, xd, xs, t, edge, 0)
    for t in range(T):
        for i in range(rows - col):
            out[t, col + i] = edge[t, i]


@njit(inline="always", nogil=True, cache=CACHE)
def _packed_products(strip, tile, tail, wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens, parts, fmt, xq,
                     xt, xd, xs, out):
    """Over rows packed by n: per group of n rows, tiles of tile_rows x tile_tokens (the format's
    PACKED_TILE; tile_tokens 0: none, as float64 products take them), then tail tiles of tail_rows x
    tail_tokens (its tail: a narrower tile, or the same, which takes no tokens; 0: none), then one
    strip (the group's rows x 1 token) per token left; the padded last group through a scratch row.
    The tiles read the activations' values from xt (xq, or the layout the format's tiles read:
    simd_q8.PAIRED_TILES, STARTS_TILES). The threads share the groups by work stealing
    (sharing.py): a core that runs slow for a while does fewer."""
    T = xq.shape[0]
    whole = rows // n
    tiled_tokens = T - T % tile_tokens if tile_tokens else 0
    tailed = _tail_end(T, tiled_tokens, tail_tokens)
    shares = ranges(wp.shape[1], parts)
    chunk = _groups_a_claim(wp, T)
    for p in prange(parts):
        start, stop = take(shares, p, parts, chunk)
        while start < stop:
            for g in range(start, stop):
                col = g * n
                if g < whole:
                    for t in range(0, tiled_tokens, max(tile_tokens, 1)):
                        for i0 in range(0, n, tile_rows):
                            tile(wp, fmt, g, i0, xt, xd, xs, t, out, col + i0)
                    for t in range(tiled_tokens, tailed, max(tail_tokens, 1)):
                        for i0 in range(0, n, tail_rows):
                            tail(wp, fmt, g, i0, xt, xd, xs, t, out, col + i0)
                    for t in range(tailed, T):
                        strip(wp, fmt, g, xq, xd, xs, t, out, col)
                else:
                    _padded_group(strip, wp, fmt, g, rows, n, xq, xd, xs, out)
            start, stop = take(shares, p, parts, chunk)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_packed(wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens, parts, fmt, xq, xt, xd, xs, out):
    """_mm_quant over packed rows."""
    _packed_products(_strip, _tile_packed, _tail_packed, wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens,
                     parts, fmt, xq, xt, xd, xs, out)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_1:
        span_q4_1(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q4_0:
        span_q4_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_0:
        span_q5_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_1:
        span_q5_1(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _IQ4_NL:
        span_iq4_nl(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        span_q8_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_span_wide(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_1:
        span_q4_1_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q4_0:
        span_q4_0_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_0:
        span_q5_0_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_1:
        span_q5_1_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _IQ4_NL:
        span_iq4_nl_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        span_q8_0_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_1:
        tile_span_q4_1(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q4_0:
        tile_span_q4_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_0:
        tile_span_q5_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_1:
        tile_span_q5_1(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _IQ4_NL:
        tile_span_iq4_nl(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        tile_span_q8_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _tail_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_1:
        tail_span_q4_1(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q8_0:
        tail_span_q8_0(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        _tile_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _spanned_products(strip_span, tile_span, tail_span, wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens,
                      parts, fmt, xq, xt, xd, xs, out):
    """A few tokens over packed rows of several spans (packing.py): each of `parts` threads walks its
    groups (runs of them, shared as sharing.py shares them) span by span, so that a span of
    activations stays in L1 while the groups' spans of weights stream past as one sequential read;
    within a span, tiles of tile_rows x tile_tokens (tile_tokens 0: none) and a strip per token
    left, every one's accumulators carried in its own slot from span to span: the bits of whole
    rows. The tiles (and tail tiles, as _packed_products') read xt."""
    n_spans, n_groups = wp.shape[0], wp.shape[1]
    T = xq.shape[0]
    whole = rows // n
    tiled = T - T % tile_tokens if tile_tokens else 0
    tailed = _tail_end(T, tiled, tail_tokens)
    slots = T - tailed  # a group's: one per tile, tail tile and strip
    if tile_tokens:
        slots += tiled // tile_tokens * (n // tile_rows)
    if tail_tokens:
        slots += (tailed - tiled) // tail_tokens * (n // tail_rows)
    per_group = max(T, slots)
    carry = np.empty((n_groups * per_group, CARRIED_PER_ROW * n * max(tile_tokens, 1)), out.dtype)
    edge = np.empty((T, n), out.dtype)  # the padded last group's rows
    parts = min(n_groups, parts)
    shares = ranges(n_groups, parts)
    # (runs of groups long enough for a sequential read of each span: an eighth of a part's share)
    chunk = max(_groups_a_claim(wp, T), n_groups // (8 * max(parts, 1)))
    for p in prange(parts):
        start, stop = take(shares, p, parts, chunk)
        while start < stop:
            for s in range(n_spans):
                for g in range(start, stop):
                    slot = g * per_group
                    if g < whole:
                        for t in range(0, tiled, max(tile_tokens, 1)):
                            for i0 in range(0, n, tile_rows):
                                tile_span(wp, fmt, g, i0, xt, xd, xs, t, out, g * n + i0, s, carry, slot)
                                slot += 1
                        for t in range(tiled, tailed, max(tail_tokens, 1)):
                            for i0 in range(0, n, tail_rows):
                                tail_span(wp, fmt, g, i0, xt, xd, xs, t, out, g * n + i0, s, carry, slot)
                                slot += 1
                        for t in range(tailed, T):
                            strip_span(wp, fmt, g, 0, xq, xd, xs, t, out, g * n, s, carry, slot)
                            slot += 1
                    else:
                        for t in range(T):
                            strip_span(wp, fmt, g, 0, xq, xd, xs, t, edge, 0, s, carry, slot + t)
            start, stop = take(shares, p, parts, chunk)
    for t in range(T):
        for i in range(rows - whole * n):
            out[t, whole * n + i] = edge[t, i]


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_packed_spans(wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens, parts, fmt, xq, xt, xd, xs, out):
    _spanned_products(_strip_span, _tile_span, _tail_span, wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens,
                      parts, fmt, xq, xt, xd, xs, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_packed_spans_wide(wp, rows, n, parts, fmt, xq, xd, xs, out):
    """Float64 strips only (no tiles: tile_tokens 0)."""
    _spanned_products(_strip_span_wide, _tile_span, _tile_span, wp, rows, n, 1, 0, 1, 0, parts, fmt, xq, xq, xd, xs,
                      out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_packed_wide(wp, rows, n, parts, fmt, xq, xd, xs, out):
    """Float64 strips only (no tiles: tile_tokens 0)."""
    _packed_products(_strip_wide, _tile_packed, _tile_packed, wp, rows, n, 1, 0, 1, 0, parts, fmt, xq, xq, xd, xs, out)


@njit(inline="always", nogil=True, cache=CACHE)
def _dot_k_quant(w, fmt, xq, xd, xs, r, t):
    if fmt == _Q4_K:
        return dot_q4_k_q8k(w, r, xq, xd, xs, t)
    if fmt == _Q5_K:
        return dot_q5_k_q8k(w, r, xq, xd, xs, t)
    return dot_q6_k_q8k(w, r, xq, xd, xs, t)


@njit(inline="always", nogil=True, cache=CACHE)
def _dot_k_quant_wide(w, fmt, xq, xd, xs, r, t):
    if fmt == _Q4_K:
        return dot_q4_k_q8k_wide(w, r, xq, xd, xs, t)
    if fmt == _Q5_K:
        return dot_q5_k_q8k_wide(w, r, xq, xd, xs, t)
    return dot_q6_k_q8k_wide(w, r, xq, xd, xs, t)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_k_quant(w, fmt, xq, xd, xs, r, t, out):
    if fmt == _Q4_K:
        tile_q4_k_q8k(w, r, xq, xd, xs, t, out)
    elif fmt == _Q5_K:
        tile_q5_k_q8k(w, r, xq, xd, xs, t, out)
    else:
        tile_q6_k_q8k(w, r, xq, xd, xs, t, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_quant(w, fmt, xq, xd, xs, out):
    """K-quant weights against Q8_K activations."""
    _tiled_products(_dot_k_quant, _tile_k_quant, w, fmt, xq, xd, xs, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_quant_wide(w, fmt, xq, xd, xs, out):
    """_mm_k_quant accumulated in float64 (out is float64)."""
    _pairwise_products(_dot_k_quant_wide, w, fmt, xq, xd, xs, out)


# the same products over packed rows of K-quants (simd_q8k.py), 4 or 2 to a group
strip_q4_k, strip_q4_k_wide, tile_q4_k_packed, span_q4_k, span_q4_k_wide, tile_span_q4_k = PACKED_K["q4_k"]
strip_q5_k, strip_q5_k_wide, tile_q5_k_packed, span_q5_k, span_q5_k_wide, tile_span_q5_k = PACKED_K["q5_k"]
strip_q6_k, strip_q6_k_wide, tile_q6_k_packed, span_q6_k, span_q6_k_wide, tile_span_q6_k = PACKED_K["q6_k"]


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_k(wp, fmt, g, xq, xd, xs, t, out, col):
    if fmt == _Q4_K:
        strip_q4_k(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_K:
        strip_q5_k(wp, g, 0, xq, xd, xs, t, out, col)
    else:
        strip_q6_k(wp, g, 0, xq, xd, xs, t, out, col)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_k_wide(wp, fmt, g, xq, xd, xs, t, out, col):
    if fmt == _Q4_K:
        strip_q4_k_wide(wp, g, 0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_K:
        strip_q5_k_wide(wp, g, 0, xq, xd, xs, t, out, col)
    else:
        strip_q6_k_wide(wp, g, 0, xq, xd, xs, t, out, col)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_k_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col):
    if fmt == _Q4_K:
        tile_q4_k_packed(wp, g, i0, xq, xd, xs, t, out, col)
    elif fmt == _Q5_K:
        tile_q5_k_packed(wp, g, i0, xq, xd, xs, t, out, col)
    else:
        tile_q6_k_packed(wp, g, i0, xq, xd, xs, t, out, col)


# the tail tiles (simd_q8k.PACKED_K_TAIL): Q4_K's alone may differ from its tile
*_, tail_q4_k_packed, _, _, tail_span_q4_k = PACKED_K_TAIL["q4_k"]


@njit(inline="always", nogil=True, cache=CACHE)
def _tail_k_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col):
    if fmt == _Q4_K:
        tail_q4_k_packed(wp, g, i0, xq, xd, xs, t, out, col)
    else:
        _tile_k_packed(wp, fmt, g, i0, xq, xd, xs, t, out, col)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_packed(wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens, parts, fmt, xq, xd, xs, out):
    """_mm_k_quant over packed rows."""
    _packed_products(_strip_k, _tile_k_packed, _tail_k_packed, wp, rows, n, tile_rows, tile_tokens, tail_rows,
                     tail_tokens, parts, fmt, xq, xq, xd, xs, out)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_k_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_K:
        span_q4_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_K:
        span_q5_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        span_q6_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _strip_k_span_wide(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_K:
        span_q4_k_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_K:
        span_q5_k_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        span_q6_k_wide(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _tile_k_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_K:
        tile_span_q4_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    elif fmt == _Q5_K:
        tile_span_q5_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        tile_span_q6_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(inline="always", nogil=True, cache=CACHE)
def _tail_k_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
    if fmt == _Q4_K:
        tail_span_q4_k(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot)
    else:
        _tile_k_span(wp, fmt, g, i0, xq, xd, xs, t, out, col, s, carry, slot)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_packed_spans(wp, rows, n, tile_rows, tile_tokens, tail_rows, tail_tokens, parts, fmt, xq, xd, xs, out):
    _spanned_products(_strip_k_span, _tile_k_span, _tail_k_span, wp, rows, n, tile_rows, tile_tokens, tail_rows,
                      tail_tokens, parts, fmt, xq, xq, xd, xs, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_packed_spans_wide(wp, rows, n, parts, fmt, xq, xd, xs, out):
    """Float64 strips only (no tiles: tile_tokens 0)."""
    _spanned_products(_strip_k_span_wide, _tile_k_span, _tile_k_span, wp, rows, n, 1, 0, 1, 0, parts, fmt, xq, xq, xd,
                      xs, out)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_k_packed_wide(wp, rows, n, parts, fmt, xq, xd, xs, out):
    """Float64 strips only (no tiles: tile_tokens 0)."""
    _packed_products(_strip_k_wide, _tile_k_packed, _tile_k_packed, wp, rows, n, 1, 0, 1, 0, parts, fmt, xq, xq, xd,
                     xs, out)


@njit(nogil=True, cache=CACHE)
def dot_f16(a, a_offset, b, b_offset, n):
    """sum of the n f16 values at element offsets a_offset of a and b_offset of b (uint16 arrays of
    f16 bits, addressed from their data pointers), in the order of llama.cpp's single-token routine
    ggml_vec_dot_f16 (its decode path), plus a float64 tail past the last multiple of 32 as it adds
    one. The F16 matmul and the attention use it for every token, so a token's result does not
    depend on how many are computed together."""
    main = n - n % 32
    return f16_tail(dot_f16_f16_vec(a, a_offset, b, b_offset, main), a, a_offset, b, b_offset, main, n)


@njit(inline="always", nogil=True, cache=CACHE)
def f16_tail(head, a, a_offset, b, b_offset, start, n):
    """head (the sum of the first `start` products) plus products start..n-1, added in float64."""
    total = np.float64(head)
    for i in range(start, n):
        total += np.float64(f16_at(a, a_offset + i) * f16_at(b, b_offset + i))
    return np.float32(total)


F16_ROW_BLOCK = 32  # rows that stay in L2 while each tile of tokens passes over them


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_f16(w, x16, x32, out):
    """dot_f16 of every (row, token). One token (decode): strips of F16_STRIP_ROWS rows, rows r,
    r + q, r + 2q, ... (q = rows / F16_STRIP_ROWS): each activation vector is loaded once for them,
    and a thread's strips read its quarters of the matrix as so many long sequential streams
    (strips of adjacent short rows were 2x slower from DRAM: streams of 1 KB, too short for the
    prefetchers). Several tokens: tiles of F16_TILE_ROWS rows x F16_TILE_TOKENS tokens read the
    activations as float32 (x32: x16's values, exactly) and convert each weight vector once for
    them; the pairs left one at a time."""
    rows, cols = w.shape
    T = x16.shape[0]
    row_stride = w.strides[0] // 2  # in elements; rows of a column slice are not adjacent
    main = cols - cols % 32
    if T == 1:
        q = rows // F16_STRIP_ROWS
        for r in prange(q):  # (each thread a contiguous share of the strips: of every quarter)
            strip_f16_f32(w, r, q, x32, 0, main, out)
            for i in range(r, r + q * F16_STRIP_ROWS, q):
                out[0, i] = f16_tail(out[0, i], w, i * row_stride, x16, 0, main, cols)
        for r in range(q * F16_STRIP_ROWS, rows):
            out[0, r] = dot_f16(w, r * row_stride, x16, 0, cols)
        return
    tiled_tokens = T - T % F16_TILE_TOKENS
    for block in prange((rows + F16_ROW_BLOCK - 1) // F16_ROW_BLOCK):
        first, last = block * F16_ROW_BLOCK, min(rows, (block + 1) * F16_ROW_BLOCK)
        tiled_rows = first + (last - first) // F16_TILE_ROWS * F16_TILE_ROWS
        for t in range(0, tiled_tokens, F16_TILE_TOKENS):  # these tokens stay in L1 for the block's rows
            for r in range(first, tiled_rows, F16_TILE_ROWS):
                tile_f16_f32(w, r, 1, x32, t, main, out)
                for i in range(r, r + F16_TILE_ROWS):
                    for j in range(t, t + F16_TILE_TOKENS):
                        out[j, i] = f16_tail(out[j, i], w, i * row_stride, x16, j * cols, main, cols)
        for r in range(first, last):  # the rest one pair at a time
            for t in range(tiled_tokens if r < tiled_rows else 0, T):
                out[t, r] = dot_f16(w, r * row_stride, x16, t * cols, cols)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_f32(w, x, out):
    """In the order of GGML's single-token ggml_vec_dot_f32 (then a float32 tail past the last
    multiple of 32), like the F16 matmul: an F32 matrix (a MoE router) sums as llama.cpp's decode."""
    rows, cols = w.shape
    T = x.shape[0]
    row_stride = w.strides[0] // 4  # in elements; rows of a column slice are not adjacent
    main = cols - cols % 32
    for r in prange(rows):
        for t in range(T):
            acc = dot_f32_f32_vec(w, r * row_stride, x, t * cols, main)
            for c in range(main, cols):
                acc += w[r, c] * x[t, c]
            out[t, r] = acc


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_f32_wide(w, x, out):
    """float64 accumulation of float64 products (each product of two f32 is exact)."""
    rows, cols = w.shape
    T = x.shape[0]
    for r in prange(rows):
        for t in range(T):
            acc = 0.0
            for c in range(cols):
                acc += np.float64(w[r, c]) * np.float64(x[t, c])
            out[t, r] = acc


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _mm_f16_wide(w, x16, tbl, out):
    rows, cols = w.shape
    T = x16.shape[0]
    for r in prange(rows):
        for t in range(T):
            acc = 0.0
            for c in range(cols):
                acc += np.float64(tbl[w[r, c]]) * np.float64(tbl[x16[t, c]])
            out[t, r] = acc


# Below this many tokens, products over long packed rows walk them span by span (_spanned_products),
# tiles too, each tile's accumulators carried in its own slot. Measured (1 core, from DRAM, 2048 x
# 8192) against whole rows per tile: 1 token Q4_0 1.35x, 2 tokens 1.4x, 4 tokens Q4_K 1.4x, Q6_K
# 1.6x, Q4_0 level; 6 tokens Q4_K 0.85x, 8 level: with more tokens the weights are read from L2 for
# every tile anyway, and the tiles' carried accumulators cost more than they save
SPANNED_TOKENS = 5
_K_KERNEL = {QType.Q4_K: _Q4_K, QType.Q5_K: _Q5_K, QType.Q6_K: _Q6_K}
_QUANT_KERNEL = {QType.Q4_0: _Q4_0, QType.Q4_1: _Q4_1, QType.Q8_0: _Q8_0, QType.Q5_0: _Q5_0, QType.Q5_1: _Q5_1,
                 QType.IQ4_NL: _IQ4_NL}


@functools.cache
def _packed_kernel(qtype: QType) -> tuple[int, tuple[int, int, int, int], int, bool, int | str | None]:
    """For packed rows of qtype: (the kernels' format number, their tile shape and tail tile shape
    (rows, tokens, tail rows, tail tokens), rows per group, a K-quant?, the layout of Q8 values its
    tiles read: the bias of the paired layout, STARTS (the starts layout) or None (plain Q8 values)),
    worked out once: the enum and dict lookups cost ~5 us a call, and a decode step of SmolLM2 makes
    ~150 matmuls of 10-100 us."""
    fmt, k_quant = QType(qtype).name.lower(), qtype in _K_KERNEL
    tiles = (K_PACKED_TILE if k_quant else PACKED_TILE)[fmt] + (K_TAIL_TILE if k_quant else PACKED_TAIL_TILE)[fmt]
    layout = PAIR_BIAS.get(fmt, 0) if fmt in PAIRED_TILES else STARTS if fmt in STARTS_TILES else None
    return (_K_KERNEL if k_quant else _QUANT_KERNEL)[qtype], tiles, rows_per_group(qtype), k_quant, layout


STARTS = "starts"  # (_packed_kernel) the tiles read Activations.q8_starts


def matmul(w: np.ndarray | PackedRows, qtype: QType, x, out: np.ndarray | None = None,
           wide: bool = False) -> np.ndarray:
    """out = x @ W.T for W (rows, cols) in a native format, as stored or packed (`PackedRows`, of
    qtype); x is (T, cols) or (cols,) float32, or an `Activations`. The result is (T, rows), or
    (rows,) for a 1-D x.
    wide: accumulate and return float64, so that partial sums over column slices add up to the
    whole product up to float64 rounding (the exact reduction mode of the cluster)."""
    if not isinstance(x, Activations):
        if x.ndim == 1:
            return matmul(w, qtype, Activations(x), None if out is None else out[None, :], wide)[0]
        x = Activations(x)
    if out is None:
        rows = w.rows if isinstance(w, PackedRows) else w.shape[0]
        out = np.empty((x.tokens, rows), np.float64 if wide else np.float32)
    elif out.strides[-1] != out.itemsize:  # a prefill tile writes each token's row as contiguous values
        raise ValueError("matmul's out must have contiguous rows")
    elif out.dtype != (np.float64 if wide else np.float32):  # the kernels write the accumulators' type
        raise ValueError(f"matmul's out must be {'float64' if wide else 'float32'}, not {out.dtype}")
    if isinstance(w, PackedRows):
        kernel, tile, n, k_quant, layout = _packed_kernel(w.qtype)
        # the values the tiles read: their layout, made only when there are tiles (the paired one
        # before the Q8 form, so that both are made in one pass)
        laid_out = not wide and layout is not None and x.tokens >= tile[3]  # (tail tiles: at most the tiles')
        xt = (x.q8_starts() if layout == STARTS else x.q8_paired(layout)) if laid_out else None
        a = x.q8k if k_quant else x.q8
        acts = (a.q, a.d, a.sums) if k_quant else (a.q, a.d, a.ds)
        spanned = w.groups.shape[0] > 1 and x.tokens < SPANNED_TOKENS  # long rows, span by span
        if wide:  # float64 strips only
            (((_mm_k_packed_spans_wide if k_quant else _mm_packed_spans_wide) if spanned else
              (_mm_k_packed_wide if k_quant else _mm_packed_wide))(w.groups, w.rows, n, PARTS, kernel, *acts, out))
        elif k_quant:
            (_mm_k_packed_spans if spanned else _mm_k_packed)(w.groups, w.rows, n, *tile, PARTS, kernel, *acts, out)
        else:
            xt = a.q if xt is None else xt
            (_mm_packed_spans if spanned else _mm_packed)(w.groups, w.rows, n, *tile, PARTS, kernel, a.q, xt, a.d,
                                                          a.ds, out)
        return out
    w = read_only(w)
    if qtype in _QUANT_KERNEL:
        a = x.q8
        (_mm_quant_wide if wide else _mm_quant)(w, _QUANT_KERNEL[qtype], a.q, a.d, a.ds, out)
        return out
    if qtype in _K_KERNEL:
        k = x.q8k
        (_mm_k_quant_wide if wide else _mm_k_quant)(w, _K_KERNEL[qtype], k.q, k.d, k.sums, out)
        return out
    if x.x is None:
        raise ValueError(f"a {QType(qtype).name} matmul needs float activations, not Q8 blocks")
    if wide:
        if qtype == QType.F16:
            _mm_f16_wide(w.view(np.uint16), x.f16_bits, F16_TO_F32, out)
        else:
            _mm_f32_wide(w, x.x, out)
        return out
    if qtype == QType.F16:
        _mm_f16(w.view(np.uint16), x.f16_bits, x.f16_values, out)
    elif qtype == QType.F32:
        _mm_f32(w, x.x, out)
    else:
        raise ValueError(f"no kernel for {QType(qtype).name}")
    return out


def matmul_ref(w: np.ndarray, qtype: QType, x: np.ndarray) -> np.ndarray:
    """numpy reference of `matmul`: the same activation quantization, exact integer block dots,
    scales applied in float64."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    qtype = QType(qtype)
    if qtype == QType.F32:
        return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    if qtype == QType.F16:
        return (round_f16(x).astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    if qtype in _K_KERNEL:  # the dequantized weights and Q8_K activations, in float64
        a = Q8KActivations.quantize_ref(x)
        xk = a.q.reshape(x.shape[0], -1, 256).astype(np.float64) * a.d[..., None].astype(np.float64)
        return (xk.reshape(x.shape[0], -1) @ dequantize(w, qtype).astype(np.float64).T).astype(np.float32)
    isum, d, d_x, blocks = _block_dots(w, qtype, x)
    out = (isum * d[None] * d_x[:, None, :]).sum(-1)
    if qtype in (QType.Q4_1, QType.Q5_1):
        a = Q8Activations.quantize_ref(x)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += (m[None] * a.ds[:, None, :].astype(np.float64)).sum(-1)
    return out.astype(np.float32)


def _block_dots(w: np.ndarray, qtype: QType, x: np.ndarray):
    """For a 32-value block format: the exact integer dot isum[t, r, b] of weight block b of row r
    with token t's Q8 block, the weights' scales d[r, b] and the activations' d_x[t, b] (float64,
    exactly their f16 values), and the weights' blocks."""
    fmt = FORMATS[qtype]
    blocks = w.reshape(w.shape[0], -1, fmt.block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == QType.Q8_0:
        wq = blocks[..., 2:].view(np.int8).astype(np.int64)
    else:  # the integer quants: the dequantized values over d, less the min (Q4_1, Q5_1) met below
        m = {QType.Q4_1: 2, QType.Q5_1: 2}.get(qtype)
        unit = blocks.copy()
        unit[..., 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        if m is not None:
            unit[..., m:m + 2] = 0
        wq = np.rint(dequantize(unit.reshape(w.shape), qtype)).astype(np.int64).reshape(w.shape[0], -1, QK)
    a = Q8Activations.quantize_ref(x)
    xq = a.q.reshape(x.shape[0], -1, QK).astype(np.int64)
    return np.einsum("rbj,tbj->trb", wq, xq), d, a.d.astype(np.float64), blocks


def matmul_in_lanes_ref(w: np.ndarray, qtype: QType, x: np.ndarray) -> np.ndarray:
    """Plain-Python reference of the order of the formats llama.cpp repacks on x86, whose kernels
    ours follow (simd_q8.ROWS_IN_LANES, simd_q8k.K_ROWS_IN_LANES), bit for bit: for each (row,
    token), acc = fma(isum, d_w * d_x, acc) over its blocks in turn from 0, each fused multiply-add
    rounded once to float32 (worked out exactly, with fractions: slow, for tests), the product of
    the scales rounded to float32 (exact for two f16s); Q4_K the same of its mins' integer dots
    with dmin_w * d_x, subtracted at the end."""
    # the formats whose every term this works out (a scale per block, and Q4_K's mins), not the kernels'
    # lists: a format added to those must not pass here with a term of its own left out (Q4_1's min)
    if qtype not in (QType.Q4_0, QType.IQ4_NL, QType.Q4_K):
        raise ValueError(f"{QType(qtype).name} is not summed in the order of llama.cpp's repacked kernels")
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    if qtype == QType.Q4_K:
        a = Q8KActivations.quantize_ref(x)
        xq = a.q.reshape(x.shape[0], -1, 256).astype(np.int64)
        blocks = np.asarray(w, np.uint8).reshape(w.shape[0], -1, 144)
        d, dmin = (blocks[..., k:k + 2].copy().view(np.float16)[..., 0].astype(np.float32) for k in (0, 2))

        def integers(d_bits: float, dmin_bits: float) -> np.ndarray:  # the quants with d and dmin set
            unit = blocks.copy()
            unit[..., 0:4] = np.frombuffer(np.array([d_bits, dmin_bits], np.float16).tobytes(), np.uint8)
            values = dequantize(unit.reshape(w.shape), qtype).reshape(w.shape[0], -1, 256)
            return np.einsum("rbj,tbj->trb", np.rint(values).astype(np.int64), xq)

        terms = [(integers(1.0, 0.0), d), (-integers(0.0, 1.0), dmin)]  # sub-block scales x quants; mins
        d_x = a.d.astype(np.float32)
    else:
        isum, d, d_x, _ = _block_dots(w, qtype, x)
        terms = [(isum, d.astype(np.float32))]
        d_x = d_x.astype(np.float32)
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for t, r in np.ndindex(out.shape):
        sums = []
        for dots, scales in terms:
            acc = Fraction(0)
            for b in range(dots.shape[2]):
                scale = Fraction(float(scales[r, b] * d_x[t, b]))  # float32 by float32, rounded to float32
                acc = Fraction(float(_round_f32(int(dots[t, r, b]) * scale + acc)))
            sums.append(np.float32(acc))
        out[t, r] = sums[0] - sums[1] if len(sums) > 1 else sums[0]
    return out


def _round_f32(q: Fraction) -> np.float32:
    """The float32 nearest q, ties to even."""
    near = np.float32(float(q))  # within an ulp of it (rounded twice)
    candidates = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))
