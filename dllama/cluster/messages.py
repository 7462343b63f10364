"""The root <-> worker control messages as typed schemas: one struct per message kind, built by
the sender (`to_wire`) and checked by the receiver (`decode`) before any field is used.

A worker may face anyone who can reach its port. Everything it receives after the handshake is
proven sane here, at the boundary: types, ranges, lengths, and the consistency of the fields with
each other (heads within the model, slices tiling the plan, every tensor's shape what its shard
needs, positions within the context, token ids within the vocabulary). The kernels behind it run
unchecked, for speed. A message that fails is one `InvalidMessage` naming the field; the worker
sends it back as FAILED and logs one line.

The structs carry exactly the keys the protocol always had (see protocol.py): the wire format is
plain msgpack maps, decoded with bounded sizes by dllama.net, then checked with msgspec.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Optional, TypeVar

from msgspec import Meta

from ..config import ModelConfig
from ..plan import Shard, kv_cache_bytes, shard_tensor_shapes, slice_peak_bytes
from ..quant import QK, QType
from ..kv_cache import MAX_SLOTS, POSITION_STEP, round_capacity
from ..step import MAX_CTX, Step, TokenId
from ..sync import ALGO_NAMES
from ..sync_config import GATHER_DTYPES, SYNC_DTYPES, SYNC_MODES, SyncConfig
from ..wire import WireStruct, finite
from . import protocol as P
from .slices import TensorEntry

MAX_WORLD = 1024  # nodes in one cluster

Positive = Annotated[int, Meta(ge=1)]
Small = Annotated[int, Meta(ge=1, le=1 << 16)]  # dims, heads, layers
Range = tuple[Annotated[int, Meta(ge=0, le=1 << 31)], Annotated[int, Meta(ge=0, le=1 << 31)]]
Host = Annotated[str, Meta(min_length=1, max_length=255)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Session = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_.-]+$")]


_Message = WireStruct


# ------------------------------------------------------------------ root -> worker


class Probe(_Message):
    measure: bool = False  # time a matmul and report GMAC/s (for --weights auto)


class Echo(_Message):
    payload: Annotated[bytes, Meta(max_length=P.ECHO_BYTES)]  # any bytes: the root times their round trip


class WireConfig(_Message):
    """ModelConfig as it travels: every field of it, checked."""

    arch: Annotated[str, Meta(max_length=64)]
    dim: Small
    n_layers: Annotated[int, Meta(ge=1, le=4096)]
    n_heads: Small
    n_kv_heads: Small
    head_dim: Annotated[int, Meta(ge=8, le=4096, multiple_of=8)]  # the attention kernel's 8 lanes
    ffn_dim: Annotated[int, Meta(ge=QK, le=1 << 20, multiple_of=QK)]  # the plan splits it in quant blocks
    vocab_size: Annotated[int, Meta(ge=1, le=1 << 24)]
    context_length: Positive
    rope_base: Annotated[float, Meta(gt=0)]
    rope_dims: Annotated[int, Meta(ge=2, le=4096, multiple_of=2)]
    rope_neox: bool
    norm_eps: Annotated[float, Meta(gt=0, le=1)]
    tied_embeddings: bool
    attn_bias: bool = False  # optional layer parts (architectures.py)
    attn_out_bias: bool = False
    ffn_bias: bool = False
    ffn_down_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: Literal["silu", "gelu"] = "silu"
    embedding_scale: Annotated[float, Meta(gt=0)] = 1.0
    attn_q_scale: Annotated[float, Meta(ge=0)] = 0.0
    logit_softcap: Annotated[float, Meta(ge=0)] = 0.0
    sliding_window: Annotated[int, Meta(ge=0, le=MAX_CTX)] = 0
    swa_pattern: Annotated[int, Meta(ge=0, le=4096)] = 0
    rope_base_local: Annotated[float, Meta(gt=0)] = 10000.0
    n_experts: Annotated[int, Meta(ge=0, le=256)] = 0
    n_experts_used: Annotated[int, Meta(ge=0, le=256)] = 0
    ffn_block: Literal[32, 256] = 32
    rope_freq_scale: Annotated[float, Meta(gt=0)] = 1.0  # RoPE scaling (config.RopeScaling)
    rope_ext_factor: float = 0.0
    rope_corr_lo: float = 0.0
    rope_corr_hi: float = 0.0
    rope_mscale: float = 1.0
    bos_id: Optional[TokenId] = None
    eos_id: Optional[TokenId] = None

    def __post_init__(self):
        for name in ("rope_base", "rope_freq_scale", "rope_ext_factor", "rope_corr_lo", "rope_corr_hi", "rope_mscale",
                     "embedding_scale", "attn_q_scale", "logit_softcap", "rope_base_local"):
            finite(name, getattr(self, name))
        if (self.n_experts == 0) != (self.n_experts_used == 0) or self.n_experts_used > self.n_experts:
            raise ValueError(f"n_experts_used {self.n_experts_used} does not fit n_experts {self.n_experts}")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a whole number of n_kv_heads {self.n_kv_heads} groups")
        if self.rope_dims > self.head_dim:
            raise ValueError(f"rope_dims {self.rope_dims} exceeds head_dim {self.head_dim}")
        for name in ("bos_id", "eos_id"):
            token = getattr(self, name)
            if token is not None and token >= self.vocab_size:
                raise ValueError(f"{name} {token} is outside the vocabulary of {self.vocab_size}")

    @classmethod
    def of(cls, config: ModelConfig) -> "WireConfig":
        return cls(**config.to_dict())

    def model_config(self) -> ModelConfig:
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})


class WireShard(_Message):
    """plan.Shard as it travels: [start, stop) ranges."""

    node: Annotated[int, Meta(ge=0, lt=MAX_WORLD)]
    q_heads: Range
    kv_heads: Range
    ffn: Range
    vocab: Range
    rows: Range

    def __post_init__(self):
        for name in ("q_heads", "kv_heads", "ffn", "vocab", "rows"):
            start, stop = getattr(self, name)
            if start > stop:
                raise ValueError(f"{name} [{start}, {stop}) starts after it stops")

    @classmethod
    def of(cls, shard: Shard) -> "WireShard":
        return cls(**shard.to_dict())

    def shard(self) -> Shard:
        return Shard(self.node, self.q_heads, self.kv_heads, self.ffn, self.vocab, self.rows)


class Setup(_Message):
    session: Session
    rank: Annotated[int, Meta(ge=1, lt=MAX_WORLD)]  # rank 0 is the root
    world: Annotated[int, Meta(ge=2, le=MAX_WORLD)]
    addrs: list[Optional[tuple[Host, Port]]]  # where each rank accepts peers (None: it only dials)
    algo: Literal[ALGO_NAMES]
    sync_dtype: Literal[SYNC_DTYPES]
    sync_mode: Literal[SYNC_MODES]
    config: WireConfig
    shards: list[WireShard]
    ctx_size: Annotated[int, Meta(ge=1, le=MAX_CTX)]
    manifest: list[TensorEntry]
    spin: Optional[Annotated[float, Meta(ge=0, le=1)]] = None
    slots: Annotated[int, Meta(ge=1, le=MAX_SLOTS)] = 1  # sequences whose KV caches it keeps at once
    kv_budget: Optional[Annotated[int, Meta(ge=POSITION_STEP, le=MAX_SLOTS * MAX_CTX)]] = None  # positions, all slots

    def __post_init__(self):
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} is not below world {self.world}")
        if len(self.addrs) != self.world:
            raise ValueError(f"addrs has {len(self.addrs)} entries for world {self.world}")
        if self.addrs[self.rank] is None:
            raise ValueError(f"addrs[{self.rank}] is empty: this worker accepts peers, it has an address")
        if self.sync_mode == "gather" and self.sync_dtype not in GATHER_DTYPES:
            raise ValueError(f"sync_mode gather carries f32 or q80, not {self.sync_dtype}")
        if len(self.shards) != self.world:
            raise ValueError(f"shards has {len(self.shards)} entries for world {self.world}")
        one = round_capacity(self.ctx_size)
        if self.kv_budget is not None and not one <= self.kv_budget <= one * self.slots:
            raise ValueError(f"kv_budget {self.kv_budget} is not between one context ({one}) and one per slot "
                             f"({one * self.slots})")
        self._check_plan()
        self._check_manifest()

    def _check_plan(self) -> None:
        """The shards tile the model in rank order, each KV range is the one its heads read."""
        cfg = self.config
        group = cfg.n_heads // cfg.n_kv_heads
        whole = {"q_heads": cfg.n_heads, "ffn": cfg.ffn_dim, "vocab": cfg.vocab_size, "rows": cfg.dim}
        for name, total in whole.items():
            at = 0
            for i, s in enumerate(self.shards):
                start, stop = getattr(s, name)
                if start != at or stop > total:
                    raise ValueError(f"shards[{i}].{name} [{start}, {stop}) does not continue the plan at {at} "
                                     f"within {total}")
                at = stop
            if at != total:
                raise ValueError(f"the shards' {name} end at {at}, not at the model's {total}")
        for i, s in enumerate(self.shards):
            if s.node != i:
                raise ValueError(f"shards[{i}].node is {s.node}")
            q0, q1 = s.q_heads
            kv = (q0 // group, -(-q1 // group)) if q1 > q0 else (0, 0)
            if tuple(s.kv_heads) != kv:
                raise ValueError(f"shards[{i}].kv_heads {list(s.kv_heads)} are not the KV heads {list(kv)} of "
                                 f"q_heads {list(s.q_heads)} (groups of {group})")
            unit = self.config.ffn_block
            if s.ffn[0] % unit or s.ffn[1] % unit:
                raise ValueError(f"shards[{i}].ffn {list(s.ffn)} is not cut on {unit}-value blocks")
        if self.shards[self.rank].vocab[0] == self.shards[self.rank].vocab[1]:
            raise ValueError(f"shards[{self.rank}].vocab is empty: each node scores some of the vocabulary")

    def _check_manifest(self) -> None:
        """Exactly this rank's tensors, each of the shape its shard needs."""
        cfg = self.config
        expected = shard_tensor_shapes(cfg, self.shards[self.rank].shard(), self.sync_mode)
        seen = set()
        for i, e in enumerate(self.manifest):
            if e.name in seen:
                raise ValueError(f"manifest[{i}]: tensor {e.name} is listed twice")
            seen.add(e.name)
            if e.name == "rope_freqs":  # optional: one factor per rotated pair
                shape = e.cols if cfg.rope_dims // 2 <= e.cols <= cfg.head_dim // 2 else -1
            else:
                shape = expected.get(e.name)
                if shape is None:
                    raise ValueError(f"manifest[{i}]: unknown tensor {e.name!r}")
            if not isinstance(shape, int) and len(shape) == 3:  # experts travel as one matrix, one after another
                shape = (shape[0] * shape[1], shape[2])
            if isinstance(shape, int):
                if e.rows != 0 or e.qtype != QType.F32 or e.cols != shape or e.nbytes != e.nbytes_as(vector=True):
                    raise ValueError(f"manifest[{i}]: tensor {e.name} must be an f32 vector of "
                                     f"{shape if shape >= 0 else 'rope_dims/2'} values")
            elif (e.rows, e.cols) != shape or e.nbytes != e.nbytes_as(vector=False):
                raise ValueError(f"manifest[{i}]: tensor {e.name} is {e.rows}x{e.cols} in {e.nbytes} bytes, its "
                                 f"shard needs {shape[0]}x{shape[1]}")
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError(f"manifest lacks {len(missing)} tensor(s), e.g. {missing[0]}")

    def vector_names(self) -> set[str]:
        """The manifest's vectors (a matrix of no rows also has rows == 0)."""
        shapes = shard_tensor_shapes(self.config, self.shard, self.sync_mode)
        return {name for name, shape in shapes.items() if isinstance(shape, int)} | {"rope_freqs"}

    @property
    def shard(self) -> Shard:
        return self.shards[self.rank].shard()

    @property
    def sync(self) -> SyncConfig:
        return SyncConfig(self.algo, self.sync_mode, self.sync_dtype)

    def declared_bytes(self) -> int:
        """What this worker must hold: its slice of the model (at its peak, while it loads:
        plan.slice_peak_bytes) and its KV cache."""
        return (slice_peak_bytes([e.nbytes for e in self.manifest])
                + kv_cache_bytes(self.config, self.shard.n_kv_heads, self.kv_positions))

    @property
    def kv_positions(self) -> int:
        """Positions the KV caches of all slots may hold."""
        return round_capacity(self.ctx_size) * self.slots if self.kv_budget is None else self.kv_budget


