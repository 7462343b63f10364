"""A block-format weight matrix with its rows interleaved by 2, 4 or 8, made once at load.

The rows are stored as llama.cpp's repacked formats do: block b of rows ng .. ng+n-1 together,
then block b+1, so that n rows' independent chains read one sequential stream (why, with the
figures: docs/kernels.md#packing). Within a block of
n rows the fields go one after another (every row's scale, then every row's quants, ...): the
scales are one vector load, and two rows' nibbles one 32-byte load (simd_q8.py `_emit_pair_dots`,
in the order of the lanes they meet: activations.PAIR_LANE_ROWS; where simd_q8.INTERLEAVED_NIBBLES says so, a pair's nibbles interleaved value by value, so that a
mask and a shift give each row's values in order: `_emit_interleaved_dots`); a K-quant group's
6-bit scales and mins are unpacked for all its rows at once (simd_q8k.py).
Each row's blocks are still summed in their order, into their own accumulators: the bits are the
file layout's.

Long rows are cut into spans of about SPAN_VALUES values, stored span-major: span 0 of every group,
then span 1 of every group, ... Decode walks them in that order, every row's accumulators carried
from one span to the next (the same additions in the same order: the bits of the whole row), so one
span of activations serves every group from L1 while the weights stay one sequential stream.

The copy replaces the file's pages in RAM (the loader releases them), so a node holds the weights
once. The last group is padded with zero blocks when the rows are not a multiple of n.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..quant import FORMATS, QType
from .activations import PAIR_LANE_ROWS, PAIR_LANE_VALUES
from .simd_q8 import INTERLEAVED_NIBBLES, PACK_ROWS, PAIR_LANE_ORDER
from .simd_q8k import K_PACK_ROWS

# Whole rows of 8192 values of Q4_0 by 8 put 36 KB of weights between two reads of an activation,
# more than Zen 4's 32 KB L1 data cache: a 1B model's FFN down (2048 x 8192) streamed at 17 GB/s
# against 25 for its gate (8192 x 2048), at 23 in spans of 2048 values (9 KB), 1 core from DRAM
SPAN_VALUES = 2048

# the block formats the packed kernels cover (matmul.py); floats stay in rows
PACKABLE = (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.Q4_K, QType.Q5_K,
            QType.Q6_K)


def rows_per_group(qtype: QType) -> int:
    return {**PACK_ROWS, **K_PACK_ROWS}[QType(qtype).name.lower()]


@functools.cache
def _field_order(qtype: QType) -> np.ndarray:
    """Where each byte of n blocks side by side (row-major: row i's block at i * block bytes) goes
    in the packed block of n rows (field by field)."""
    fmt, n = FORMATS[qtype], rows_per_group(qtype)
    sizes, block_bytes = dict(fmt.fields), fmt.block_bytes
    order = np.empty(n * block_bytes, np.int64)
    for i in range(n):
        for (name, file_at), packed_at in zip(fmt.field_offsets().items(), fmt.field_offsets(n, i).values()):
            size = sizes[name]
            order[i * block_bytes + file_at:i * block_bytes + file_at + size] = np.arange(packed_at, packed_at + size)
    order.flags.writeable = False  # shared by every caller (cached)
    return order


def span_blocks(qtype: QType, blocks: int) -> int:
    """Blocks per span of a packed row of `blocks` blocks: rows up to 1.5 spans stay whole; longer
    ones are cut into equal spans of about SPAN_VALUES values (a divisor of blocks nearest to it)."""
    values = FORMATS[qtype].block_size
    if blocks * values <= SPAN_VALUES * 3 // 2:
        return max(blocks, 1)  # a row of no columns (a node's empty column share): no spans
    divisors = [d for d in range(1, blocks + 1) if blocks % d == 0]
    return min(divisors, key=lambda d: abs(math.log(d * values / SPAN_VALUES)))


def _interleaved_quants(qtype: QType) -> int | None:
    """Where a packed block's quants start, for the formats whose pairs of rows interleave their
    nibbles (simd_q8.INTERLEAVED_NIBBLES: byte k of a pair's 32 holds value k of its first row in
    the low nibble and of its second in the high one, so that one mask and one shift give each
    row's 32 values in order); None for the others."""
    if QType(qtype).name.lower() not in INTERLEAVED_NIBBLES:
        return None
    return FORMATS[qtype].field_offsets(rows_per_group(qtype))["qs"]


def _interleave(blocks: np.ndarray, qtype: QType) -> None:
    """Packed blocks (..., n * block bytes), in place: each pair of rows' 16 + 16 quant bytes (byte
    k: value k low, k + 16 high) interleaved as _interleaved_quants says. Its own inverse: the same
    two lines take the interleaved bytes back."""
    at = _interleaved_quants(qtype)
    if at is None:
        return
    n = rows_per_group(qtype)
    pairs = blocks[..., at:at + 16 * n].reshape(*blocks.shape[:-1], n // 2, 2, 16)
    first, second = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
    pairs[..., 0, :] = (first & 0x0F) | (second << 4)  # values 0-15 of both rows (the second's high)
    pairs[..., 1, :] = (first >> 4) | (second & 0xF0)  # values 16-31


# Where byte j of a pair's 32 quant bytes in lane order comes from in its two rows' 16 + 16: lane j // 4
# (of the low nibbles' 8; the high nibbles' are in the same bytes) holds four bytes of its row's
_LANE_BYTES = np.array([16 * PAIR_LANE_ROWS[j // 4] + PAIR_LANE_VALUES[j] for j in range(32)])
# ... and bit 32h + j of a pair's two fifth-bit words (Q5), where in its rows' two: value 16h + (byte j's)
_LANE_BITS = np.array([32 * PAIR_LANE_ROWS[j // 4] + 16 * h + PAIR_LANE_VALUES[j] for h in (0, 1) for j in range(32)])


def _reorder(field: np.ndarray, order: np.ndarray, back: bool) -> None:
    """field[..., j] = field[..., order[j]] in place, or `back` the other way."""
    if back:
        field[..., order] = field.copy()
    else:
        field[...] = field[..., order]


def _in_lane_order(blocks: np.ndarray, qtype: QType, back: bool = False) -> None:
    """Packed blocks (..., n * block bytes), in place: each pair of rows' quants (row 2p's 16 bytes,
    then row 2p+1's) in the order of the lanes they meet (simd_q8.PAIR_LANE_ORDER), or `back`; so
    are the bits of their fifth-bit words (Q5), each half's 32 bits those of its bytes in order."""
    if QType(qtype).name.lower() not in PAIR_LANE_ORDER:
        return
    n, lead = rows_per_group(qtype), blocks.shape[:-1]
    offsets = FORMATS[qtype].field_offsets(n)
    _reorder(blocks[..., offsets["qs"]:offsets["qs"] + 16 * n].reshape(*lead, n // 2, 32), _LANE_BYTES, back)
    if "qh" in offsets:  # (bits little-endian: bit b of a pair's 8 bytes is bit b % 8 of byte b // 8)
        words = blocks[..., offsets["qh"]:offsets["qh"] + 4 * n].reshape(*lead, n // 2, 8)
        bits = np.unpackbits(words, axis=-1, bitorder="little")
        _reorder(bits, _LANE_BITS, back)
        words[...] = np.packbits(bits, axis=-1, bitorder="little")


@dataclass(frozen=True)
class PackedRows:
    """groups[s, g] = span s of rows n*g .. n*g + n-1 (n = rows_per_group), block-interleaved; `rows`
    real rows."""

    qtype: QType
    rows: int
    groups: np.ndarray  # (spans, ceil(rows / n), blocks per span * n * block bytes) uint8

    @classmethod
    def pack(cls, data: np.ndarray, qtype: QType) -> "PackedRows":
        """From (rows, row bytes) uint8 in the file's layout (any row stride)."""
        if qtype not in PACKABLE:
            raise ValueError(f"{QType(qtype).name} rows are not packed")
        rows, row_bytes = data.shape
        block_bytes = FORMATS[qtype].block_bytes
        n, blocks = rows_per_group(qtype), row_bytes // block_bytes
        per_span = span_blocks(qtype, blocks)
        n_groups = -(-rows // n)
        packed = np.zeros((blocks // per_span, n_groups, per_span, n * block_bytes), np.uint8)
        moved = np.argsort(_field_order(qtype))  # packed byte k comes from side-by-side byte moved[k]
        side_by_side = np.zeros((min(n_groups, 128), blocks, n, block_bytes), np.uint8)
        for g0 in range(0, n_groups, 128):  # (row, block, byte) -> (block, row, byte), 128 groups at a time
            part = data[g0 * n:(g0 + 128) * n]
            part = part.reshape(len(part), blocks, block_bytes)
            whole, extra = len(part) // n, len(part) % n
            side_by_side[:whole] = part[:whole * n].reshape(whole, n, blocks, block_bytes).transpose(0, 2, 1, 3)
            if extra:  # the last group, padded
                side_by_side[whole] = 0
                side_by_side[whole, :, :extra] = part[whole * n:].transpose(1, 0, 2)
            count = whole + (extra > 0)
            by_group = side_by_side[:count].reshape(count, blocks, n * block_bytes)[..., moved]
            _interleave(by_group, qtype)
            _in_lane_order(by_group, qtype)
            packed[:, g0:g0 + count] = by_group.reshape(count, -1, per_span, n * block_bytes).transpose(1, 0, 2, 3)
        return cls(QType(qtype), rows, packed.reshape(packed.shape[0], n_groups, per_span * n * block_bytes))

    @property
    def row_bytes(self) -> int:
        return self.groups.shape[0] * self.groups.shape[2] // self.rows_per_group

    @property
    def rows_per_group(self) -> int:
        return rows_per_group(self.qtype)

    @property
    def nbytes(self) -> int:
        return self.groups.nbytes

    def unpack(self, index: np.ndarray | None = None) -> np.ndarray:
        """Rows `index` (default all) in the file's layout: (len, row bytes) uint8."""
        index = np.arange(self.rows) if index is None else np.asarray(index, np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        n, block_bytes = self.rows_per_group, FORMATS[self.qtype].block_bytes
        chosen = self.groups[:, index // n]  # (spans, len, span bytes)
        blocks = chosen.transpose(1, 0, 2).reshape(len(index), self.row_bytes // block_bytes, n * block_bytes)
        _interleave(blocks, self.qtype)  # (its own inverse; chosen is a copy: the packed rows stay as they are)
        _in_lane_order(blocks, self.qtype, back=True)
        blocks = blocks[..., _field_order(self.qtype)].reshape(len(index), blocks.shape[1], n, block_bytes)
        return np.ascontiguousarray(blocks[np.arange(len(index)), :, index % n]).reshape(len(index), self.row_bytes)
