"""A shard's tensors as they travel: a manifest entry per tensor, raw bytes, a checksum."""

from __future__ import annotations

import hashlib
import re
from typing import Annotated

import msgspec
import numpy as np

from ..quant import FORMATS, QType
from ..weights import Experts, Matrix

# a weight matrix, a stack of expert matrices (travels as one matrix, expert after expert), or a
# float32 vector (norm scales, RoPE factors)
Tensor = Matrix | Experts | np.ndarray

DIGEST = re.compile(r"[0-9a-f]{64}")  # a sha256 as hexdigest() writes it: also a slice's file name
Digest = Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern=DIGEST.pattern)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A manifest entry, as it travels in SETUP (decoded by dllama.cluster.messages)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    qtype: int  # QType; vectors are F32
    rows: Count  # 0 for a vector
    cols: Count
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
    sha256: Digest

    def __post_init__(self):
        if self.qtype not in FORMATS:
            raise ValueError(f"tensor {self.name}: unknown qtype {self.qtype}")
        if self.cols % FORMATS[QType(self.qtype)].block_size:
            raise ValueError(f"tensor {self.name}: {self.cols} columns are not whole {QType(self.qtype).name} blocks")
        if self.nbytes not in (self.nbytes_as(vector=False), self.nbytes_as(vector=self.rows == 0)):
            raise ValueError(f"tensor {self.name}: {self.nbytes} bytes do not fit its shape")

    def nbytes_as(self, vector: bool) -> int:
        """Its size as a vector (cols f32 values), or as a matrix (which may have no rows)."""
        return 4 * self.cols if vector else FORMATS[QType(self.qtype)].row_bytes(self.cols) * self.rows


def tensor_bytes(t: Tensor) -> np.ndarray:
    """The tensor's bytes as one contiguous uint8 array (a copy only if the source is strided)."""
    data = t.data if isinstance(t, (Matrix, Experts)) else np.asarray(t, np.float32)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def make_entry(name: str, t: Tensor) -> TensorEntry:
    raw = tensor_bytes(t)
    digest = hashlib.sha256(raw).hexdigest()
    if isinstance(t, Matrix):
        return TensorEntry(name, int(t.qtype), t.rows, t.cols, raw.nbytes, digest)
    if isinstance(t, Experts):
        return TensorEntry(name, int(t.qtype), t.n * t.rows, t.cols, raw.nbytes, digest)
    return TensorEntry(name, int(QType.F32), 0, int(t.shape[0]), raw.nbytes, digest)


def from_bytes(entry: TensorEntry, raw: np.ndarray, vector: bool | None = None) -> Tensor:
    """Rebuild a tensor from its bytes (which it then shares: no copy). Weights are made
    read-only: like the root's memory-mapped ones, so both run the same compiled kernels.
    vector: whether it is a vector (default: rows == 0; a matrix of no rows must say False)."""
    if raw.nbytes != entry.nbytes:
        raise ValueError(f"tensor {entry.name}: got {raw.nbytes} bytes, expected {entry.nbytes}")
    raw = raw.view()
    raw.flags.writeable = False
    if vector is None:
        vector = entry.rows == 0
    if vector:
        return raw.view(np.float32)
    qtype = QType(entry.qtype)
    if qtype == QType.F32:
        data = raw.view(np.float32).reshape(entry.rows, entry.cols)
    elif qtype == QType.F16:
        data = raw.view(np.float16).reshape(entry.rows, entry.cols)
    else:  # explicit row length: a slice of no rows or no columns is a legal empty matrix
        data = raw.reshape(entry.rows, FORMATS[qtype].row_bytes(entry.cols))
    return Matrix(qtype, entry.rows, entry.cols, data)


def checksum(raw: np.ndarray) -> str:
    return hashlib.sha256(raw).hexdigest()
