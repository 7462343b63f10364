"""A shard's tensors as they travel: a manifest entry per tensor, raw bytes, a checksum."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..errors import DllamaError
from ..quant import FORMATS, QType
from ..weights import Matrix

Tensor = Matrix | np.ndarray  # a weight matrix, or a float32 vector (norm scales, RoPE factors)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    qtype: int  # QType; vectors are F32
    rows: int  # 0 for a vector
    cols: int
    nbytes: int
    sha256: str

    def to_dict(self) -> dict:
        return {"name": self.name, "qtype": self.qtype, "rows": self.rows, "cols": self.cols,
                "nbytes": self.nbytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorEntry":
        entry = cls(str(d["name"]), int(d["qtype"]), int(d["rows"]), int(d["cols"]), int(d["nbytes"]),
                    str(d["sha256"]))
        expected = entry.cols * 4 if entry.rows == 0 else FORMATS[QType(entry.qtype)].row_bytes(entry.cols) * entry.rows
        if entry.nbytes != expected:
            raise DllamaError(f"tensor {entry.name}: {entry.nbytes} bytes do not fit its shape")
        return entry


def tensor_bytes(t: Tensor) -> np.ndarray:
    """The tensor's bytes as one contiguous uint8 array (a copy only if the source is strided)."""
    data = t.data if isinstance(t, Matrix) else np.asarray(t, np.float32)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def make_entry(name: str, t: Tensor) -> TensorEntry:
    raw = tensor_bytes(t)
    digest = hashlib.sha256(raw).hexdigest()
    if isinstance(t, Matrix):
        return TensorEntry(name, int(t.qtype), t.rows, t.cols, raw.nbytes, digest)
    return TensorEntry(name, int(QType.F32), 0, int(t.shape[0]), raw.nbytes, digest)


def from_bytes(entry: TensorEntry, raw: np.ndarray) -> Tensor:
    """Rebuild a tensor from its bytes (which it then shares: no copy). Weights are made
    read-only: like the root's memory-mapped ones, so both run the same compiled kernels."""
    if raw.nbytes != entry.nbytes:
        raise DllamaError(f"tensor {entry.name}: got {raw.nbytes} bytes, expected {entry.nbytes}")
    raw = raw.view()
    raw.flags.writeable = False
    if entry.rows == 0:
        return raw.view(np.float32)
    qtype = QType(entry.qtype)
    if qtype == QType.F32:
        data = raw.view(np.float32).reshape(entry.rows, entry.cols)
    elif qtype == QType.F16:
        data = raw.view(np.float16).reshape(entry.rows, entry.cols)
    else:
        data = raw.reshape(entry.rows, -1)
    return Matrix(qtype, entry.rows, entry.cols, data)


def checksum(raw: np.ndarray) -> str:
    return hashlib.sha256(raw).hexdigest()
