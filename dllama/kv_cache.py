"""A node's KV cache: one per sequence slot, each holding the keys and values of its own heads.

Several sequences decode together (continuous batching), each in its slot. A slot's cache is
sized when the root says so (its capacity, in positions: what the sequence may still need), not
at the full context, so many short conversations share the RAM one long one would take. The sum
of the capacities is bounded by the budget every node declared at set-up; a slot is freed (its
RAM returned) when its sequence is evicted. f16 like llama.cpp's default cache, V stored
transposed (as llama.cpp does without flash attention: each output dimension one dot product) in
tiles of 32 positions, so the values of the positions attended are one contiguous run
(kernels/attention.py).
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow

MAX_SLOTS = 64  # sequences whose KV caches a node keeps at once
V_TILE = 32  # positions per tile of the values (the attention's dot step: kernels/attention.py)
POSITION_STEP = V_TILE  # capacities are multiples of the attention kernel's step (its zero padding)


def round_capacity(positions: int) -> int:
    return -(-positions // POSITION_STEP) * POSITION_STEP


def bytes_per_position(config: ModelConfig, n_kv_heads: int) -> int:
    """f16 K and V of n_kv_heads heads, every layer."""
    return 2 * 2 * config.n_layers * n_kv_heads * config.head_dim


class KVCache:
    """Slots 0..n_slots-1, each None (empty) or K (layers, heads, capacity, head_dim) and V in
    tiles (layers, heads, capacity / V_TILE, head_dim, V_TILE)."""

    def __init__(self, config: ModelConfig, n_kv_heads: int, n_slots: int, max_capacity: int, budget: int):
        self.shape = (config.n_layers, n_kv_heads, config.head_dim)
        self.n_slots = n_slots
        self.max_capacity = round_capacity(max_capacity)  # one sequence's context
        self.budget = budget  # positions over all slots
        self.k: list[np.ndarray | None] = [None] * n_slots
        self.v: list[np.ndarray | None] = [None] * n_slots

    def capacity(self, slot: int) -> int:
        k = self.k[slot]
        return 0 if k is None else k.shape[2]

    def check(self, capacities: dict[int, int], freed=()) -> None:
        """Whether slots resized to `capacities` (after freeing `freed`) stay within the budget."""
        for slot, capacity in capacities.items():
            if not 0 <= slot < self.n_slots:
                raise ContextOverflow(f"slot {slot} is outside the {self.n_slots} sequence slots")
            if capacity % POSITION_STEP or not 0 < capacity <= self.max_capacity:
                raise ContextOverflow(f"a capacity of {capacity} positions is not a multiple of {POSITION_STEP} "
                                      f"within the context of {self.max_capacity}")
        total = sum(capacities.get(s, 0 if s in freed else self.capacity(s)) for s in range(self.n_slots))
        if total > self.budget:
            raise ContextOverflow(f"the KV caches would hold {total} positions, more than the budget of {self.budget}")

    def resize(self, slot: int, capacity: int) -> None:
        """Give a slot `capacity` positions, keeping what the old cache held below it."""
        if capacity == self.capacity(slot):
            return
        layers, heads, hd = self.shape
        k = np.zeros((layers, heads, capacity, hd), np.float16)
        v = np.zeros((layers, heads, capacity // V_TILE, hd, V_TILE), np.float16)
        old_k, old_v = self.k[slot], self.v[slot]
        if old_k is not None:
            keep = min(capacity, old_k.shape[2])  # (whole tiles: capacities are multiples of V_TILE)
            k[:, :, :keep] = old_k[:, :, :keep]
            v[:, :, :keep // V_TILE] = old_v[:, :, :keep // V_TILE]
        self.k[slot], self.v[slot] = k, v

    def free(self, slot: int) -> None:
        self.k[slot] = self.v[slot] = None

    def layer(self, slot: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot's K (heads, capacity, head_dim) and V (heads, capacity / V_TILE, head_dim, V_TILE) of layer i."""
        return self.k[slot][i], self.v[slot][i]
