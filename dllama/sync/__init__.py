"""Collectives over dllama.net connections: all_reduce, reduce_scatter, all_gather, broadcast,
reduce, gather, scatter, barrier (torch.distributed / mpi4py style, async, numpy arrays), with
five algorithms (star, ring, mesh, rd, rabenseifner) and auto selection.

    group = await init_process_group(rank, world, addrs, algo="auto")
    await group.all_reduce(x, op="sum", codec="q80")

    async with local_cluster(4, algo="ring") as groups: ...     # p ranks in this process
    with ProcessCluster(4, "pkg.mod:fn", algo="ring") as cl: ...  # p ranks in p processes
"""

from .calls import SyncStats
from .codecs import CODECS, get_codec
from .group import (
    ALGO_NAMES,
    ALGORITHMS,
    DEFAULT_TIMEOUT,
    ProcessGroup,
    algo_name,
)
from .rendezvous import init_process_group
from .local import local_cluster
from .ops import OPS, loc_array, loc_dtype
from .procs import ProcessCluster, run_processes

__all__ = [
    "ALGORITHMS", "ALGO_NAMES", "CODECS", "DEFAULT_TIMEOUT", "OPS", "ProcessCluster", "ProcessGroup", "SyncStats",
    "algo_name", "get_codec", "init_process_group", "loc_array", "loc_dtype", "local_cluster", "run_processes",
]
