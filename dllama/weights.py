"""A weight matrix in its native format, and the row/column slices tensor parallelism cuts from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels.matmul import matmul
from .quant import FORMATS, QType, dequantize


@dataclass(frozen=True)
class Matrix:
    """W of shape (rows, cols): y = W @ x. `data` is (rows, row_bytes) uint8 for block formats,
    (rows, cols) float16/float32 otherwise; it may be a view into a memory-mapped GGUF file."""

    qtype: QType
    rows: int
    cols: int
    data: np.ndarray

    def __post_init__(self):
        if self.data.ndim != 2 or self.data.shape[0] != self.rows:
            raise ValueError(f"matrix data of shape {self.data.shape} does not hold {self.rows} rows")
        if self.data.strides[1] != self.data.itemsize:
            raise ValueError("matrix rows must be contiguous in memory")

    @property
    def nbytes(self) -> int:
        return self.rows * FORMATS[self.qtype].row_bytes(self.cols)

    def row_slice(self, start: int, stop: int) -> "Matrix":
        """Rows [start, stop): a view."""
        return Matrix(self.qtype, stop - start, self.cols, self.data[start:stop])

    def col_slice(self, start: int, stop: int) -> "Matrix":
        """Columns [start, stop), on block boundaries: a strided view (each row stays contiguous)."""
        fmt = FORMATS[self.qtype]
        if start % fmt.block_size or stop % fmt.block_size:
            raise ValueError(f"{self.qtype.name} columns can only be cut at multiples of {fmt.block_size}")
        b0, b1 = start // fmt.block_size * fmt.block_bytes, stop // fmt.block_size * fmt.block_bytes
        if self.qtype in (QType.F32, QType.F16):
            b0, b1 = start, stop
        return Matrix(self.qtype, self.rows, stop - start, self.data[:, b0:b1])

    def contiguous(self) -> "Matrix":
        """A compact in-RAM copy (for sending, or to drop a reference into a file map)."""
        return Matrix(self.qtype, self.rows, self.cols, np.ascontiguousarray(self.data))

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None, wide: bool = False) -> np.ndarray:
        """x (T, cols) or (cols,) -> (T, rows) or (rows,); float64 if wide (see kernels.matmul)."""
        return matmul(self.data, self.qtype, x, out, wide)

    def row_values(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows (an embedding lookup): float32 (len(index), cols)."""
        return dequantize(np.ascontiguousarray(self.data[index]), self.qtype)
