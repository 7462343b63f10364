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


class Q80Codec(Codec):
    name = "q80"
    granule = QK
    exact = False

    def wire_nbytes(self, count, itemsize):
        return -(-count // QK) * Q80_BLOCK.itemsize

    def wire_offset(self, index, itemsize):
        return index // QK * Q80_BLOCK.itemsize

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        n = x.size
        full = n // QK
        blocks = wire.view(Q80_BLOCK)
        if full:
            self._encode_blocks(x[: full * QK].reshape(full, QK), blocks[:full])
        if n % QK:
            tail = np.zeros((1, QK), dtype=np.float32)
            tail[0, : n % QK] = x[full * QK:]
            self._encode_blocks(tail, blocks[full:])

    @staticmethod
    def _encode_blocks(xb: np.ndarray, out: np.ndarray) -> None:
        xb = xb.astype(np.float32, copy=False)
        d = np.abs(xb).max(axis=1) / np.float32(127)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
        out["d"] = d
        out["q"] = np.rint(xb * inv[:, None])

    def _values(self, wire: np.ndarray, count: int) -> np.ndarray:
        blocks = wire.view(Q80_BLOCK)
        v = blocks["q"].astype(np.float32)
        v *= blocks["d"][:, None]
        return v.reshape(-1)[:count]

    def decode(self, wire, out):
        np.copyto(out, self._values(wire, out.size), casting="unsafe")

    def decode_add(self, wire, acc):
        np.add(acc, self._values(wire, acc.size), out=acc, casting="unsafe")

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
