"""How a cluster's nodes combine their parts, parsed once where the user says it (the CLI) and
carried as one frozen value: the all-reduce algorithm, the mode of the output projections (reduce
partial sums, or gather whole rows) and the payload dtype of the sync points (which says the codec
the collectives use and how wide the partial sums are)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DllamaError

SYNC_MODES = ("reduce", "gather")
CODEC_OF_DTYPE = {"f32": None, "f64": None, "f16": "f16", "q80": "q80"}  # f64: partial sums in float64
SYNC_DTYPES = tuple(CODEC_OF_DTYPE)
GATHER_DTYPES = ("f32", "q80")  # gather mode sums nothing across nodes: these two are exact


@dataclass(frozen=True)
class SyncConfig:
    algo: str = "auto"
    mode: str = "reduce"
    dtype: str = "f32"

    def __post_init__(self):
        from .sync import algo_name  # here: `dllama models` reads this module's names without the collectives

        try:
            object.__setattr__(self, "algo", algo_name(self.algo))
        except ValueError as e:
            raise DllamaError(str(e)) from None
        if self.mode not in SYNC_MODES:
            raise DllamaError(f"unknown sync mode {self.mode!r} ({', '.join(SYNC_MODES)})")
        if self.dtype not in CODEC_OF_DTYPE:
            raise DllamaError(f"unknown sync dtype {self.dtype!r} ({', '.join(SYNC_DTYPES)})")
        if self.mode == "gather" and self.dtype not in GATHER_DTYPES:
            raise DllamaError(f"--sync-mode gather carries f32 or q80 (both exact), not {self.dtype}")

    @property
    def codec(self) -> str | None:
        """The collectives' wire codec (None: the values as they are)."""
        return CODEC_OF_DTYPE[self.dtype]

    def projection(self, shards, head_dim: int):
        """How the nodes make the output projections whole: a `Reduce` or a `Gather` (dllama.projection)."""
        from .projection import Gather, Reduce  # here, for the same reason

        if self.mode == "gather":
            return Gather.of(shards, head_dim, q8=self.dtype == "q80")
        return Reduce(wide=self.dtype == "f64")


