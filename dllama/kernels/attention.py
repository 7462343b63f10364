"""Causal attention over an f16 KV cache and the softmax it sums with, numba kernels beside their
numpy references. Apart from ops.py's per-token ops because it alone reads across positions, with
rounding rules of its own, llama.cpp's single-token path: queries and softmax weights are rounded
to f16 before meeting the cache, dot products run in ggml_vec_dot_f16's order, exp is GGML's
polynomial (ops.expf), the softmax sums groups of 8 in double.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import CACHE
from .activations import round_f16
from .matmul import dot_f16
from .ops import expf
from .simd_float import f16_bits, hsum8

# ------------------------------------------------------------------ softmax


@njit(nogil=True, cache=CACHE, inline="always")
def _softmax_row(x, lo, n):
    """softmax of x[lo:n] in place, as GGML's soft_max over a row where masked (-inf) entries
    fill [0, lo) and pad n to a multiple of 8: exp by its polynomial, then 8-lane group sums added
    in float64. x[:lo] and x[n:] up to the next multiple of 8 must be zeros (what the masked
    entries' exp gives)."""
    top = -np.inf
    for i in range(lo, n):
        top = max(top, x[i])
    for i in range(lo, n):
        x[i] = expf(x[i] - top)
    total = 0.0
    for g in range(lo - lo % 8, n, 8):
        total += hsum8(x, g)
    inv = np.float32(1.0 / total)
    for i in range(lo, n):
        x[i] = x[i] * inv


@njit(parallel=True, nogil=True, cache=CACHE)
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


@njit(parallel=True, nogil=True, cache=CACHE)
def _attention(q16, k_cache, v_cache_t, T, Hq, D, ctx, kv_of_head, start, scale, window, out):
    """Causal attention of the queries at positions start..start+T-1 (over the last `window`
    positions if window > 0).
    q16 (T, Hq, D), k_cache (Hkv, ctx, D), v_cache_t (Hkv, D, ctx): f16 bits, flattened and
    addressed by offsets (a per-row view would cost an atomic reference count update in the
    parallel loop); out (T, Hq, D) f32. Each (token, head) is computed as llama.cpp computes a
    single token, whatever T is: the result does not depend on how the tokens were batched."""
    pad = 32  # the vector dot's step; the masked cells past n add exact zeros, as GGML's
    for job in prange(T * Hq):
        t, h = job // Hq, job % Hq
        kv = kv_of_head[h]
        n = start + t + 1
        lo = max(0, n - window) if window > 0 else 0  # masked before: weight 0 in its cache cell
        n_pad = min((n + pad - 1) // pad * pad, ctx)
        weights = np.zeros(n_pad, np.float32)
        for s in range(lo, n):
            weights[s] = dot_f16(k_cache, (kv * ctx + s) * D, q16, (t * Hq + h) * D, D) * scale
        _softmax_row(weights, lo, n)
        probs16 = np.zeros(n_pad, np.uint16)
        for s in range(lo, n):
            probs16[s] = f16_bits(weights[s])
        for d in range(D):
            out[t, h, d] = dot_f16(v_cache_t, (kv * D + d) * ctx, probs16, 0, n_pad)


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
    out = np.empty((T, Hq, D), np.float32)
    scale = np.float32(1.0) / np.sqrt(np.float32(D)) if scale is None else np.float32(scale)
    _attention(q.astype(np.float16).view(np.uint16).reshape(-1), k_cache.view(np.uint16).reshape(-1),
               v_cache_t.view(np.uint16).reshape(-1), T, Hq, D, k_cache.shape[1], kv_of_head, start, scale,
               window, out)
    return out


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
