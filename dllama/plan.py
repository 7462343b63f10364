"""The split plan: which slice of every weight matrix each node holds.

- Attention by whole heads. GQA: while there are at least as many KV heads as nodes, the unit is
  a KV group (one KV head and its query heads); past that, query heads are split one by one and
  each node keeps (replicates) the KV heads its query heads read.
- FFN by hidden units (rows of W1/W3 = columns of W2), in whole quant blocks (256-value
  super-blocks where W2 is a K-quant: config.ffn_block). A mixture of
  experts the same way: each node holds the same hidden units of *every* expert (and the whole
  router), so whichever experts a token picks, all nodes compute their slice of them and the FFN
  keeps its one sync point; a node's weights are its share of all experts (`dllama models plan`).
- LM head by vocabulary rows.
- Output rows (the model dimension) of the attention output and FFN down projections: the slice
  a node computes whole in gather mode (see model.py), where those two matrices are split by rows.
Shares follow per-node weights (e.g. 2,1,1 or measured speeds) by the largest-remainder rule.
What a shard then holds: each tensor's shape (`shard_tensor_shapes`) and its KV caches' bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import ModelConfig
from .errors import DllamaError
from .kv_cache import bytes_per_position, round_capacity


@dataclass(frozen=True)
class Shard:
    node: int
    q_heads: tuple[int, int]  # [start, stop) of query heads
    kv_heads: tuple[int, int]  # [start, stop) of the KV heads those query heads read
    ffn: tuple[int, int]  # [start, stop) of FFN hidden units
    vocab: tuple[int, int]  # [start, stop) of vocabulary rows of the LM head
    rows: tuple[int, int]  # [start, stop) of output rows of Wo and W2 (used in gather mode)

    @property
    def n_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Shard":
        return cls(d["node"], tuple(d["q_heads"]), tuple(d["kv_heads"]), tuple(d["ffn"]), tuple(d["vocab"]),
                   tuple(d["rows"]))


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    shards: tuple[Shard, ...]

    @property
    def n_nodes(self) -> int:
        return len(self.shards)

    @classmethod
    def single(cls, config: ModelConfig) -> "Plan":
        return cls.split(config, [1.0])

    @classmethod
    def split(cls, config: ModelConfig, weights: list[float]) -> "Plan":
        n = len(weights)
        if n < 1 or any(w <= 0 for w in weights):
            raise DllamaError(f"node weights must be positive, got {weights}")
        unit = config.ffn_block
        if config.ffn_dim % unit:
            raise DllamaError(f"FFN size {config.ffn_dim} is not a multiple of the quant block {unit}")
        if n > config.ffn_dim // unit:
            raise DllamaError(f"{n} nodes is more than the {config.ffn_dim // unit} FFN blocks of {unit} of this model")

        g = config.group_size
        if n <= config.n_kv_heads:
            q_counts = [c * g for c in split_units(config.n_kv_heads, weights)]
        else:
            q_counts = split_units(config.n_heads, weights)
        ffn_counts = [c * unit for c in split_units(config.ffn_dim // unit, weights)]
        vocab_counts = split_units(config.vocab_size, weights)
        row_counts = split_units(config.dim, weights)

        shards, q0, f0, v0, r0 = [], 0, 0, 0, 0
        for node in range(n):
            q1, f1, v1, r1 = q0 + q_counts[node], f0 + ffn_counts[node], v0 + vocab_counts[node], r0 + row_counts[node]
            kv = (q0 // g, -(-q1 // g)) if q1 > q0 else (0, 0)
            shards.append(Shard(node, (q0, q1), kv, (f0, f1), (v0, v1), (r0, r1)))
            q0, f0, v0, r0 = q1, f1, v1, r1
        return cls(config, tuple(shards))


def split_units(total: int, weights: list[float]) -> list[int]:
    """Divide `total` indivisible units in proportion to `weights` (largest remainder, ties to the
    earlier node), so the counts add up to `total` exactly."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def shard_tensor_shapes(config: ModelConfig, shard: Shard, mode: str = "reduce") -> dict[str, tuple[int, int] | int]:
    """The shape of every tensor `shard_tensors` cuts for a shard, by name: (rows, cols) of a
    matrix, (experts, rows, cols) of a stack of experts, the length of a vector. Leaves out
    rope_freqs, which only some models have."""
    hd, dim = config.head_dim, config.dim
    nq, nkv = shard.n_q_heads * hd, shard.n_kv_heads * hd
    nf, nrows = shard.ffn[1] - shard.ffn[0], shard.rows[1] - shard.rows[0]
    by_rows = mode == "gather"
    shapes: dict[str, tuple[int, int] | int] = {}
    ffn, n_exp = ("_exps", (config.n_experts,)) if config.n_experts else ("", ())
    for i in range(config.n_layers):
        shapes.update({
            f"blk.{i}.attn_norm": dim, f"blk.{i}.attn_q": (nq, dim), f"blk.{i}.attn_k": (nkv, dim),
            f"blk.{i}.attn_v": (nkv, dim),
            f"blk.{i}.attn_output": (nrows, config.n_heads * hd) if by_rows else (dim, nq),
            f"blk.{i}.ffn_norm": dim, f"blk.{i}.ffn_gate{ffn}": n_exp + (nf, dim),
            f"blk.{i}.ffn_up{ffn}": n_exp + (nf, dim),
            f"blk.{i}.ffn_down{ffn}": n_exp + ((nrows, config.ffn_dim) if by_rows else (dim, nf))})
        if config.n_experts:
            shapes[f"blk.{i}.ffn_gate_inp"] = (config.n_experts, dim)
        if config.ffn_bias:
            shapes.update({f"blk.{i}.ffn_gate.bias": nf, f"blk.{i}.ffn_up.bias": nf})
        if config.ffn_down_bias:
            shapes[f"blk.{i}.ffn_down.bias"] = dim
        if config.post_norms:
            shapes.update({f"blk.{i}.post_attention_norm": dim, f"blk.{i}.post_ffw_norm": dim})
        if config.attn_bias:
            shapes.update({f"blk.{i}.attn_q.bias": nq, f"blk.{i}.attn_k.bias": nkv, f"blk.{i}.attn_v.bias": nkv})
        if config.attn_out_bias:
            shapes[f"blk.{i}.attn_output.bias"] = dim
        if config.qk_norm:
            shapes.update({f"blk.{i}.attn_q_norm": hd, f"blk.{i}.attn_k_norm": hd})
    shapes["output_norm"] = dim
    shapes["output"] = (shard.vocab[1] - shard.vocab[0], dim)
    return shapes


