"""The planner: which nodes a model runs on, each one's share and the sync mode, chosen from what was
measured, with the milliseconds per token each candidate is predicted to take (compute + sync).

What it sees of each node: its matmul rate (GMAC/s: the workers measure at the same time, so
workers that share a machine's cores share them in the figures too; the root measures after) and the
memory it admits; of the network, the slowest link's seconds per message and per byte (as `--sync-mode auto`
times them). A token's time is the slowest node's compute (the nodes wait for each other at every
sync point) plus the collectives' cost model for the sync mode (sync_config). The candidates: the root
with the k fastest workers, k = 0..all, each split in proportion to speed as far as memory allows;
so a node that slows the cluster down is left out when the others are faster without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig
from .errors import DllamaError
from .plan import Plan, kv_cache_bytes, shard_tensor_shapes
from .sync_config import LinkFigures, SyncConfig

MAX_GMACS = 1e5  # a measured rate above this (100 TMAC/s on a CPU) is not believed


@dataclass(frozen=True)
class NodeFigures:
    name: str
    gmacs: float | None  # measured matmul rate; None where unknown or absurd (0, negative, NaN, huge)
    mem_available: int | None  # bytes it admits for a slice and its KV cache; None: unknown

    @classmethod
    def of(cls, name: str, gmacs, mem_available) -> "NodeFigures":
        """Figures as a node reported them, the absurd ones (a worker or a TXT record may lie) unknown."""
        rate = gmacs if isinstance(gmacs, (int, float)) and math.isfinite(gmacs) and 0 < gmacs <= MAX_GMACS else None
        memory = mem_available if isinstance(mem_available, int) and mem_available >= 0 else None
        return cls(name, rate, memory)


@dataclass(frozen=True)
class Candidate:
    members: tuple[int, ...]  # indices of the nodes used (0: the root)
    weights: tuple[float, ...]  # their shares
    sync: SyncConfig
    compute_s: float  # per decoded token: the slowest member's
    sync_s: float
    short: str | None = None  # why it cannot run (a member's slice does not fit its memory)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.sync_s


def macs_per_token(config: ModelConfig, shapes: dict) -> float:
    """Multiply-adds a node does for one decoded token with the matrices of `shapes`
    (plan.shard_tensor_shapes): of a mixture's expert stacks, the experts a token uses."""
    total = 0.0
    for name, shape in shapes.items():
        if isinstance(shape, int):
            continue
        macs = math.prod(shape)
        if len(shape) == 3:  # an expert stack
            macs *= config.n_experts_used / shape[0]
        total += macs
    return total


def candidates(config: ModelConfig, nodes: list[NodeFigures], link: LinkFigures, sync: SyncConfig,
               slice_bytes, ctx_size: int, q8_attention: bool = False, q8_ffn: bool = False) -> list[Candidate]:
    """Every candidate with its prediction. nodes[0] is the root; slice_bytes(plan, mode) -> each
    shard's peak bytes while it loads (plan.slice_peak_bytes of its tensors), for the memory check."""
    rate = [n.gmacs for n in nodes]
    known = [r for r in rate if r is not None]
    fallback = min(known) if known else 1.0  # an unknown rate counts as the slowest known one
    rate = [fallback if r is None else r for r in rate]
    # what the whole model takes on one node; a node's part of it scales with its share
    whole = slice_bytes(Plan.single(config), "reduce")[0] + kv_cache_bytes(config, config.n_kv_heads, ctx_size)
    cap = [math.inf if n.mem_available is None else n.mem_available / whole for n in nodes]
    workers = sorted(range(1, len(nodes)), key=lambda i: -rate[i])
    found = []
    for k in range(len(workers) + 1):
        members = (0, *workers[:k])
        for mode in (sync.candidates() if len(members) > 1 else [sync.alone()]):
            try:
                weights, plan, short = _fit(config, [nodes[i] for i in members], [rate[i] for i in members],
                                            [cap[i] for i in members], mode.mode, slice_bytes, ctx_size)
            except DllamaError as e:  # more nodes than the model can be cut for, or a cut this mode cannot make
                found.append(Candidate(members, (), mode, math.inf, math.inf, str(e)))
                continue
            if plan is None:
                found.append(Candidate(members, (), mode, math.inf, math.inf, short))
                continue
            compute = max(macs_per_token(config, shard_tensor_shapes(config, shard, mode.mode)) / (rate[i] * 1e9)
                          for i, shard in zip(members, plan.shards))
            predicted = 0.0 if len(members) == 1 else mode.predicted_sync_seconds(
                config, len(members), link, q8_attention, q8_ffn)
            found.append(Candidate(members, tuple(weights), mode, compute, predicted, short))
    return found


def _fit(config, nodes, rates, caps, mode: str, slice_bytes, ctx_size: int, tries: int = 8):
    """(shares, plan, why it does not fit or None) of these nodes: in proportion to their rates, each
    within its memory. The plan cuts heads and blocks in whole units, so a node's real part may exceed
    its share: its cap is lowered by what it lacked and the shares filled again."""
    caps, why = list(caps), None
    for _ in range(tries):
        weights = fill(rates, caps)
        if weights is None:
            held = sum(min(c, 1.0) for c in caps)
            return None, None, why or f"{len(nodes)} node(s) hold {held:.0%} of the model"
        plan = Plan.split(config, weights)
        lacking = {}
        for j, (node, shard, held) in enumerate(zip(nodes, plan.shards, slice_bytes(plan, mode))):
            need = held + kv_cache_bytes(config, shard.n_kv_heads, ctx_size)
            if node.mem_available is not None and need > node.mem_available:
                lacking[j] = (need, node.mem_available)
        if not lacking:
            return weights, plan, None
        for j, (need, available) in lacking.items():
            caps[j] = weights[j] * available / need * 0.99
            why = f"{nodes[j].name} needs {need / 1e6:.0f} MB, has {available / 1e6:.0f} MB"
    return weights, plan, why


def fill(rates: list[float], caps: list[float]) -> list[float] | None:
    """Shares in proportion to `rates`, none above its cap (the share of the model its memory holds):
    what a capped node cannot take goes to the others, in proportion. None where the caps add up to
    less than the model, or a node could take almost nothing."""
    shares, free = [0.0] * len(rates), set(range(len(rates)))
    left = 1.0
    while free:
        total = sum(rates[i] for i in free)
        over = [i for i in free if left * rates[i] / total > caps[i]]
        if not over:
            for i in free:
                shares[i] = left * rates[i] / total
            break
        for i in over:
            shares[i] = caps[i]
            left -= caps[i]
            free.discard(i)
    if left < -1e-12 or (not free and left > 1e-9) or min(shares) < 1e-3:
        return None
    return shares


def choose(found: list[Candidate]) -> Candidate:
    """The candidate that runs with the least predicted time per token (fewer nodes on a tie); an
    error line if none fits."""
    runnable = [c for c in found if c.short is None]
    if not runnable:
        reasons = "; ".join(sorted({c.short for c in found if c.short}))
        raise DllamaError(f"no plan fits the nodes' memory: {reasons}")
    return min(runnable, key=lambda c: (c.total_s, len(c.members)))