def check_forward(step: Step, setup: Setup) -> Step:
    """The checks of a FORWARD that need the session: the context, the vocabulary, the frame limit."""
    return step.check(setup.ctx_size, setup.slots, setup.config.dim, setup.config.vocab_size, P.ACTIVATIONS.max_len,
                      P.FORWARD.name)


class Go(_Message):
    """All workers are loaded: join the sync group."""


class End(_Message):
    """The session is over."""


# ------------------------------------------------------------------ worker -> root


class Probed(_Message):
    gmacs: Optional[float]
    mem_available: Optional[int]  # bytes this worker admits for a slice and its KV cache
    threads: Optional[int]
    version: str


class Need(_Message):
    names: list[str]  # the tensors its slice cache lacks, in manifest order


class Loaded(_Message):
    cached: int


class Ready(_Message):
    rss_mb: float
    load_s: float
    cached: int


class StepFigures(_Message):
    step_s: float
    sync_s: float
    sent: int
    recv: int
    rss_mb: float


class Result(_Message):
    summaries: list[dict]  # LogitSummary.to_wire()
    stats: StepFigures


class Failed(_Message):
    error: str


# ------------------------------------------------------------------ encoding and decoding

M = TypeVar("M", bound=_Message)


def to_wire(message: _Message) -> dict:
    return message.to_wire()


def decode(kind, schema: type[M], body: dict) -> M:
    """body (a decoded msgpack map of frame kind `kind`) checked against its schema."""
    return schema.from_wire(body, kind.name)