def kv_cache_bytes(config: ModelConfig, n_kv_heads: int, positions: int) -> int:
    """RAM of a node's KV caches holding `positions` in all (f16 K and V of its KV heads, every
    layer): what a plan must fit."""
    return bytes_per_position(config, n_kv_heads) * round_capacity(positions)


def slice_peak_bytes(tensor_bytes: list[int]) -> int:
    """What a node's slice of the model (its part of each tensor) takes while it loads: every part, and
    the largest once more (a part arrives whole, or is read from the file, before it is packed)."""
    return sum(tensor_bytes) + max(tensor_bytes, default=0)


def check_fits(node: str, needed: int, available: int | None, advice: str) -> None:
    """A node's slice of the model and its KV cache must fit the memory it has (None: unknown, not
    checked): refused before loading, rather than the kernel killing the process while it loads."""
    if available is not None and needed > available:
        raise DllamaError(f"model too big for the plan: {node} needs {needed / 1e6:.0f} MB for its slice and KV cache "
                          f"but has {available / 1e6:.0f} MB available ({advice})")


KV_SHARE_OF_FREE_RAM = 0.5  # the default KV budget's share of the memory left after the weights


def default_kv_budget(config: ModelConfig, ctx_size: int, slots: int, nodes: list[tuple[int | None, int, int]]) -> int:
    """Positions the KV caches of `slots` sequences may hold by default: a whole context each, but
    no more than half of what each node has left after its weights ((available bytes or None,
    weight bytes, its KV heads) per node), and never less than one context."""
    one = round_capacity(ctx_size)
    budget = one * slots
    for available, weights, n_kv_heads in nodes:
        if available is not None and n_kv_heads:
            room = max(available - weights, 0) * KV_SHARE_OF_FREE_RAM
            budget = min(budget, int(room // bytes_per_position(config, n_kv_heads)) // 32 * 32)
    return max(budget, one)
