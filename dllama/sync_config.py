"""How a cluster's nodes combine their parts, parsed once where the user says it (the CLI) and
carried as one frozen value: the all-reduce algorithm, the mode of the output projections (reduce
partial sums, or gather whole rows) and the payload dtype of the sync points (which says the codec
the collectives use and how wide the partial sums are).

`--sync-mode auto` is settled by the root when it forms a session: both modes compute the same
multiply-adds per node (reduce mode's column slices are packed into rows at load), so what differs
is the sync. Per layer and token, reduce runs two all-reduces of `dim` partial sums; gather runs four
all-gathers (attention output, Wo's rows, FFN hidden, W2's rows) that carry more values but, where
the next matmul reads Q8 blocks, as those blocks (a quarter of f32, and exact). So a link where a
message's latency dominates favours reduce (fewer collectives), a link where bytes dominate favours
gather with Q8; `choose` prices both with the collectives' alpha-beta model on the measured link."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import DllamaError

SYNC_MODES = ("reduce", "gather")  # what a session runs
MODE_CHOICES = SYNC_MODES + ("auto",)  # what a user may ask for
CODEC_OF_DTYPE = {"f32": None, "f64": None, "f16": "f16", "q80": "q80"}  # f64: partial sums in float64
SYNC_DTYPES = tuple(CODEC_OF_DTYPE)
GATHER_DTYPES = ("f32", "q80")  # gather mode sums nothing across nodes: these two are exact
DEFAULT_DTYPE = {"reduce": "f32", "gather": "q80"}  # where the user names none
# per partial sum on the wire (the sync codec's q80: an f32 scale and 32 int8, sync/codecs.py)
_REDUCE_BYTES = {"f32": 4.0, "f64": 8.0, "f16": 2.0, "q80": 36 / 32}
_Q8_GATHER_BYTES = 36 / 32  # int8 values, an f16 scale and an f16 sum per 32 (projection._gather_q8)


@dataclass(frozen=True)
class LinkFigures:
    """The cluster's slowest measured link: seconds per message (alpha) and per byte (beta), and
    seconds per byte of a local reduction (gamma)."""

    alpha: float
    beta: float
    gamma: float

    def describe(self) -> str:
        return f"{self.alpha * 1e6:.0f} us per message, {1e-6 / max(self.beta, 1e-15):.0f} MB/s"


@dataclass(frozen=True)
class SyncConfig:
    algo: str = "auto"
    mode: str = "reduce"
    dtype: str | None = None  # None: the mode's default (DEFAULT_DTYPE), or auto's choice

    def __post_init__(self):
        from .sync import algo_name  # here: `dllama models` reads this module's names without the collectives

        try:
            object.__setattr__(self, "algo", algo_name(self.algo))
        except ValueError as e:
            raise DllamaError(str(e)) from None
        if self.mode not in MODE_CHOICES:
            raise DllamaError(f"unknown sync mode {self.mode!r} ({', '.join(MODE_CHOICES)})")
        if self.dtype is None and self.mode != "auto":
            object.__setattr__(self, "dtype", DEFAULT_DTYPE[self.mode])
        if self.dtype is not None and self.dtype not in CODEC_OF_DTYPE:
            raise DllamaError(f"unknown sync dtype {self.dtype!r} ({', '.join(SYNC_DTYPES)})")
        if self.mode == "gather" and self.dtype not in GATHER_DTYPES:
            raise DllamaError(f"--sync-mode gather carries f32 or q80 (both exact), not {self.dtype}")

    @property
    def codec(self) -> str | None:
        """The collectives' wire codec (None: the values as they are)."""
        return CODEC_OF_DTYPE[self._settled().dtype]

    def projection(self, shards, head_dim: int):
        """How the nodes make the output projections whole: a `Reduce` or a `Gather` (dllama.projection)."""
        from .projection import Gather, Reduce  # here, for the same reason

        if self._settled().mode == "gather":
            return Gather.of(shards, head_dim, q8=self.dtype == "q80")
        return Reduce(wide=self.dtype == "f64")

    def _settled(self) -> "SyncConfig":
        if self.mode == "auto":
            raise RuntimeError("sync mode auto is settled by the root (SyncConfig.choose) before it is used")
        return self

    # ------------------------------------------------------------------ auto

    def alone(self) -> "SyncConfig":
        """The configuration of a single node (nothing to sync: auto is reduce)."""
        return replace(self, mode="reduce") if self.mode == "auto" else self

    def candidates(self) -> list["SyncConfig"]:
        """What auto chooses from: reduce, and gather unless the dtype asked for is one it cannot carry."""
        if self.mode != "auto":
            return [self]
        modes = ["reduce"] + (["gather"] if self.dtype in (None, *GATHER_DTYPES) else [])
        return [replace(self, mode=m) for m in modes]

    def layer_collectives(self, config, q8_attention: bool, q8_ffn: bool) -> list[tuple[str, float]]:
        """(collective, bytes) of one layer's syncs for one token. q8_*: whether the matmul after
        that gather reads Q8 blocks (they travel as such with q80; else as f32)."""
        self._settled()
        if self.mode == "reduce":
            return [("all_reduce", config.dim * _REDUCE_BYTES[self.dtype])] * 2
        q8 = self.dtype == "q80"
        hidden = config.ffn_dim * max(config.n_experts_used, 1)  # an MoE gathers each chosen expert's
        return [("all_gather", config.n_heads * config.head_dim * (_Q8_GATHER_BYTES if q8 and q8_attention else 4)),
                ("all_gather", config.dim * 4.0),
                ("all_gather", hidden * (_Q8_GATHER_BYTES if q8 and q8_ffn else 4)),
                ("all_gather", config.dim * 4.0)]

    def predicted_sync_seconds(self, config, n_nodes: int, link: LinkFigures, q8_attention: bool,
                               q8_ffn: bool) -> float:
        """Seconds of sync per decoded token on `link`, by the collectives' cost model."""
        from .sync.auto import predicted_seconds

        # (the engine's all-reduces sum in rank order: NodeStep.all_reduce)
        per_layer = sum(predicted_seconds(c, self.algo, n, n_nodes, link.alpha, link.beta, link.gamma,
                                          in_rank_order=c == "all_reduce")
                        for c, n in self.layer_collectives(config, q8_attention, q8_ffn))
        return config.n_layers * per_layer

    def choose(self, config, n_nodes: int, link: LinkFigures, q8_attention: bool, q8_ffn: bool,
               candidates: list["SyncConfig"] | None = None) -> tuple["SyncConfig", dict[str, float]]:
        """The candidate (default: all of them) with the least predicted sync per token (reduce on
        a tie), and each candidate's prediction by its label."""
        predicted = {c: c.predicted_sync_seconds(config, n_nodes, link, q8_attention, q8_ffn)
                     for c in (candidates or self.candidates())}
        best = min(predicted, key=predicted.get)
        return best, {c.label: t for c, t in predicted.items()}

    @property
    def label(self) -> str:
        return f"{self.mode} ({self.dtype})"
