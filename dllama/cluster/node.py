"""What every node of a cluster runs per step, root and workers alike: its shard's forward pass
with the two all-reduces per layer going through the sync group, then its logit summaries."""

from __future__ import annotations

import os
import time

import numpy as np

from ..model import ShardModel
from ..sampling import LogitSummary, SamplingParams, summarize
from ..sync import ProcessGroup
from .protocol import CODEC_OF_SYNC_DTYPE


class NodeStep:
    def __init__(self, model: ShardModel, group: ProcessGroup | None, sync_dtype: str):
        self.model = model
        self.group = group
        self.codec = CODEC_OF_SYNC_DTYPE[sync_dtype]

    async def _all_reduce(self, partial: np.ndarray) -> np.ndarray:
        if self.group is None:  # the root alone, after every worker is gone
            return partial
        return await self.group.all_reduce(partial, op="sum", codec=self.codec)

    async def run(self, x: np.ndarray, start: int, logits: str, params: SamplingParams, recent: list[int],
                  targets: list[int] | None, one_token: bool | None = None) -> list[LogitSummary]:
        """Forward the tokens whose embeddings are x (T, dim) at positions start..; summarize the
        logits of no position, the last one, or all of them (logits = "none" | "last" | "all")."""
        h = await self.model.forward(x, start, self._all_reduce, one_token)
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
