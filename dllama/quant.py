"""Weight formats held natively in RAM, as a small typed table (in the spirit of gguf-py).

A quantized matrix is a uint8 array of shape (rows, row_bytes): each row is a run of blocks of
32 values in GGML's byte layout, exactly as in the GGUF file. Keeping the file layout means a
weight slice for a worker is a plain byte range, and the 1-node engine can run straight off the
memory map. F16/F32 matrices are plain (rows, cols) arrays.

Each format has a numpy reference quantizer and dequantizer here; the numba kernels in
`dllama.kernels` are checked against them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf import quants as gguf_quants


class QType(enum.IntEnum):
    """Native formats; values are GGML's type ids so they round-trip through GGUF unchanged."""

    F32 = int(GGML.F32)
    F16 = int(GGML.F16)
    Q4_0 = int(GGML.Q4_0)
    Q4_1 = int(GGML.Q4_1)
    Q8_0 = int(GGML.Q8_0)
    Q5_0 = int(GGML.Q5_0)
    Q5_1 = int(GGML.Q5_1)
    IQ4_NL = int(GGML.IQ4_NL)
    Q4_K = int(GGML.Q4_K)
    Q5_K = int(GGML.Q5_K)
    Q6_K = int(GGML.Q6_K)


@dataclass(frozen=True)
class Format:
    qtype: QType
    block_size: int  # values per block
    # a block's fields in the file's byte order: (name, bytes). d (f16 scale), m (f16 min), dmin (K-quants'
    # f16 scale of the mins), scales (6-bit scales and mins / int8 scales of the sub-blocks), qh (fifth
    # or high bits), qs / ql (the quants); the kernels and the packed layout (kernels/packing.py) read them
    fields: tuple[tuple[str, int], ...]

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.fields)

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_size:
            raise ValueError(f"{self.qtype.name}: row length {cols} is not a multiple of {self.block_size}")
        return cols // self.block_size * self.block_bytes

    def field_offsets(self, rows: int = 1, row: int = 0) -> dict[str, int]:
        """Byte offsets of a block's fields: in the file (rows 1), or of row `row` in a block of
        `rows` rows packed field by field (kernels/packing.py: every row's d, then every row's m, ...)."""
        offsets, at = {}, 0
        for name, size in self.fields:
            offsets[name] = rows * at + size * row
            at += size
        return offsets


FORMATS: dict[QType, Format] = {
    QType.F32: Format(QType.F32, 1, (("value", 4),)),
    QType.F16: Format(QType.F16, 1, (("value", 2),)),
    QType.Q4_0: Format(QType.Q4_0, 32, (("d", 2), ("qs", 16))),  # v = (q - 8) * d; byte k: value k low, k+16 high
    QType.Q4_1: Format(QType.Q4_1, 32, (("d", 2), ("m", 2), ("qs", 16))),  # v = q * d + m
    QType.Q8_0: Format(QType.Q8_0, 32, (("d", 2), ("qs", 32))),  # 32 int8: v = q * d
    # qh: a uint32 of fifth bits (bit j: value j): v = (q - 16) * d
    QType.Q5_0: Format(QType.Q5_0, 32, (("d", 2), ("qh", 4), ("qs", 16))),
    QType.Q5_1: Format(QType.Q5_1, 32, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))),  # v = q * d + m
    QType.IQ4_NL: Format(QType.IQ4_NL, 32, (("d", 2), ("qs", 16))),  # v = IQ4_NL_VALUES[q] * d
    # K-quants, super-blocks of 256 (matmuls against Q8_K activations): 8 sub-blocks of 32 with 6-bit
    # scales and mins packed in 12 bytes: v = d*sc*q - dmin*m; qs: 4 runs of 32 bytes, low nibbles
    # sub-block 2j, high 2j+1
    QType.Q4_K: Format(QType.Q4_K, 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128))),
    # Q4_K's fields and 32 bytes of fifth bits (bit i of byte b: sub-block i's value b)
    QType.Q5_K: Format(QType.Q5_K, 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128))),
    # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales of 16-value sub-blocks: v = d * sc * (q - 32)
    QType.Q6_K: Format(QType.Q6_K, 256, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2))),
}
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
# IQ4_NL's 16 levels (GGML's kvalues_iq4nl): denser near 0, where most weights are
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

