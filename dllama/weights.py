"""A weight matrix in its native format, and the row/column slices tensor parallelism cuts from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels.matmul import matmul
from .kernels.packing import PACKABLE, PackedRows
from .quant import FORMATS, QType, dequantize


@dataclass(frozen=True)
class Matrix:
    """W of shape (rows, cols): y = W @ x. `data` is (rows, row_bytes) uint8 for block formats,
    (rows, cols) float16/float32 otherwise; it may be a view into a memory-mapped GGUF file. Or,
    once a node has its slice, the rows packed for the kernels (`packed()`): then it is not cut."""

    qtype: QType
    rows: int
    cols: int
    data: np.ndarray | PackedRows

    def __post_init__(self):
        if isinstance(self.data, PackedRows):
            if self.data.rows != self.rows or self.data.qtype != self.qtype:
                raise ValueError(f"packed rows of {self.data.rows} x {self.data.qtype.name} for {self.rows} x "
                                 f"{QType(self.qtype).name}")
            return
        if self.data.ndim != 2 or self.data.shape[0] != self.rows:
            raise ValueError(f"matrix data of shape {self.data.shape} does not hold {self.rows} rows")
        if self.data.strides[1] != self.data.itemsize:
            raise ValueError("matrix rows must be contiguous in memory")

    @property
    def nbytes(self) -> int:
        return self.rows * FORMATS[self.qtype].row_bytes(self.cols)

    def row_slice(self, start: int, stop: int) -> "Matrix":
        """Rows [start, stop): a view."""
        return Matrix(self.qtype, stop - start, self.cols, self._stored()[start:stop])

    def col_slice(self, start: int, stop: int) -> "Matrix":
        """Columns [start, stop), on block boundaries: a strided view (each row stays contiguous)."""
        b0, b1 = _column_range(self.qtype, start, stop)
        return Matrix(self.qtype, self.rows, stop - start, self._stored()[:, b0:b1])

    def contiguous(self) -> "Matrix":
        """A compact in-RAM copy (for sending, or to drop a reference into a file map)."""
        return Matrix(self.qtype, self.rows, self.cols, np.ascontiguousarray(self._stored()))

    def packed(self) -> "Matrix":
        """This matrix with its rows packed for the kernels (kernels/packing.py: a copy in RAM, the
        same products bit for bit, faster from DRAM) where its format has a packed kernel; else itself."""
        if self.qtype not in PACKABLE or isinstance(self.data, PackedRows):
            return self
        return Matrix(self.qtype, self.rows, self.cols, PackedRows.pack(self.data, self.qtype))

    def _stored(self) -> np.ndarray:
        if isinstance(self.data, PackedRows):
            raise ValueError("a packed matrix is not cut or sent: slice it before packing")
        return self.data

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None, wide: bool = False) -> np.ndarray:
        """x (T, cols) or (cols,) -> (T, rows) or (rows,); float64 if wide (see kernels.matmul)."""
        return matmul(self.data, self.qtype, x, out, wide)

    def row_values(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows (an embedding lookup): float32 (len(index), cols)."""
        if isinstance(self.data, PackedRows):
            return dequantize(self.data.unpack(index), self.qtype)
        return dequantize(np.ascontiguousarray(self.data[index]), self.qtype)


def stack_rows(matrices: list[Matrix]) -> tuple[Matrix, list[Matrix]] | None:
    """One packed matrix of the rows of `matrices`, one after another, and the matrices again as
    views of it (RAM: the rows once). Q, K and V (or gate and up) become one product per layer: a
    kernel call costs 10-30 us, as much as a small matrix's product on a 135M model. The bits are
    each row's, wherever it sits. None where they cannot share one: not all packed, formats or
    widths differ, or a matrix's last group is padded (its rows not a multiple of the group)."""
    first = matrices[0]
    if not all(isinstance(m.data, PackedRows) and m.qtype == first.qtype and m.cols == first.cols
               and m.rows % m.data.rows_per_group == 0 for m in matrices):
        return None
    groups = np.concatenate([m.data.groups for m in matrices], axis=1)  # (spans, groups, span bytes)
    rows = sum(m.rows for m in matrices)
    views, at = [], 0
    for m in matrices:
        count = m.data.groups.shape[1]
        views.append(Matrix(m.qtype, m.rows, m.cols, PackedRows(m.qtype, m.rows, groups[:, at:at + count])))
        at += count
    return Matrix(first.qtype, rows, first.cols, PackedRows(first.qtype, rows, groups)), views


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layer's stack of n matrices of one shape (a 3-D GGUF tensor, expert
    by expert): `data` is (n, rows, row bytes) for block formats, (n, rows, cols) otherwise. A
    node's slice cuts the same rows or columns of every expert (a strided view, no copy); on the
    wire it travels as one matrix of n * rows rows, expert after expert."""

    qtype: QType
    n: int
    rows: int  # of each expert
    cols: int
    data: np.ndarray

    def __post_init__(self):
        if self.data.ndim != 3 or self.data.shape[:2] != (self.n, self.rows):
            raise ValueError(f"expert data of shape {self.data.shape} does not hold {self.n} x {self.rows} rows")

    @classmethod
    def of(cls, m: Matrix, n: int) -> "Experts":
        """The stack whose experts are n equal runs of m's rows."""
        if m.rows % n:
            raise ValueError(f"{m.rows} rows do not split into {n} experts")
        return cls(m.qtype, n, m.rows // n, m.cols, m.data.reshape(n, m.rows // n, m.data.shape[1]))

    def __getitem__(self, e: int) -> Matrix:
        return Matrix(self.qtype, self.rows, self.cols, self.data[e])

    @property
    def nbytes(self) -> int:
        return self.n * self[0].nbytes

    def contiguous(self) -> "Experts":
        """A compact in-RAM copy of the stack (of a strided slice)."""
        return Experts(self.qtype, self.n, self.rows, self.cols, np.ascontiguousarray(self.data))

    def row_slice(self, start: int, stop: int) -> "Experts":
        return Experts(self.qtype, self.n, stop - start, self.cols, self.data[:, start:stop])

    def col_slice(self, start: int, stop: int) -> "Experts":
        b0, b1 = _column_range(self.qtype, start, stop)
        return Experts(self.qtype, self.n, self.rows, stop - start, self.data[:, :, b0:b1])


def _column_range(qtype: QType, start: int, stop: int) -> tuple[int, int]:
    """Where columns [start, stop) lie in a row's data (bytes of a block format, else elements)."""
    fmt = FORMATS[qtype]
    if start % fmt.block_size or stop % fmt.block_size:
        raise ValueError(f"{qtype.name} columns can only be cut at multiples of {fmt.block_size}")
    if qtype in (QType.F32, QType.F16):
        return start, stop
    return start // fmt.block_size * fmt.block_bytes, stop // fmt.block_size * fmt.block_bytes
