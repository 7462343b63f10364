"""Where each rank's values sit in a collective's buffers: argument checks, per-rank offsets, the
gathered array's shape, scatter's blocks and the small header that tells a rank its block's dtype
and shape. Pure functions of shapes and counts: the collectives' bodies never deal with them."""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from ..net import frames as F
from .base import split
from .ops import NUMERIC_DTYPES, _is_loc


def flat(a, what="array", writable=True) -> np.ndarray:
    """`a` as a 1-D view, after checking it can travel (and, if `writable`, receive)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (np.ascontiguousarray makes it so)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only")
    if a.dtype.hasobject:
        raise TypeError(f"{what} has an object dtype; only plain numeric data can be sent")
    return a.reshape(-1)


def offsets(counts, size, what) -> list[int]:
    """Start of each rank's block (and the end), in values, from the values per rank."""
    counts = [int(x) for x in counts]
    if len(counts) != size or any(x < 0 for x in counts):
        raise ValueError(f"{what}: counts must be {size} non-negative integers, got {counts}")
    offs = [0]
    for x in counts:
        offs.append(offs[-1] + x)
    return offs


def gathered(a: np.ndarray, values: np.ndarray, counts, size: int, rank: int, what: str):
    """(shape of the gathered array, byte offset of each rank's part): (p, *a.shape) for equal
    parts, or with `counts` (values per rank) the 1-D concatenation."""
    if counts is None:
        return (size,) + a.shape, [r * values.nbytes for r in range(size + 1)]
    eoffs = offsets(counts, size, what)
    if eoffs[rank + 1] - eoffs[rank] != values.size:
        raise ValueError(f"{what}: counts[{rank}] must be this rank's size {values.size}")
    return (eoffs[-1],), [o * values.dtype.itemsize for o in eoffs]


def scattered(a: np.ndarray, values: np.ndarray, counts, size: int):
    """(each rank's block shape, byte offset of each block) of root's `a`: blocks of `counts`
    values, or the rows of a 2-D+ `a` with p rows, else a near-equal split of the values."""
    if counts is not None:
        eoffs = offsets(counts, size, "scatter")
        if eoffs[-1] != values.size:
            raise ValueError(f"scatter: counts add up to {eoffs[-1]}, the array has {values.size} values")
        shapes = [(eoffs[r + 1] - eoffs[r],) for r in range(size)]
    elif a.ndim >= 2 and a.shape[0] == size:
        shapes = [a.shape[1:]] * size
        eoffs = [r * (values.size // size) for r in range(size + 1)]
    else:
        eoffs = split(values.size, size)
        shapes = [(eoffs[r + 1] - eoffs[r],) for r in range(size)]
    return shapes, [o * values.dtype.itemsize for o in eoffs]


def deliver(block: np.ndarray, out, what: str) -> np.ndarray:
    """`block`, or copied into `out` (checked) and `out` returned."""
    if out is None:
        return block
    o = flat(out, "out")
    if o.size != block.size or o.dtype != block.dtype:
        raise ValueError(f"{what}: out must hold {block.size} {block.dtype} values, not {o.size} {o.dtype}")
    o[:] = block.reshape(-1)
    return out


def block_header(dtype: np.dtype, shape) -> bytes:
    """What a scattered block's receiver learns first: its dtype and shape."""
    return F.pack_msg({"dtype": dtype.descr if dtype.names else dtype.str, "shape": list(shape)})


def read_block_header(body, peer, max_bytes: int) -> tuple[np.dtype, tuple]:
    """A block header from `peer`, checked: a known dtype and a shape of at most `max_bytes`."""
    try:
        msg = F.unpack_msg(body)
        descr = msg["dtype"]
        dtype = np.dtype([tuple(f) for f in descr] if isinstance(descr, list) else descr)
        shape = tuple(int(x) for x in msg["shape"])
    except Exception as e:
        raise ProtocolError(f"unreadable scatter header: {e}", peer) from None
    if not (dtype in NUMERIC_DTYPES or _is_loc(dtype) or dtype == np.dtype(np.uint8)):
        raise ProtocolError(f"scatter of unsupported dtype {dtype}", peer)
    if any(x < 0 for x in shape) or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > max_bytes:
        raise ProtocolError(f"scatter block of shape {shape} is too large", peer)
    return dtype, shape
