"""Open MPI's MPI_Allreduce timed the way `dllama bench-sync` times its all-reduce (run under
mpirun by bench_sync_vs_mpi.py): per size, `warmup` untimed calls, then `iters` calls each on a
fresh copy of the input (the copy is not timed), in place, float32 sum. Rank 0 prints one JSON
line: per size the slowest rank's median seconds."""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True, help="bytes, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    out = {}
    for size in (int(s) for s in args.sizes.split(",")):
        n = max(size // 4, 1)
        src = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        x = src.copy()
        times = []
        comm.Barrier()
        for i in range(args.warmup + args.iters):
            np.copyto(x, src)
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        worst = comm.allreduce(float(np.median(times)), op=MPI.MAX)
        out[str(n * 4)] = worst
    if comm.rank == 0:
        print(json.dumps({"p": comm.size, "library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(), "median_s": out}))


if __name__ == "__main__":
    main()
