"""A matmul's input in the forms the kernels read: Q8 per 32-block (GGML's block_q8_0 / q8_1, for
Q4_0 ... IQ4_NL weights), Q8_K per 256 (the K-quants') and f16 bits (F16 weights), each quantizer a
numba kernel beside its numpy reference. Kept apart from matmul.py because the forms outlive one
product: `Activations` computes each form once for the matmuls that share an input, and a Q8
form travels between nodes as it is (--sync-dtype q80).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import QK
from . import CACHE, PARALLEL, SERIAL_VALUES
from .simd import (F32, I8, I16, I32, I64, LANES, X86_WIDE_RUNS, call_llvm, const_vec, load_at, round_to_f16, row_ptr,
                   splat, vec)

# A pair of rows packed side by side meets a block's values in 16 lanes of four (simd_q8._emit_pair_dots:
# lanes 0-7 the low nibbles, values 0-15; lanes 8-15 the high ones, values 16-31): PAIR_LANE_ROWS[k] is
# which of the two rows lane k serves, PAIR_LANE_QUADS[k] which four values (4q .. 4q+3). The rows one
# after the other (row 2p's four lanes, then row 2p+1's), or with PAIR_LANES_ALTERNATE (the 512-bit
# halves of Intel's AVX-512, simd.X86_WIDE_RUNS) lane by lane, so that a pair's two scales are one
# 64-bit broadcast load rather than eight lanes each worked out on the ports the dots need. The packed
# rows' quants (packing.py) and the activations' paired layout follow it.
PAIR_LANES_ALTERNATE = X86_WIDE_RUNS
PAIR_LANE_ROWS = tuple(k % 2 if PAIR_LANES_ALTERNATE else k % 8 // 4 for k in range(16))
PAIR_LANE_QUADS = tuple(4 * (k // 8) + (k % 8 // 2 if PAIR_LANES_ALTERNATE else k % 4) for k in range(16))
# the value of a block that each of the 64 bytes of its 16 lanes meets (lane k's bytes 4k .. 4k+3)
PAIR_LANE_VALUES = tuple(4 * quad + i for quad in PAIR_LANE_QUADS for i in range(4))


def round_f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _emit_q8_block(builder, x_row, q_row, d_row, ds_row, b, paired_row=None, bias=None):
    """IR of block b (32 values) of one row, as GGML's quantize_row_q8_1: amax = max |x|, q =
    rint(x * (127 / amax)) (0 for an all-zero block; halves to even, as its SIMD path), d = amax / 127
    and d * sum(q), both rounded to f16. paired_row: also the block in the paired layout (each
    lane's four values, then -bias times their sum, as int16: pair_q8_ref)."""
    x = load_at(builder, x_row, builder.mul(b, ir.Constant(I64, 4 * QK)), F32, QK)
    # |x| as bits: their unsigned maximum is the floats' (a NaN above every number, as numpy's max)
    magnitudes = builder.and_(builder.bitcast(x, vec(I32, QK)), const_vec(I32, [0x7FFFFFFF] * QK))
    amax = builder.bitcast(call_llvm(builder, "llvm.vector.reduce.umax.v32i32", I32, magnitudes), F32)
    zero = ir.Constant(F32, 0.0)
    inv = builder.select(builder.fcmp_ordered("==", amax, zero), zero, builder.fdiv(ir.Constant(F32, 127.0), amax))
    scaled = builder.fmul(x, splat(builder, inv, QK))
    q = builder.fptosi(call_llvm(builder, "llvm.rint.v32f32", vec(F32, QK), scaled), vec(I32, QK))
    q8 = builder.trunc(q, vec(I8, QK))
    builder.store(q8, builder.bitcast(builder.gep(q_row, [builder.mul(b, ir.Constant(I64, QK))]),
                                      vec(I8, QK).as_pointer()), align=1)
    d = builder.fdiv(amax, ir.Constant(F32, 127.0))
    total = builder.sitofp(call_llvm(builder, "llvm.vector.reduce.add.v32i32", I32, q), F32)
    for value, row in ((d, d_row), (builder.fmul(d, total), ds_row)):
        builder.store(round_to_f16(builder, value), builder.gep(row, [b]))  # (d*s in f32 first)
    if paired_row is not None:
        at = builder.gep(paired_row, [builder.mul(b, ir.Constant(I64, PAIRED_BLOCK_BYTES))])
        halves = builder.shuffle_vector(q8, q8, const_vec(I32, PAIR_LANE_VALUES))
        builder.store(halves, builder.bitcast(at, vec(I8, 2 * QK).as_pointer()), align=1)
        fours = [builder.shuffle_vector(q, q, const_vec(I32, range(i, QK, 4))) for i in range(4)]  # exact integers
        sums = builder.mul(builder.add(builder.add(fours[0], fours[1]), builder.add(fours[2], fours[3])),
                           splat(builder, builder.neg(bias), LANES))
        lanes = builder.shuffle_vector(builder.trunc(sums, vec(I16, LANES)), ir.Constant(vec(I16, LANES), None),
                                       const_vec(I32, PAIR_LANE_QUADS))
        builder.store(lanes, builder.bitcast(builder.gep(at, [ir.Constant(I64, 2 * QK)]), vec(I16, 16).as_pointer()),
                      align=1)


def _q8_row_codegen(paired: bool):
    """Codegen of (x, t, xq, xd, xds[, bias, out]): row t of x (rows contiguous) into Q8 blocks."""
    def codegen(context, builder, signature, args):
        ty = signature.args
        t = context.cast(builder, args[1], ty[1], types.intp)
        x_row = row_ptr(context, builder, ty[0], args[0], t)
        q_row = row_ptr(context, builder, ty[2], args[2], t)
        d_row, ds_row = (builder.bitcast(row_ptr(context, builder, ty[i], args[i], t), F32.as_pointer())
                         for i in (3, 4))
        paired_row = row_ptr(context, builder, ty[6], args[6], t) if paired else None
        bias = builder.trunc(context.cast(builder, args[5], ty[5], types.int64), I32) if paired else None
        blocks = builder.extract_value(context.make_array(ty[3])(context, builder, args[3]).shape, 1)
        with cgutils.for_range(builder, blocks) as loop:
            _emit_q8_block(builder, x_row, q_row, d_row, ds_row, loop.index, paired_row, bias)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _quantize_q8_row(typingctx, x, t, xq, xd, xds):
    """Row t of x (T, cols) float32 into xq (T, cols) int8 and xd, xds (T, cols / 32) float32: one
    vector operation per step of the block (8 rows of 576: 3.1 -> 1.8 us, Sapphire Rapids, 1 core;
    the loop numba wrote took the block's maximum one value at a time)."""
    return types.void(x, t, xq, xd, xds), _q8_row_codegen(paired=False)


@intrinsic
def _quantize_q8_row_paired(typingctx, x, t, xq, xd, xds, bias, out):
    """_quantize_q8_row, and the row's paired layout (bias 0-16) into out (T, blocks * PAIRED_BLOCK_BYTES)."""
    return types.void(x, t, xq, xd, xds, bias, out), _q8_row_codegen(paired=True)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _quantize_q8(x, xq, xd, xds):
    if x.size <= SERIAL_VALUES:  # a few rows: no thread team
        for t in range(x.shape[0]):
            _quantize_q8_row(x, t, xq, xd, xds)
    else:
        for t in prange(x.shape[0]):
            _quantize_q8_row(x, t, xq, xd, xds)


# The paired layout of Q8 values (what the prefill tiles of rows packed in pairs read, simd_q8.py), per
# 32-value block: the four values of each of a pair's 16 lanes (PAIR_LANE_QUADS: with the rows one after
# the other, values 0-15 twice, then 16-31 twice), then 16 int16: -bias times each lane's four values' sum
PAIRED_BLOCK_BYTES = 96
_LANE_QUADS = np.array(PAIR_LANE_QUADS, np.int64)


@njit(inline="always", nogil=True, cache=CACHE)
def _pair_q8_row(q, q32, bias, out32, sums, t):
    """Row t of the layout: each lane's four values copied as one uint32 (q32, out32: q's and out's
    bytes as uint32), then its sum."""
    for b in range(q.shape[1] // 32):
        for k in range(16):
            quad = _LANE_QUADS[k]
            out32[t, (PAIRED_BLOCK_BYTES // 4) * b + k] = q32[t, 8 * b + quad]
            at = 32 * b + 4 * quad
            s = np.int32(q[t, at]) + q[t, at + 1] + q[t, at + 2] + q[t, at + 3]
            sums[t, (PAIRED_BLOCK_BYTES // 2) * b + 32 + k] = -bias * s


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _pair_q8(q, bias, out):
    """out (T, blocks * PAIRED_BLOCK_BYTES) int8: q's paired layout."""
    q32, out32, sums = q.view(np.uint32), out.view(np.uint32), out.view(np.int16)
    for t in prange(q.shape[0]):
        _pair_q8_row(q, q32, bias, out32, sums, t)


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _quantize_q8_paired(x, xq, xd, xds, bias, out):
    """_quantize_q8 and _pair_q8 in one pass (each block still in registers)."""
    if x.size <= SERIAL_VALUES:  # as _quantize_q8
        for t in range(x.shape[0]):
            _quantize_q8_row_paired(x, t, xq, xd, xds, bias, out)
    else:
        for t in prange(x.shape[0]):
            _quantize_q8_row_paired(x, t, xq, xd, xds, bias, out)


def pair_q8_ref(q: np.ndarray, bias: int) -> np.ndarray:
    """numpy reference of Q8Activations.paired."""
    quads = q.reshape(q.shape[0], -1, 8, 4)[:, :, list(PAIR_LANE_QUADS)]  # (T, blocks, 16 lanes, 4)
    sums = np.ascontiguousarray((-bias * quads.astype(np.int32).sum(axis=-1)).astype("<i2"))
    values = quads.reshape(*quads.shape[:2], 64)
    return np.concatenate([values, sums.view(np.int8)], axis=-1).reshape(q.shape[0], -1)


# The starts layout of Q8 values (what Q8_0's 512-bit tiles read, simd_q8.py), per 32-value block: the
# values, then 8 int32: -STARTS_BIAS times the sum of values 4k .. 4k+3, where the quad dot of weights
# biased to unsigned bytes starts in lane k (one load a token, where working it out took three
# instructions on the ports the dots need)
STARTS_BLOCK_BYTES = 64
STARTS_BIAS = 128


@njit(inline="always", nogil=True, cache=CACHE)
def _q8_starts_row(q, q64, out64, starts, t):
    for b in range(q.shape[1] // 32):
        for j in range(4):  # the values, 8 bytes at a time
            out64[t, (STARTS_BLOCK_BYTES // 8) * b + j] = q64[t, 4 * b + j]
        for k in range(8):
            at = 32 * b + 4 * k
            s = np.int32(q[t, at]) + q[t, at + 1] + q[t, at + 2] + q[t, at + 3]
            starts[t, (STARTS_BLOCK_BYTES // 4) * b + 8 + k] = -STARTS_BIAS * s


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _q8_starts(q, out):
    """out (T, blocks * STARTS_BLOCK_BYTES) int8: q's starts layout."""
    q64, out64, starts = q.view(np.uint64), out.view(np.uint64), out.view(np.int32)
    if q.size <= SERIAL_VALUES:  # as _quantize_q8
        for t in range(q.shape[0]):
            _q8_starts_row(q, q64, out64, starts, t)
    else:
        for t in prange(q.shape[0]):
            _q8_starts_row(q, q64, out64, starts, t)


def q8_starts_ref(q: np.ndarray) -> np.ndarray:
    """numpy reference of Q8Activations.with_starts."""
    blocks = q.reshape(q.shape[0], -1, 32)
    starts = (-STARTS_BIAS * blocks.reshape(*blocks.shape[:2], 8, 4).astype(np.int32).sum(axis=-1)).astype("<i4")
    return np.concatenate([blocks, starts.view(np.int8)], axis=-1).reshape(q.shape[0], -1)


def _float_rows(x: np.ndarray) -> np.ndarray:
    """x as the Q8 quantizers read it: float32, rows contiguous (usually as it comes: no copy)."""
    return x if x.dtype == np.float32 and x.flags.c_contiguous else np.ascontiguousarray(x, np.float32)


def _paired_out(T: int, cols: int, bias: int) -> np.ndarray:
    if not 0 <= bias <= 16:
        raise ValueError(f"the paired layout's sums hold a bias of 0-16, not {bias}")
    return np.empty((T, cols // QK * PAIRED_BLOCK_BYTES), np.int8)


class _QuantizedRows:
    """A quantized form of x (T, cols): the arrays named by a subclass's __slots__, one row per token."""

    __slots__ = ()

    def __init__(self, *arrays):
        # the kernels step from row to row by the first stride and read each row as contiguous: an
        # array assembled from others (a Q8 gather with empty parts) can come out column-major
        for name, a in zip(self.__slots__, arrays, strict=True):
            setattr(self, name, np.ascontiguousarray(a))

    @classmethod
    def _of_new(cls, *arrays):
        """From arrays just made C-contiguous (a quantizer's): no checks, a decode step makes ~150."""
        self = cls.__new__(cls)
        for name, a in zip(self.__slots__, arrays):
            setattr(self, name, a)
        return self

    def take(self, index: np.ndarray):
        """The rows `index`: each row is quantized on its own, so they are the same bits as anew."""
        return type(self)(*(getattr(self, name)[index] for name in self.__slots__))


class Q8Activations(_QuantizedRows):
    """x (T, cols) quantized to Q8 per 32-block: q int8, d (rounded to f16), ds = d*sum(q)
    (rounded to f16: GGML's block_q8_1 s field, which Q4_1's dot product needs)."""

    __slots__ = ("q", "d", "ds")

    @classmethod
    def quantize(cls, x: np.ndarray) -> "Q8Activations":
        x = _float_rows(x)
        T, cols = x.shape
        q = np.empty((T, cols), np.int8)
        d = np.empty((T, cols // QK), np.float32)
        ds = np.empty((T, cols // QK), np.float32)
        _quantize_q8(x, q, d, ds)
        return cls._of_new(q, d, ds)

    @classmethod
    def quantize_paired(cls, x: np.ndarray, bias: int) -> tuple["Q8Activations", np.ndarray]:
        """quantize(x) and its paired(bias) layout, made in one pass."""
        x = _float_rows(x)
        T, cols = x.shape
        q = np.empty((T, cols), np.int8)
        d = np.empty((T, cols // QK), np.float32)
        ds = np.empty((T, cols // QK), np.float32)
        out = _paired_out(T, cols, bias)
        _quantize_q8_paired(x, q, d, ds, bias, out)
        return cls._of_new(q, d, ds), out

    def paired(self, bias: int) -> np.ndarray:
        """q in the paired layout (PAIRED_BLOCK_BYTES per block), its sums times -bias (|bias| <= 16:
        int16 holds them)."""
        T, cols = self.q.shape
        out = _paired_out(T, cols, bias)
        _pair_q8(self.q, bias, out)
        return out

    def with_starts(self) -> np.ndarray:
        """q in the starts layout (STARTS_BLOCK_BYTES per block)."""
        T, cols = self.q.shape
        out = np.empty((T, cols // QK * STARTS_BLOCK_BYTES), np.int8)
        _q8_starts(self.q, out)
        return out

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


@njit(inline="always", nogil=True, cache=CACHE)
def _quantize_q8_k_row(x, xq, xd, xs, t):
    """GGML's quantize_row_q8_K_ref: per 256 values, the signed extreme maps to -127."""
    cols = x.shape[1]
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


@njit(parallel=PARALLEL, nogil=True, cache=CACHE)
def _quantize_q8_k(x, xq, xd, xs):
    if x.size <= SERIAL_VALUES:  # as _quantize_q8
        for t in range(x.shape[0]):
            _quantize_q8_k_row(x, xq, xd, xs, t)
    else:
        for t in prange(x.shape[0]):
            _quantize_q8_k_row(x, xq, xd, xs, t)


class Q8KActivations(_QuantizedRows):
    """x (T, cols) quantized to Q8_K per 256 values (the K-quants' activations): q int8, d f32
    scale per 256, sums: int32 sum of every 16 q."""

    __slots__ = ("q", "d", "sums")

    @classmethod
    def quantize(cls, x: np.ndarray) -> "Q8KActivations":
        T, cols = x.shape
        if cols % 256:
            raise ValueError(f"Q8_K needs rows of a multiple of 256 values, not {cols}")
        q = np.empty((T, cols), np.int8)
        d = np.empty((T, cols // 256), np.float32)
        sums = np.empty((T, cols // 16), np.int32)
        _quantize_q8_k(x, q, d, sums)
        return cls._of_new(q, d, sums)

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


class Activations:
    """Activations x (T, cols) float32, with the forms the kernels read computed once on first
    use, so the matmuls that share an input (Q, K, V; gate and up) quantize it once."""

    __slots__ = ("x", "_q8", "_q8k", "_f16", "_f16_values", "_paired", "_starts")

    def __init__(self, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.x = x[None, :] if x.ndim == 1 else x
        self._q8 = self._q8k = self._f16 = self._f16_values = self._starts = None
        self._paired = {}

    @classmethod
    def from_q8(cls, q8: Q8Activations) -> "Activations":
        """Activations known only in their Q8 form (gathered from other nodes as blocks): they
        feed Q4_0/Q4_1/Q8_0 matmuls, which read nothing else."""
        self = cls.__new__(cls)
        self.x, self._q8, self._q8k, self._f16, self._f16_values, self._paired = None, q8, None, None, None, {}
        self._starts = None
        return self

    def take(self, index: np.ndarray) -> "Activations":
        """The rows `index` (in that order), with the forms computed so far: each row is quantized
        on its own, so a row's blocks are the same bits taken from here or computed anew."""
        out = Activations.__new__(Activations)
        out.x = None if self.x is None else self.x[index]
        out._q8 = None if self._q8 is None else self._q8.take(index)
        out._q8k = None if self._q8k is None else self._q8k.take(index)
        out._f16 = None if self._f16 is None else self._f16[index]
        out._f16_values = None if self._f16_values is None else self._f16_values[index]
        out._paired = {bias: paired[index] for bias, paired in self._paired.items()}
        out._starts = None if self._starts is None else self._starts[index]
        return out

    @property
    def tokens(self) -> int:
        return (self.x if self.x is not None else self._q8.q).shape[0]

    @property
    def q8(self) -> Q8Activations:
        if self._q8 is None:
            self._q8 = Q8Activations.quantize(self.x)
        return self._q8

    def q8_paired(self, bias: int) -> np.ndarray:
        """q8's values in the paired layout with sums times -bias (the prefill tiles of rows packed in
        pairs), computed once per bias."""
        if bias not in self._paired:
            if self._q8 is None:  # (the usual case: both made at once)
                self._q8, self._paired[bias] = Q8Activations.quantize_paired(self.x, bias)
            else:
                self._paired[bias] = self._q8.paired(bias)
        return self._paired[bias]

    def q8_starts(self) -> np.ndarray:
        """q8's values in the starts layout (the tiles of Q8_0 rows on Intel's AVX-512), computed once."""
        if self._starts is None:
            self._starts = self.q8.with_starts()
        return self._starts

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

    @property
    def f16_values(self) -> np.ndarray:
        """f16_bits' values as float32 (exact), which the F16 prefill tiles read."""
        if self._f16_values is None:
            self._f16_values = self.f16_bits.view(np.float16).astype(np.float32)
        return self._f16_values
