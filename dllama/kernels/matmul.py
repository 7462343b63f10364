"""Quantized matrix-vector / matrix-matrix products, numba kernels beside their numpy reference.

As in llama.cpp, the activation side is quantized per 32-block to 8 bits (Q8_0 for Q4_0/Q8_0
weights, Q8_1 - Q8_0 plus a precomputed d*sum - for Q4_1), so the inner loop is an integer dot
product of one weight block with one activation block; the scales are applied once per block.
Scales are f16 in the file; numba has no f16, so they go through a 64 Ki-entry lookup table
(llama.cpp does the same on CPUs without F16C).

`matmul(w, x)` takes x of shape (T, cols) and returns (T, rows): T = 1 is the decode matvec,
T > 1 the batched prefill, where each weight block is loaded once and used for every token.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import FORMATS, QK, QType

F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _round_f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------- activation quantization


@njit(parallel=True, nogil=True, cache=True)
def _quantize_q8(x, xq, xd, xsum):
    """Per 32-block: d = amax/127, q = round_half_even(x * 127/amax); xsum = d * sum(q)."""
    T, cols = x.shape
    nb = cols // 32
    for t in prange(T):
        for b in range(nb):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                v = abs(x[t, o + j])
                if v > amax:
                    amax = v
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[t, o + j] * inv))
                xq[t, o + j] = q
                s += q
            xd[t, b] = d
            xsum[t, b] = d * np.float32(s)


def quantize_activations(x: np.ndarray):
    """x (T, cols) f32 -> (q int8 (T, cols), d (T, nb), d*sum(q) (T, nb)), scales rounded to f16
    as GGML's block_q8_0 / block_q8_1 store them."""
    T, cols = x.shape
    xq = np.empty((T, cols), np.int8)
    xd = np.empty((T, cols // QK), np.float32)
    xs = np.empty((T, cols // QK), np.float32)
    _quantize_q8(x, xq, xd, xs)
    return xq, _round_f16(xd), _round_f16(xs)


def quantize_activations_ref(x: np.ndarray):
    T, cols = x.shape
    xb = x.reshape(T, -1, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127.0)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    s = d * q.astype(np.int32).sum(axis=-1).astype(np.float32)
    return q.reshape(T, cols), _round_f16(d), _round_f16(s)


# ---------------------------------------------------------------- kernels, one per format
# Each kernel computes out[t, r] = dot(row r of w, activation t) for all t, r.
# prange runs over rows (weights are the big operand); tokens are the inner loop so each
# weight block is read from memory once per call.


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mm_q4_0(w, xq, xd, tbl, out):
    rows = w.shape[0]
    T, nb = xd.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 18
                d = tbl[np.int32(w[r, o]) | (np.int32(w[r, o + 1]) << 8)]
                xo = b * 32
                isum = np.int32(0)
                for j in range(16):
                    q = np.int32(w[r, o + 2 + j])
                    isum += ((q & 15) - 8) * np.int32(xq[t, xo + j]) + ((q >> 4) - 8) * np.int32(xq[t, xo + j + 16])
                acc += d * xd[t, b] * np.float32(isum)
            out[t, r] = acc


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mm_q4_1(w, xq, xd, xs, tbl, out):
    rows = w.shape[0]
    T, nb = xd.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 20
                d = tbl[np.int32(w[r, o]) | (np.int32(w[r, o + 1]) << 8)]
                m = tbl[np.int32(w[r, o + 2]) | (np.int32(w[r, o + 3]) << 8)]
                xo = b * 32
                isum = np.int32(0)
                for j in range(16):
                    q = np.int32(w[r, o + 4 + j])
                    isum += (q & 15) * np.int32(xq[t, xo + j]) + (q >> 4) * np.int32(xq[t, xo + j + 16])
                acc += d * xd[t, b] * np.float32(isum) + m * xs[t, b]
            out[t, r] = acc


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mm_q8_0(w, xq, xd, tbl, out):
    rows = w.shape[0]
    T, nb = xd.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 34
                d = tbl[np.int32(w[r, o]) | (np.int32(w[r, o + 1]) << 8)]
                xo = b * 32
                isum = np.int32(0)
                for j in range(32):
                    isum += np.int32(np.int8(w[r, o + 2 + j])) * np.int32(xq[t, xo + j])
                acc += d * xd[t, b] * np.float32(isum)
            out[t, r] = acc


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mm_f16(w, x, tbl, out):
    rows, cols = w.shape
    T = x.shape[0]
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for c in range(cols):
                acc += tbl[w[r, c]] * x[t, c]
            out[t, r] = acc


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mm_f32(w, x, out):
    rows, cols = w.shape
    T = x.shape[0]
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for c in range(cols):
                acc += w[r, c] * x[t, c]
            out[t, r] = acc


def matmul(w_data: np.ndarray, qtype: QType, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W.T for a native-format W (rows, cols) and activations x (T, cols) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        return matmul(w_data, qtype, x[None, :], None if out is None else out[None, :])[0]
    rows = w_data.shape[0]
    if out is None:
        out = np.empty((x.shape[0], rows), np.float32)
    if qtype == QType.F32:
        _mm_f32(w_data, x, out)
    elif qtype == QType.F16:
        # GGML converts the activations to f16 for an f16 weight.
        _mm_f16(w_data.view(np.uint16), _round_f16(x), F16_TO_F32, out)
    else:
        xq, xd, xs = quantize_activations(x)
        if qtype == QType.Q4_1:
            _mm_q4_1(w_data, xq, xd, xs, F16_TO_F32, out)
        elif qtype == QType.Q4_0:
            _mm_q4_0(w_data, xq, xd, F16_TO_F32, out)
        elif qtype == QType.Q8_0:
            _mm_q8_0(w_data, xq, xd, F16_TO_F32, out)
        else:
            raise ValueError(f"no kernel for {qtype!r}")
    return out


def matmul_ref(w_data: np.ndarray, qtype: QType, x: np.ndarray) -> np.ndarray:
    """numpy reference of `matmul`: the same activation quantization, then exact block sums."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    qtype = QType(qtype)
    if qtype == QType.F32:
        return (x.astype(np.float64) @ w_data.astype(np.float64).T).astype(np.float32)
    if qtype == QType.F16:
        return (_round_f16(x).astype(np.float64) @ w_data.astype(np.float64).T).astype(np.float32)
    fmt = FORMATS[qtype]
    rows = w_data.shape[0]
    blocks = w_data.reshape(rows, -1, fmt.block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # (rows, nb)
    # integer weight values per block, without the scale (and for Q4_0 centred at 0)
    if qtype == QType.Q8_0:
        wq = blocks[..., 2:].view(np.int8).astype(np.int64)
    else:
        qs = blocks[..., 2:] if qtype == QType.Q4_0 else blocks[..., 4:]
        wq = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
        if qtype == QType.Q4_0:
            wq -= 8
    xq, xd, xs = quantize_activations_ref(x)
    T = x.shape[0]
    xqb = xq.reshape(T, -1, QK).astype(np.int64)
    isum = np.einsum("rbj,tbj->trb", wq, xqb)  # exact integer block dots
    out = (isum * d[None] * xd[:, None, :].astype(np.float64)).sum(-1)
    if qtype == QType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += (m[None] * xs[:, None, :].astype(np.float64)).sum(-1)
    return out.astype(np.float32)
