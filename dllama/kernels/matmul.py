"""Quantized matrix products, numba kernels beside their numpy reference.

As in llama.cpp, the activations are quantized per 32-block to 8 bits (GGML's Q8_0 / Q8_1:
int8 values, an f16 scale d and, for Q4_1, the f16 product d*sum(q)), so the inner loop is an
integer dot of one weight block with one activation block (`simd.py`) and scales are applied
once per block. The block dot products and their float accumulation order are in `simd.py`.

`matmul(w, qtype, x)` takes x of shape (T, cols) and returns (T, rows): T = 1 is the decode
matvec, T > 1 the batched prefill, where each weight row is read once for all T tokens.
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit, prange

from ..quant import FORMATS, QK, QType, dequantize
from .simd import (dot_f16_f16_vec, dot_f32_f32_vec, dot_iq4_nl_q8, dot_iq4_nl_q8_wide, dot_q4_0_q8,
                   dot_q4_0_q8_wide, dot_q4_1_q8, dot_q4_1_q8_wide, dot_q4_k_q8k, dot_q4_k_q8k_wide, dot_q5_0_q8,
                   dot_q5_0_q8_wide, dot_q5_1_q8, dot_q5_1_q8_wide, dot_q5_k_q8k, dot_q5_k_q8k_wide, dot_q6_k_q8k,
                   dot_q6_k_q8k_wide, dot_q8_0_q8, dot_q8_0_q8_wide, f16_at)

CACHE = "DLLAMA_NO_JIT_CACHE" not in os.environ  # set it to inspect the generated assembly
# every f16 bit pattern -> f32. On aarch64 numpy casts in hardware, which quiets the signalling NaNs
# and flags it ("invalid value encountered in cast"); they stay NaNs, so the flag is noise.
with np.errstate(invalid="ignore"):
    F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def round_f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


# ------------------------------------------------------------------ activation quantization


@njit(parallel=True, nogil=True, cache=CACHE)
def _quantize_q8(x, xq, xd, xds):
    T, cols = x.shape
    for t in prange(T):
        for b in range(cols // 32):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, o + j]))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[t, o + j] * inv))  # round half to even, as GGML's SIMD path
                xq[t, o + j] = q
                s += q
            d = amax / np.float32(127.0)
            xd[t, b] = d
            xds[t, b] = d * np.float32(s)  # in f32, as GGML, before rounding to f16


class Q8Activations:
    """x (T, cols) quantized to Q8 per 32-block: q int8, d (rounded to f16), ds = d*sum(q)
    (rounded to f16: GGML's block_q8_1 s field, which Q4_1's dot product needs)."""

    __slots__ = ("q", "d", "ds")

    def __init__(self, q, d, ds):
        # the kernels step from row to row by the first stride and read each row as contiguous: an
        # array assembled from others (a Q8 gather with empty parts) can come out column-major
        self.q, self.d, self.ds = (np.ascontiguousarray(a) for a in (q, d, ds))

    @classmethod
    def quantize(cls, x: np.ndarray) -> "Q8Activations":
        T, cols = x.shape
        q = np.empty((T, cols), np.int8)
        d = np.empty((T, cols // QK), np.float32)
        ds = np.empty((T, cols // QK), np.float32)
        _quantize_q8(x, q, d, ds)
        return cls(q, round_f16(d), round_f16(ds))

    @classmethod
    def quantize_ref(cls, x: np.ndarray) -> "Q8Activations":
        T, cols = x.shape
        xb = x.reshape(T, -1, QK).astype(np.float32)
        amax = np.abs(xb).max(axis=-1)
        inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax != 0)
        q = np.rint(xb * inv[..., None]).astype(np.int8)
        d = amax / np.float32(127.0)
        total = q.astype(np.int32).sum(axis=-1).astype(np.float32)
        return cls(q.reshape(T, cols), round_f16(d), round_f16(d * total))


@njit(parallel=True, nogil=True, cache=CACHE)
def _quantize_q8_k(x, xq, xd, xs):
    """GGML's quantize_row_q8_K_ref: per 256 values, the signed extreme maps to -127."""
    T, cols = x.shape
    for t in prange(T):
        for b in range(cols // 256):
            o = b * 256
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(256):
                a = abs(x[t, o + j])
                if a > amax:
                    amax, vmax = a, x[t, o + j]
            if amax == 0:
                xd[t, b] = 0.0
                for j in range(256):
                    xq[t, o + j] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for j in range(256):
                    xq[t, o + j] = min(127, np.int32(np.rint(iscale * x[t, o + j])))
                xd[t, b] = np.float32(1.0) / iscale
            for g in range(16):
                s = 0
                for j in range(16):
                    s += xq[t, o + 16 * g + j]
                xs[t, 16 * b + g] = s


class Q8KActivations:
    """x (T, cols) quantized to Q8_K per 256 values (the K-quants' activations): q int8, d f32
    scale per 256, sums: int32 sum of every 16 q."""

    __slots__ = ("q", "d", "sums")

    def __init__(self, q, d, sums):
        self.q, self.d, self.sums = (np.ascontiguousarray(a) for a in (q, d, sums))

    @classmethod
    def quantize(cls, x: np.ndarray) -> "Q8KActivations":
        T, cols = x.shape
        if cols % 256:
            raise ValueError(f"Q8_K needs rows of a multiple of 256 values, not {cols}")
        q = np.empty((T, cols), np.int8)
        d = np.empty((T, cols // 256), np.float32)
        sums = np.empty((T, cols // 16), np.int32)
        _quantize_q8_k(x, q, d, sums)
        return cls(q, d, sums)

    @classmethod
    def quantize_ref(cls, x: np.ndarray) -> "Q8KActivations":
        T, cols = x.shape
        xb = x.reshape(T, -1, 256).astype(np.float32)
        vmax = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        with np.errstate(divide="ignore"):
            iscale = np.where(vmax != 0, np.float32(-127.0) / vmax, np.float32(0))
        q = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int8)
        with np.errstate(divide="ignore"):
            d = np.where(iscale != 0, np.float32(1.0) / iscale, np.float32(0)).astype(np.float32)
        sums = q.reshape(T, -1, 16).astype(np.int32).sum(-1)
        return cls(q.reshape(T, cols), d, sums)


# ------------------------------------------------------------------ kernels
# out[t, r] = dot(row r of w, activation t). prange over rows: the weights are the big operand,
# and each row is read once for all T tokens.

_Q4_0, _Q4_1, _Q8_0, _Q5_0, _Q5_1, _IQ4_NL = 0, 1, 2, 3, 4, 5
_Q4_K, _Q6_K, _Q5_K = 0, 1, 2


@njit(parallel=True, nogil=True, cache=CACHE)
def _mm_quant(w, fmt, wide, xq, xd, xds, out):
    """Quantized weights; wide: the float64-accumulating dot products (out is float64)."""
    T = xq.shape[0]
    for r in prange(w.shape[0]):
        for t in range(T):
            if fmt == _Q4_1:
                out[t, r] = dot_q4_1_q8_wide(w, r, xq, xd, xds, t) if wide else dot_q4_1_q8(w, r, xq, xd, xds, t)
            elif fmt == _Q4_0:
                out[t, r] = dot_q4_0_q8_wide(w, r, xq, xd, xds, t) if wide else dot_q4_0_q8(w, r, xq, xd, xds, t)
            elif fmt == _Q5_0:
                out[t, r] = dot_q5_0_q8_wide(w, r, xq, xd, xds, t) if wide else dot_q5_0_q8(w, r, xq, xd, xds, t)
            elif fmt == _Q5_1:
                out[t, r] = dot_q5_1_q8_wide(w, r, xq, xd, xds, t) if wide else dot_q5_1_q8(w, r, xq, xd, xds, t)
            elif fmt == _IQ4_NL:
                out[t, r] = dot_iq4_nl_q8_wide(w, r, xq, xd, xds, t) if wide else dot_iq4_nl_q8(w, r, xq, xd, xds, t)
            else:
                out[t, r] = dot_q8_0_q8_wide(w, r, xq, xd, xds, t) if wide else dot_q8_0_q8(w, r, xq, xd, xds, t)


@njit(parallel=True, nogil=True, cache=CACHE)
def _mm_k_quant(w, fmt, wide, xq, xd, xs, out):
    """K-quant weights against Q8_K activations; wide: float64 (out is float64)."""
    T = xq.shape[0]
    for r in prange(w.shape[0]):
        for t in range(T):
            if fmt == _Q4_K:
                out[t, r] = dot_q4_k_q8k_wide(w, r, xq, xd, xs, t) if wide else dot_q4_k_q8k(w, r, xq, xd, xs, t)
            elif fmt == _Q5_K:
                out[t, r] = dot_q5_k_q8k_wide(w, r, xq, xd, xs, t) if wide else dot_q5_k_q8k(w, r, xq, xd, xs, t)
            else:
                out[t, r] = dot_q6_k_q8k_wide(w, r, xq, xd, xs, t) if wide else dot_q6_k_q8k(w, r, xq, xd, xs, t)


@njit(nogil=True, cache=CACHE)
def dot_f16(a, a_offset, b, b_offset, n):
    """sum of the n f16 values at element offsets a_offset of a and b_offset of b (uint16 arrays of
    f16 bits, addressed from their data pointers), in the order of llama.cpp's single-token routine
    ggml_vec_dot_f16 (its decode path), plus a float64 tail past the last multiple of 32 as it adds
    one. The F16 matmul and the attention use it for every token, so a token's result does not
    depend on how many are computed together."""
    main = n - n % 32
    total = np.float64(dot_f16_f16_vec(a, a_offset, b, b_offset, main))
    for i in range(main, n):
        total += np.float64(f16_at(a, a_offset + i) * f16_at(b, b_offset + i))
    return np.float32(total)


@njit(parallel=True, nogil=True, cache=CACHE)
def _mm_f16(w, x16, out):
    rows, cols = w.shape
    T = x16.shape[0]
    row_stride = w.strides[0] // 2  # in elements; rows of a column slice are not adjacent
    for r in prange(rows):
        for t in range(T):
            out[t, r] = dot_f16(w, r * row_stride, x16, t * cols, cols)


@njit(parallel=True, nogil=True, cache=CACHE)
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


@njit(parallel=True, nogil=True, cache=CACHE)
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


@njit(parallel=True, nogil=True, cache=CACHE)
def _mm_f16_wide(w, x16, tbl, out):
    rows, cols = w.shape
    T = x16.shape[0]
    for r in prange(rows):
        for t in range(T):
            acc = 0.0
            for c in range(cols):
                acc += np.float64(tbl[w[r, c]]) * np.float64(tbl[x16[t, c]])
            out[t, r] = acc


_K_KERNEL = {QType.Q4_K: _Q4_K, QType.Q5_K: _Q5_K, QType.Q6_K: _Q6_K}
_QUANT_KERNEL = {QType.Q4_0: _Q4_0, QType.Q4_1: _Q4_1, QType.Q8_0: _Q8_0, QType.Q5_0: _Q5_0, QType.Q5_1: _Q5_1,
                 QType.IQ4_NL: _IQ4_NL}


class Activations:
    """Activations x (T, cols) float32, with the forms the kernels read computed once on first
    use, so the matmuls that share an input (Q, K, V; gate and up) quantize it once."""

    __slots__ = ("x", "_q8", "_q8k", "_f16")

    def __init__(self, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.x = x[None, :] if x.ndim == 1 else x
        self._q8 = self._q8k = self._f16 = None

    @classmethod
    def from_q8(cls, q8: Q8Activations) -> "Activations":
        """Activations known only in their Q8 form (gathered from other nodes as blocks): they
        feed Q4_0/Q4_1/Q8_0 matmuls, which read nothing else."""
        self = cls.__new__(cls)
        self.x, self._q8, self._q8k, self._f16 = None, q8, None, None
        return self

    def take(self, index: np.ndarray) -> "Activations":
        """The rows `index` (in that order), with the forms computed so far: each row is quantized
        on its own, so a row's blocks are the same bits taken from here or computed anew."""
        out = Activations.__new__(Activations)
        out.x = None if self.x is None else self.x[index]
        out._q8 = None if self._q8 is None else Q8Activations(self._q8.q[index], self._q8.d[index],
                                                               self._q8.ds[index])
        out._q8k = None if self._q8k is None else Q8KActivations(self._q8k.q[index], self._q8k.d[index],
                                                                   self._q8k.sums[index])
        out._f16 = None if self._f16 is None else self._f16[index]
        return out

    @property
    def tokens(self) -> int:
        return (self.x if self.x is not None else self._q8.q).shape[0]

    @property
    def q8(self) -> Q8Activations:
        if self._q8 is None:
            self._q8 = Q8Activations.quantize(self.x)
        return self._q8

    @property
    def q8k(self) -> Q8KActivations:
        if self._q8k is None:
            self._q8k = Q8KActivations.quantize(self.x)
        return self._q8k

    @property
    def f16_bits(self) -> np.ndarray:  # GGML converts the activations to f16 for an f16 weight
        if self._f16 is None:
            self._f16 = self.x.astype(np.float16).view(np.uint16)
        return self._f16


def matmul(w: np.ndarray, qtype: QType, x, out: np.ndarray | None = None, wide: bool = False) -> np.ndarray:
    """out = x @ W.T for W (rows, cols) in a native format; x is (T, cols) or (cols,) float32, or
    an `Activations`. The result is (T, rows), or (rows,) for a 1-D x.
    wide: accumulate and return float64, so that partial sums over column slices add up to the
    whole product up to float64 rounding (the exact reduction mode of the cluster)."""
    if not isinstance(x, Activations):
        if np.ndim(x) == 1:
            return matmul(w, qtype, Activations(x), None if out is None else out[None, :], wide)[0]
        x = Activations(x)
    if out is None:
        out = np.empty((x.tokens, w.shape[0]), np.float64 if wide else np.float32)
    if qtype in _QUANT_KERNEL:
        a = x.q8
        _mm_quant(w, _QUANT_KERNEL[qtype], wide, a.q, a.d, a.ds, out)
        return out
    if qtype in _K_KERNEL:
        k = x.q8k
        _mm_k_quant(w, _K_KERNEL[qtype], wide, k.q, k.d, k.sums, out)
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
        _mm_f16(w.view(np.uint16), x.f16_bits, out)
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
    isum = np.einsum("rbj,tbj->trb", wq, xq)
    out = (isum * d[None] * a.d[:, None, :].astype(np.float64)).sum(-1)
    if qtype in (QType.Q4_1, QType.Q5_1):
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += (m[None] * a.ds[:, None, :].astype(np.float64)).sum(-1)
    return out.astype(np.float32)
