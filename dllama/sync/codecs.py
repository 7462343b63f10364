"""Payload codecs for all-reduce: how float values travel on the wire.

    exact  the array's own dtype, bit for bit
    f16    IEEE half: relative error <= 2**-11 per rounding (values beyond +-65504 become inf)
    q80    blocks of 32 values: one float32 scale d = max|x|/127, then 32 int8 q = rint(x/d);
           a value decodes as q*d, error <= d/2 per rounding. 36 bytes per 32 values (x3.56 vs f32).
           (GGML's Q8_0 stores d as f16; f32 costs 2 bytes a block and has no range limit.)

Blocks never straddle a chunk: algorithms split arrays on multiples of `granule`, and a
trailing partial block is zero-padded on the wire. Encoding a granule-aligned range gives the
same bytes wherever the range is cut, so relayed bytes can be forwarded unchanged.
"""

from __future__ import annotations

import numpy as np
from numba import njit

QK = 32
Q80_BLOCK = np.dtype([("d", "<f4"), ("q", "i1", (QK,))])  # 36 bytes, array of structs


class Codec:
    name = "exact"
    granule = 1  # algorithms cut arrays only at multiples of this many values
    exact = True

    def wire_nbytes(self, count: int, itemsize: int) -> int:
        return count * itemsize

    def wire_offset(self, index: int, itemsize: int) -> int:
        """Byte offset on the wire of value `index` (a multiple of granule)."""
        return index * itemsize

    def error_bound(self, partial_absmax: float) -> float:
        """Worst-case absolute error one encoding adds to a value (in blocks whose |max| is
        `partial_absmax`)."""
        return 0.0


class F16Codec(Codec):
    name = "f16"
    exact = False

    def wire_nbytes(self, count, itemsize):
        return count * 2

    def wire_offset(self, index, itemsize):
        return index * 2

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        np.copyto(wire.view(np.float16), x, casting="unsafe")

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, wire.view(np.float16), casting="unsafe")

    def decode_add(self, wire: np.ndarray, acc: np.ndarray) -> None:
        np.add(acc, wire.view(np.float16), out=acc, casting="unsafe")

    def error_bound(self, partial_absmax):
        return partial_absmax * 2.0 ** -11 + 2.0 ** -25  # half an ulp; subnormal floor


# The q80 loops run once per value on the hot path of quantized sync: numba, compiled on first
# use and cached on disk. Arithmetic is float32 throughout, so any two ranks encode alike.
@njit(nogil=True, cache=True)
def _q80_encode(x, wire):
    n = x.size
    scales = wire.view(np.float32)  # block b: scale at float 9b, its 32 int8 at bytes 36b+4..
    quants = wire.view(np.int8)
    for b in range((n + QK - 1) // QK):
        lo = b * QK
        hi = min(lo + QK, n)
        amax = np.float32(0.0)
        for i in range(lo, hi):
            v = abs(np.float32(x[i]))
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
        scales[9 * b] = d
        base = 36 * b + 4
        for i in range(hi - lo):
            quants[base + i] = np.int8(np.rint(np.float32(x[lo + i]) * inv))
        for i in range(hi - lo, QK):
            quants[base + i] = 0


@njit(nogil=True, cache=True)
def _q80_decode(wire, out, add):
    n = out.size
    scales = wire.view(np.float32)
    quants = wire.view(np.int8)
    for b in range((n + QK - 1) // QK):
        d = scales[9 * b]
        lo = b * QK
        base = 36 * b + 4
        for i in range(min(QK, n - lo)):
            v = np.float32(quants[base + i]) * d
            if add:
                out[lo + i] += v
            else:
                out[lo + i] = v


class Q80Codec(Codec):
    name = "q80"
    granule = QK
    exact = False

    def wire_nbytes(self, count, itemsize):
        return -(-count // QK) * Q80_BLOCK.itemsize

    def wire_offset(self, index, itemsize):
        return index // QK * Q80_BLOCK.itemsize

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        _q80_encode(x, wire)

    def decode(self, wire, out):
        _q80_decode(wire, out, False)

    def decode_add(self, wire, acc):
        _q80_decode(wire, acc, True)

    def error_bound(self, partial_absmax):
        # |x - q d| <= d/2 with d = absmax/127, plus float32 rounding of x/d and of q*d.
        return partial_absmax / 254.0 * (1 + 1e-5) + partial_absmax * 2.0 ** -23


CODECS: dict[str, Codec] = {"exact": Codec(), "f16": F16Codec(), "q80": Q80Codec()}


def get_codec(name, dtype: np.dtype) -> Codec:
    """The codec for an all-reduce of `dtype`: None or the dtype's own name means exact."""
    if name is None or isinstance(name, Codec) and name.exact:
        return CODECS["exact"]
    if isinstance(name, Codec):
        codec = name
    else:
        key = str(name).lower()
        aliases = {"f32": "float32", "fp32": "float32", "f64": "float64", "fp16": "f16", "q8_0": "q80", "q8": "q80"}
        key = aliases.get(key, key)
        if key in ("exact", "float32", "float64", "float16") and (key == "exact" or np.dtype(key) == dtype):
            return CODECS["exact"]
        if key in ("float32", "float64", "float16"):
            raise ValueError(f"codec {name!r} does not match the array's dtype {dtype}; "
                             "the wire codecs are exact (the array's dtype), f16 and q80")
        try:
            codec = CODECS[key]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}; choose from exact, f16, q80") from None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)):
        raise ValueError(f"codec {codec.name!r} needs a float array, got {dtype}")
    return codec
