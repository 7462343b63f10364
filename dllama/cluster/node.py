"""What every node of a cluster runs per step, root and workers alike: its shard's forward pass
with the two sync points per layer going through the sync group, then its logit summaries."""

from __future__ import annotations

import os
import time

import numpy as np

from ..errors import DllamaError
from ..model import ShardModel
from ..projection import SYNC_MODES, Gather, Reduce
from ..sampling import LogitSummary, SamplingParams, summarize
from ..sync import ProcessGroup
from .protocol import CODEC_OF_SYNC_DTYPE


def check_sync(mode: str, sync_dtype: str) -> None:
    if mode not in SYNC_MODES:
        raise DllamaError(f"unknown sync mode {mode!r} ({', '.join(SYNC_MODES)})")
    if sync_dtype not in CODEC_OF_SYNC_DTYPE:
        raise DllamaError(f"unknown sync dtype {sync_dtype!r} ({', '.join(CODEC_OF_SYNC_DTYPE)})")
    if mode == "gather" and sync_dtype not in ("f32", "q80"):
        raise DllamaError(f"--sync-mode gather carries f32 or q80 (both exact), not {sync_dtype}")


def projection_of(mode: str, sync_dtype: str, shards, head_dim: int) -> Reduce | Gather:
    """How this cluster's nodes make the output projections whole (see dllama.projection)."""
    check_sync(mode, sync_dtype)
    if mode == "gather":
        return Gather.of(shards, head_dim, q8=sync_dtype == "q80")
    return Reduce(wide=sync_dtype == "f64")


class NodeStep:
    """Also the model's `Collectives`: its sync points go through this node's process group."""

    def __init__(self, model: ShardModel, group: ProcessGroup | None, sync_dtype: str):
        self.model = model
        self.group = group
        self.codec = CODEC_OF_SYNC_DTYPE[sync_dtype]

    async def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        if self.group is None:  # the root alone, after every worker is gone
            return partial
        return await self.group.all_reduce(partial, op="sum", codec=self.codec)

    async def all_gather(self, part: np.ndarray, counts: list[int]) -> np.ndarray:
        if self.group is None:
            return part.reshape(-1)
        return await self.group.all_gather(part, counts=counts)

    async def run(self, x: np.ndarray, start: int, logits: str, params: SamplingParams, recent: list[int],
                  targets: list[int] | None) -> list[LogitSummary]:
        """Forward the tokens whose embeddings are x (T, dim) at positions start..; summarize the
        logits of no position, the last one, or all of them (logits = "none" | "last" | "all")."""
        h = await self.model.forward(x, start, self)
        if logits == "none":
            return []
        rows = h if logits == "all" else h[-1:]
        vocab_start = self.model.shard.vocab[0]
        return [summarize(row, vocab_start, params, recent, None if targets is None else targets[i])
                for i, row in enumerate(self.model.logits(rows))]


def mem_available() -> int | None:
    """Bytes the kernel thinks can still be allocated (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def measure_speed(seconds: float = 0.3) -> float:
    """This node's matmul throughput in GMAC/s on a Q4_0 layer-sized matrix: the figure the
    root uses to split the model in proportion when asked (--weights auto)."""
    from ..kernels.matmul import Activations, matmul
    from ..quant import QType, quantize

    rng = np.random.default_rng(0)
    w = quantize(rng.standard_normal((1024, 1024), dtype=np.float32), QType.Q4_0)
    x = Activations(rng.standard_normal((1, 1024), dtype=np.float32))
    out = np.empty((1, 1024), np.float32)
    matmul(w, QType.Q4_0, x, out)  # compile / warm up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        matmul(w, QType.Q4_0, x, out)
        n += 1
    return n * 1024 * 1024 / (time.perf_counter() - t0) / 1e9