QK = 32  # block size of every quantized native format

_INTEGER_TYPES = {GGML.I8, GGML.I16, GGML.I32, GGML.I64}


def requant_target(ggml_type: int) -> QType:
    """The native format a non-native GGUF type is converted to on load: the nearest one that
    loses no precision against it (up to 5 bits/weight -> Q4_1, more -> Q8_0, BF16 -> F16).
    Integer tensors are not weights: ValueError."""
    if ggml_type == GGML.BF16:
        return QType.F16
    if ggml_type == GGML.F64:
        return QType.F32
    if ggml_type in _INTEGER_TYPES:
        raise ValueError(f"{GGML(ggml_type).name} is not a weight type")
    block_size, type_size = GGML_QUANT_SIZES[GGML(ggml_type)]
    return QType.Q4_1 if type_size * 8 / block_size <= 5.0 else QType.Q8_0


def _split_blocks(data: np.ndarray, fmt: Format) -> np.ndarray:
    """(rows, row_bytes) uint8 -> (rows, n_blocks, block_bytes)."""
    rows = data.shape[0]
    return data.reshape(rows, -1, fmt.block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of every block, as float32."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Reference dequantizer: native (rows, row_bytes) -> float32 (rows, cols)."""
    qtype = QType(qtype)
    if qtype == QType.F32:
        return np.asarray(data, dtype=np.float32)
    if qtype == QType.F16:
        return np.asarray(data).astype(np.float32)
    fmt = FORMATS[qtype]
    if qtype in K_QUANTS:  # gguf-py's reference dequantizer (the kernels are checked against it)
        raw = np.asarray(data, dtype=np.uint8)
        return gguf_quants.dequantize(raw.reshape(raw.shape[0], -1), GGML(int(qtype))).reshape(raw.shape[0], -1)
    blocks = _split_blocks(np.asarray(data, dtype=np.uint8), fmt)
    d = _f16(blocks, 0)[..., None]
    if qtype == QType.Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        return (q * d).reshape(data.shape[0], -1)
    qs_start = fmt.field_offsets()["qs"]
    qs = blocks[..., qs_start:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # low nibbles first
    if qtype in (QType.Q5_0, QType.Q5_1):
        qh = blocks[..., qs_start - 4:qs_start].copy().view(np.uint32)
        q += 16 * ((qh >> np.arange(32, dtype=np.uint32)) & 1)
    if qtype == QType.IQ4_NL:
        out = IQ4_NL_VALUES[q.astype(np.intp)] * d
    elif qtype in (QType.Q4_0, QType.Q5_0):
        out = (q - (8.0 if qtype == QType.Q4_0 else 16.0)) * d
    else:
        out = q * d + _f16(blocks, 2)[..., None]
    return out.reshape(data.shape[0], -1)


def quantize(values: np.ndarray, qtype: QType) -> np.ndarray:
    """Reference quantizer: float (rows, cols) -> native layout. Rounds as GGML's x86 SIMD
    quantizers do (Q8_0: half to even, where GGML's scalar *_ref rounds half away from zero;
    the two differ only on exact ties)."""
    qtype = QType(qtype)
    x = np.ascontiguousarray(values, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if qtype == QType.F32:
        return x.copy()
    if qtype == QType.F16:
        return x.astype(np.float16)
    fmt = FORMATS[qtype]
    if qtype in K_QUANTS:
        raise ValueError(f"no reference quantizer for {qtype.name} here (llama.cpp's quantizer writes it)")
    rows, cols = x.shape
    fmt.row_bytes(cols)  # validates the length
    xb = x.reshape(rows, cols // QK, QK)
    if qtype == QType.Q8_0:
        amax = np.abs(xb).max(axis=-1)
        d = amax / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.round(xb * inv[..., None]).astype(np.int8)  # rint: GGML's SIMD paths round half to even
        head = d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
        return np.concatenate([head, q.view(np.uint8)], axis=-1).reshape(rows, -1)
    levels = 16 if qtype in (QType.Q4_0, QType.Q4_1, QType.IQ4_NL) else 32
    if qtype == QType.IQ4_NL:
        d, q = _iq4_nl_blocks(xb)
        head = d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    elif qtype in (QType.Q4_0, QType.Q5_0):
        # GGML picks the signed extreme so that it maps to the lowest level exactly.
        idx = np.abs(xb).argmax(axis=-1)
        vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
        d = vmax / np.float32(-levels / 2)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.minimum(levels - 1, (xb * inv[..., None] + np.float32(levels / 2 + 0.5)).astype(np.int32))
        head = d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    else:  # Q4_1, Q5_1
        vmin = xb.min(axis=-1)
        vmax = xb.max(axis=-1)
        d = (vmax - vmin) / np.float32(levels - 1)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.minimum(levels - 1, ((xb - vmin[..., None]) * inv[..., None] + np.float32(0.5)).astype(np.int32))
        head = np.concatenate(
            [d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
             vmin.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    q = q.astype(np.uint8)
    if levels == 32:  # the fifth bits, value j at bit j
        fifth = ((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
        head = np.concatenate([head, fifth[..., None].view(np.uint8)], axis=-1)
        q &= 0x0F
    packed = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([head, packed], axis=-1).reshape(rows, -1)


def _iq4_nl_index(x: np.ndarray) -> np.ndarray:
    """The nearest IQ4_NL level of each x (in units of the block scale), ties as GGML breaks them."""
    v = IQ4_NL_VALUES
    upper = np.clip(np.searchsorted(v, x, side="right"), 1, len(v) - 1)
    index = np.where(x - v[upper - 1] < v[upper] - x, upper - 1, upper)
    return np.where(x <= v[0], 0, np.where(x >= v[-1], len(v) - 1, index))


def _iq4_nl_blocks(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale d, level indices) of every 32-block, as llama.cpp's quantize_iq4_nl without an
    importance matrix: each value weighted by its square, the scale that best fits the levels
    among the extreme's 15 neighbouring candidates (least squares for each)."""
    v = IQ4_NL_VALUES
    w = xb * xb
    extreme = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)  # signed, first max
    with np.errstate(divide="ignore", invalid="ignore"):
        def fit(inverse_scale):  # sums in value order, in float32, as GGML's loop (not pairwise)
            q = v[_iq4_nl_index(xb * inverse_scale)]
            sumqx, sumq2 = np.zeros(xb.shape[:-1], np.float32), np.zeros(xb.shape[:-1], np.float32)
            for j in range(xb.shape[-1]):
                wq = w[..., j] * q[..., j]
                sumqx += wq * xb[..., j]
                sumq2 += wq * q[..., j]
            return sumqx, sumq2

        sumqx, sumq2 = fit(np.float32(1.0) / (extreme / -v[0]))
        d = np.where(sumq2 > 0, sumqx / sumq2, 0).astype(np.float32)
        best = d * sumqx
        for step in range(-7, 8):
            sumqx, sumq2 = fit((step + v[0]) / extreme)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d).astype(np.float32)
            best = np.where(better, d * sumqx, best)
        d = np.where(np.abs(extreme[..., 0]) < 1e-15, np.float32(0), d)
        inverse = np.where(d != 0, np.float32(1.0) / d, np.float32(0))
    return d, _iq4_nl_index(xb * inverse[..., None]).astype(np.uint8)


def nbytes(qtype: QType, rows: int, cols: int) -> int:
    return rows * FORMATS[QType(qtype)].row_bytes(cols)
