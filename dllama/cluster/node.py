"""What a node of a cluster tells about itself: the memory it can take, its RSS, its speed."""

from __future__ import annotations

import os
import time

import numpy as np


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


def rss_mb(pid: int | None = None) -> float:
    """Resident memory in MB of this process (or `pid`); 0.0 where unknown."""
    try:
        with open(f"/proc/{os.getpid() if pid is None else pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def measure_speed(seconds: float = 0.3) -> float:
    """This node's matmul throughput in GMAC/s on a Q4_0 layer-sized matrix: the figure the
    root uses to split the model in proportion when asked (--weights auto)."""
    from ..kernels.activations import Activations
    from ..kernels.matmul import matmul
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
