"""A mixture-of-experts FFN (Qwen3-MoE), as llama.cpp computes it (build_moe_ffn with softmax
gating and renormalized weights):

    probs   = softmax(router @ h)                      the router is replicated on every node
    experts = the k most probable, highest first
    weights = probs[experts] / sum(probs[experts])
    out     = sum over j of weights[j] * down_e(silu(gate_e @ h) * up_e @ h),  e = experts[j]

In tensor parallelism every node holds the same slice of every expert (rows of gate and up, the
matching columns of down, or in gather mode rows of down: plan.py), so a token's experts run on
all nodes at once, and the FFN's one sync point stays where the dense FFN has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .kernels.activations import Activations
from .kernels.attention import softmax
from .kernels.ops import silu_mul
from .weights import Experts

_MIN_WEIGHT_SUM = np.float32(6.103515625e-5)  # llama.cpp clamps the sum (the smallest normal f16)


@dataclass(frozen=True)
class Routes:
    """Each token's experts (T, k), most probable first, and their weights (T, k) float32."""

    experts: np.ndarray
    weights: np.ndarray

    @cached_property
    def by_expert(self) -> list[tuple[int, np.ndarray]]:
        """(expert, flat slot indices t*k+j that use it) for every expert some token chose; found
        once, for the up/gate and the down projections alike."""
        flat = self.experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        cuts = np.flatnonzero(np.diff(flat[order])) + 1
        return [(int(flat[slots[0]]), slots) for slots in np.split(order, cuts) if len(slots)]


def route(logits: np.ndarray, k: int) -> Routes:
    """The top-k experts of each token from the router's logits (T, n_experts)."""
    probs = softmax(logits)
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, experts, axis=1)
    total = np.zeros(len(weights), np.float64)
    for j in range(k):  # in order, in double, as GGML's sum_rows
        total += weights[:, j]
    return Routes(experts, weights / np.maximum(total.astype(np.float32), _MIN_WEIGHT_SUM)[:, None])


def expert_activations(h: Activations, routes: Routes, gate: Experts, up: Experts) -> np.ndarray:
    """silu(gate_e @ h_t) * (up_e @ h_t) of this node's hidden units, for every token t and its
    j-th expert e, in row t*k + j: (T*k, hidden units)."""
    k = routes.experts.shape[1]
    out = np.empty((routes.experts.size, gate.rows), np.float32)
    for e, slots in routes.by_expert:
        x = h.take(slots // k)
        out[slots] = silu_mul(gate[e].matmul(x), up[e].matmul(x))
    return out


@dataclass(frozen=True)
class RoutedDown:
    """The down projections of each token's experts, weighted and summed: what the FFN's output
    projection multiplies by (projection.py treats it as the matrix W2), from activations of
    T*k rows (`expert_activations`, or gathered from every node) to (T, rows)."""

    down: Experts
    routes: Routes

    @property
    def qtype(self):
        return self.down.qtype

    @property
    def rows(self) -> int:
        return self.down.rows

    def matmul(self, a, wide: bool = False) -> np.ndarray:
        a = a if isinstance(a, Activations) else Activations(a)
        T, k = self.routes.experts.shape
        per_slot = np.empty((T * k, self.rows), np.float64 if wide else np.float32)
        for e, slots in self.routes.by_expert:
            per_slot[slots] = self.down[e].matmul(a.take(slots), wide=wide)
        weighted = per_slot.reshape(T, k, self.rows) * self.routes.weights[:, :, None].astype(per_slot.dtype)
        out = weighted[:, 0].copy()
        for j in range(1, k):  # expert after expert, as llama.cpp adds them
            out += weighted[:, j]
        return out
