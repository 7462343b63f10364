"""What a node (alone, or a cluster's root or worker) tells about itself: the memory it can take (its
cgroups' limits included), its RSS, its speed."""

from __future__ import annotations

import os
import time

import numpy as np


CGROUP_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a huge number (a page-rounded 2^63 - 1)


def mem_available() -> int | None:
    """Bytes this process can still allocate (Linux), None where unknown: the tightest of what the
    kernel thinks is available (MemAvailable) and what the memory cgroups it runs in still allow (a
    container's limit, a systemd MemoryMax: MemAvailable knows nothing of them)."""
    found = [x for x in (_meminfo_available(), cgroup_headroom()) if x is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_headroom(proc_cgroup: str | None = None, root: str = CGROUP_ROOT) -> int | None:
    """Bytes the memory cgroups of this process still allow: the least limit - usage over its
    cgroup and each ancestor that has a limit, in cgroup v2 (memory.max, memory.current) or v1
    (memory.limit_in_bytes, memory.usage_in_bytes); None where no limit is set or none can be read.
    proc_cgroup: /proc/self/cgroup's text (read when None). In a container the path it names may not
    exist under the mount (no cgroup namespace): the mount's own top is the container's cgroup then."""
    if proc_cgroup is None:
        try:
            with open("/proc/self/cgroup") as f:
                proc_cgroup = f.read()
        except OSError:
            return None
    headroom = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _id, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy, at the root or (hybrid) at unified/
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in _cgroup_folders(base, path):
            room = _room(folder, *files)
            if room is not None:
                headroom = room if headroom is None else min(headroom, room)
    return headroom


def _cgroup_folders(base: str, path: str) -> list[str]:
    """The folders of a cgroup and of its ancestors up to the mount's top (which is the container's
    own cgroup where the path is the host's)."""
    parts = [p for p in path.split("/") if p]
    folders = [os.path.join(base, *parts[:n]) for n in range(len(parts), 0, -1)]
    return [f for f in folders if os.path.isdir(f)] + [base]


def _room(folder: str, limit_file: str, usage_file: str) -> int | None:
    """limit - usage of one cgroup, the page cache it could drop (inactive files) not counted as
    used, as `docker stats` counts it; None without a limit."""
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= NO_LIMIT:
        return None
    return max(int(limit) - usage + _inactive_file(folder), 0)


def _inactive_file(folder: str) -> int:
    """memory.stat's inactive page cache (v2: inactive_file; v1, with the cgroup's children:
    total_inactive_file); 0 where it cannot be read."""
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            stats = dict(line.split() for line in f if line.count(" ") == 1)
        return int(stats.get("inactive_file", stats.get("total_inactive_file", 0)))
    except (OSError, ValueError):
        return 0


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
    from .kernels.activations import Activations
    from .kernels.matmul import matmul
    from .quant import QType, quantize

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
