"""How each layer's two output projections (attention output Wo, FFN down W2) become whole across
nodes: the two ways of splitting them, and the collectives each needs.

Every node holds its heads' attention output and its slice of the FFN hidden layer, a (T, its
columns). The projection W @ a needs all the columns:

    reduce  W is split by columns: each node computes W[:, its cols] @ a, a partial sum over its
            columns, and one all-reduce adds the partials (one sync, the fewest bytes). The sum
            is in another order than one node's single dot product, so results differ from one
            node's in the last bits, and this model amplifies such bits (wide: partials in
            float64, summed exactly and rounded once, so N nodes match 1 node in that mode).
    gather  W is split by rows: an all-gather gives every node the whole a, each node computes
            its rows of W @ a whole (the 1-node dot products, in the same order), and a second
            all-gather assembles the result. N nodes compute bit for bit what one node (and
            llama.cpp) computes. The activations can travel as the Q8 blocks the next matmul
            quantizes them to anyway (q8), so the exactness costs no extra bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .kernels.activations import Activations, Q8Activations
from .quant import QK, QType
from .weights import Matrix

# weight formats whose matmul quantizes x to Q8
_Q8_MATMUL = (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.IQ4_NL)


class Collectives(Protocol):
    """What a forward pass needs from the other nodes (a `ProcessGroup` serves it, see NodeStep)."""

    async def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        """The sum over nodes of `partial` (same shape everywhere)."""

    async def all_gather(self, part: np.ndarray, counts: list[int]) -> np.ndarray:
        """1-D concatenation of every node's flat `part` (node i holds counts[i] values)."""


class Alone:
    """The collectives of a 1-node run: nothing to combine."""

    async def all_reduce(self, partial):
        return partial

    async def all_gather(self, part, counts):
        return part.reshape(-1)


ALONE = Alone()


@dataclass(frozen=True)
class Reduce:
    wide: bool = False  # partials in float64 (--sync-dtype f64)

    async def project(self, w: Matrix, a: np.ndarray, cols: str, comm: Collectives) -> np.ndarray:
        if a.shape[1] == 0:  # a node without heads still takes part in the sum
            partial = np.zeros((a.shape[0], w.rows), np.float64 if self.wide else np.float32)
        else:
            partial = w.matmul(a, wide=self.wide)
        return await comm.all_reduce(partial)


@dataclass(frozen=True)
class Gather:
    """Per node (in rank order): its attention-output columns, FFN hidden columns and output rows."""

    att_cols: tuple[int, ...]
    ffn_cols: tuple[int, ...]
    out_rows: tuple[int, ...]
    q8: bool = False  # activations travel as Q8 blocks where the matmul that reads them is Q8

    @classmethod
    def of(cls, shards, head_dim: int, q8: bool = False) -> "Gather":
        return cls(tuple(s.n_q_heads * head_dim for s in shards), tuple(s.ffn[1] - s.ffn[0] for s in shards),
                   tuple(s.rows[1] - s.rows[0] for s in shards), q8)

    def sends_q8(self, qtype: QType, cols: str) -> bool:
        """Whether the input of a `qtype` matmul over the "att" or "ffn" columns travels as Q8
        blocks: with q8, where the matmul reads them and every node's columns are whole blocks."""
        counts = self.att_cols if cols == "att" else self.ffn_cols
        return self.q8 and travels_as_q8(qtype) and all(c % QK == 0 for c in counts)

    async def project(self, w: Matrix, a: np.ndarray, cols: str, comm: Collectives) -> np.ndarray:
        counts = self.att_cols if cols == "att" else self.ffn_cols
        if self.sends_q8(w.qtype, cols):
            whole = Activations.from_q8(await _gather_q8(Q8Activations.quantize(a), counts, comm))
        else:
            whole = await gather_columns(a, counts, comm)
        return await gather_columns(w.matmul(whole), self.out_rows, comm)


def travels_as_q8(qtype: QType) -> bool:
    """Whether gather mode's q80 sends a matmul's input as Q8 blocks: where the matmul reads those
    (the 32-value block formats; K-quants read Q8_K, F16/F32 the values)."""
    return qtype in _Q8_MATMUL


async def gather_columns(a: np.ndarray, counts, comm: Collectives) -> np.ndarray:
    """(T, counts[me]) on every node -> (T, sum(counts)), node i's columns in i-th place."""
    T = a.shape[0]
    flat = await comm.all_gather(np.ascontiguousarray(a).reshape(-1), [T * c for c in counts])
    if T == 1:
        return flat.reshape(1, -1)
    return np.concatenate([blk.reshape(T, c) for blk, c in zip(_split(flat, [T * c for c in counts]), counts)],
                          axis=1)


async def _gather_q8(mine: Q8Activations, counts, comm: Collectives) -> Q8Activations:
    """Every node's Q8 blocks, assembled as if the whole row had been quantized at once (blocks
    are independent and node slices start on block boundaries). A row of c values travels as
    c int8, c/32 f16 scales d and c/32 f16 sums ds: 36 bytes per 32 values."""
    T, c = mine.q.shape
    wire = np.concatenate([mine.q.view(np.uint8), mine.d.astype(np.float16).view(np.uint8),
                           mine.ds.astype(np.float16).view(np.uint8)], axis=1)
    sizes = [T * n * 36 // QK for n in counts]
    flat = await comm.all_gather(wire.reshape(-1), sizes)
    q, d, ds = [], [], []
    for blk, n in zip(_split(flat, sizes), counts):
        rows = blk.reshape(T, n * 36 // QK)
        q.append(rows[:, :n].view(np.int8))
        d.append(rows[:, n:n + n // 16].view(np.float16))
        ds.append(rows[:, n + n // 16:].view(np.float16))
    return Q8Activations(np.concatenate(q, axis=1),
                         np.concatenate(d, axis=1).astype(np.float32), np.concatenate(ds, axis=1).astype(np.float32))


def _split(flat: np.ndarray, sizes) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(sizes)[:-1])
