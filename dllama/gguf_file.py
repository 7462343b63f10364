"""A lean GGUF reader: scalar metadata, tensor infos, and tensor data as views of a memory map.

gguf-py's GGUFReader builds a numpy view per vocabulary string: on the default model it takes
1.5 s and leaves tens of MB of small objects behind, too much for a Raspberry Pi's RAM. This
reader skips over array values (keeping only their length), so opening a model costs a few
milliseconds and no memory beyond the map. Type tables come from gguf-py. Every length and
offset is checked against the file size before use, so a damaged file is a clear error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML

from .errors import ModelError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_DTYPES = {GGML.F32: np.float32, GGML.F16: np.float16, GGML.F64: np.float64,
           GGML.I8: np.int8, GGML.I16: np.int16, GGML.I32: np.int32, GGML.I64: np.int64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass(frozen=True)
class ArrayInfo:
    """An array value that was skipped: its element type, length, and where its elements lie in the
    file (two files' arrays are equal where those bytes are)."""

    elem_type: int
    length: int
    start: int = 0
    end: int = 0


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise ModelError(f"not a GGUF file: {path} (empty)") from None
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except BaseException as e:
            self._buf.release()
            self._map.close()
            if isinstance(e, (struct.error, UnicodeDecodeError, OverflowError)):
                raise ModelError(f"not a valid GGUF file: {path} ({e})") from None
            raise

    # ------------------------------------------------------------------ parsing

    def _read(self, fmt: str):
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > len(self._buf):
            raise ModelError(f"not a valid GGUF file: {self.path} ({what} runs past the end of the file)")

    def _string(self) -> str:
        n = self._read("<Q")
        self._need(n, "a string")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            elem_type, length = self._read("<I"), self._read("<Q")
            start = self._pos
            if elem_type == _STRING:  # (a vocabulary: 100k+ of them, so the loop is kept lean)
                buf, pos, size, length_at = self._buf, self._pos, len(self._buf), _U64.unpack_from
                for _ in range(length):
                    if pos + 8 > size:
                        pos = size + 1
                        break
                    pos += 8 + length_at(buf, pos)[0]
                self._pos = pos
                self._need(0, "a string")
            elif elem_type in _SCALARS:
                size = struct.calcsize(_SCALARS[elem_type]) * length
                self._need(size, "an array")
                self._pos += size
            else:
                raise ModelError(f"not a valid GGUF file: {self.path} (array of type {elem_type})")
            return ArrayInfo(elem_type, length, start, self._pos)
        raise ModelError(f"not a valid GGUF file: {self.path} (value type {vtype})")

    def _parse(self) -> None:
        self._need(24, "the header")
        if bytes(self._buf[:4]) != _MAGIC:
            raise ModelError(f"not a GGUF file: {self.path} (bad magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise ModelError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        if n_tensors > len(self._buf) or n_kv > len(self._buf):
            raise ModelError(f"not a valid GGUF file: {self.path} (implausible counts)")
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, int] = {}  # GGUF's value type of each key (gguf.GGUFValueType)
        for _ in range(n_kv):
            key = self._string()
            self.value_types[key] = self._read("<I")
            self.metadata[key] = self._value(self.value_types[key])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            if n_dims > 4:
                raise ModelError(f"not a valid GGUF file: {self.path} (tensor {name} has {n_dims} dims)")
            shape = tuple(self._read("<Q") for _ in range(n_dims))
            infos.append((name, shape, self._read("<I"), self._read("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            info = TensorInfo(name, shape, ggml_type, data_start + offset)
            end = info.offset + self._nbytes(info)
            if end > len(self._buf):
                raise ModelError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
            self.tensors[name] = info

    def _nbytes(self, info: TensorInfo) -> int:
        try:
            block, size = GGML_QUANT_SIZES[GGML(info.ggml_type)]
        except (ValueError, KeyError):
            raise ModelError(f"{self.path}: tensor {info.name} has unknown type #{info.ggml_type}") from None
        n = int(np.prod(info.shape, dtype=np.int64))
        return n // block * size

    def array_bytes(self, key: str) -> bytes | None:
        """An array's elements as they are in the file (None if `key` is not an array)."""
        value = self.metadata.get(key)
        return bytes(self._buf[value.start:value.end]) if isinstance(value, ArrayInfo) else None

    def array_values(self, key: str) -> list:
        """The elements of the array `key` (read now: the parse skipped them)."""
        info = self.metadata[key]
        if not isinstance(info, ArrayInfo):
            raise ValueError(f"{key} is not an array")
        if info.elem_type != _STRING:
            return np.frombuffer(self._buf[info.start:info.end], _SCALARS[info.elem_type]).tolist()
        self._pos, values = info.start, []
        for _ in range(info.length):
            values.append(self._string())
        return values

    # ------------------------------------------------------------------ tensor data

    def maps(self, view: np.ndarray) -> bool:
        """Whether `view`'s bytes are in this file's map."""
        base = np.frombuffer(self._map, np.uint8).__array_interface__["data"][0]
        low, high = byte_bounds(view)
        return base <= low and high <= base + len(self._map)

    def release(self, view: np.ndarray | None = None) -> None:
        """Drop this process's resident pages of the map under `view` (the whole pages it alone
        spans; default: the whole map): for a tensor copied into RAM, so that RAM holds it once.
        A later read pages it in again."""
        base = np.frombuffer(self._map, np.uint8).__array_interface__["data"][0]
        if view is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        if not self.maps(view):
            raise ValueError("release: not a view of this file's map")
        low, high = byte_bounds(view)
        start = -(-(low - base) // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = (high - base) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes as an array view of the map: (rows..., cols) of the element type for
        plain types, (rows..., row_bytes) uint8 for block formats."""
        info = self.tensors[name]
        ggml_type = GGML(info.ggml_type)
        block, size = GGML_QUANT_SIZES[ggml_type]
        dims = tuple(reversed(info.shape))  # numpy order: outermost first
        count = self._nbytes(info)
        if ggml_type in _DTYPES:
            dtype = np.dtype(_DTYPES[ggml_type])
            return np.frombuffer(self._map, dtype, count // dtype.itemsize, info.offset).reshape(dims)
        row_bytes = dims[-1] // block * size
        return np.frombuffer(self._map, np.uint8, count, info.offset).reshape(dims[:-1] + (row_bytes,))
