"""dllama's all-reduce next to Open MPI's MPI_Allreduce, same sizes, same run, same machine.

Both sides: one process per rank on loopback TCP (Open MPI restricted to `--mca btl tcp,self`,
so no shared memory), float32 sum in place, each timed call on a fresh copy of the input, the
slowest rank's median. The machine may be shared, so the two are interleaved over --rounds and
each figure is the median over rounds; ratios compare figures of the same run.

    python benchmarks/bench_sync_vs_mpi.py --nodes 2,4 --sizes 2K,8K,16K,1M,16M --algos ring,auto

Needs mpirun (Debian: openmpi-bin) and mpi4py (pip, the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dllama.sync.bench import format_size, parse_size  # noqa: E402
from dllama.sync.procs import ProcessCluster  # noqa: E402


def run_dllama(p, algos, sizes, iters, warmup, spin):
    config = {"algos": algos, "sizes": sizes, "dtypes": ["f32"], "iters": iters, "warmup": warmup}
    kwargs = {} if spin is None else {"group_kwargs": {"spin": spin}}
    with ProcessCluster(p, "dllama.sync.bench:bench_rank", args=(config,), algo="auto", **kwargs) as cluster:
        res = cluster.results()[0]
    bad = [r for r in res["rows"] if r["check"] != "ok"]
    if bad:
        raise SystemExit(f"dllama all-reduce failed its correctness check: {bad[0]}")
    return {(r["algo"], r["size"]): (r["time_us"] * 1e-6, r.get("chose", r["algo"])) for r in res["rows"]}, res["auto"]


def run_mpi(p, sizes, iters, warmup):
    cmd = ["mpirun", "--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "pml", "ob1",
           "--mca", "btl_tcp_if_include", "lo", "-np", str(p)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, "mpi_allreduce.py"), "--sizes", ",".join(map(str, sizes)),
            "--iters", str(iters), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"mpirun failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    data = json.loads(line)
    return {int(k): v for k, v in data["median_s"].items()}, data["library"]


def busbw(size, p, t):
    return size / t * 2 * (p - 1) / p / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--sizes", default="2K,8K,16K,1M,16M")
    ap.add_argument("--algos", default="ring,mesh,auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved dllama/MPI repetitions (median taken)")
    ap.add_argument("--spin-us", type=float, default=None, help="dllama busy-poll time (default: the group's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("mpirun") is None:
        raise SystemExit("mpirun not found: install Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise SystemExit("mpi4py not installed: pip install mpi4py (dllama's `bench` extra)") from None
    ps = [int(x) for x in args.nodes.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    algos = [a.strip() for a in args.algos.split(",")]
    spin = None if args.spin_us is None else args.spin_us * 1e-6

    samples = {}  # (p, who, size) -> [seconds per round]
    chose, autos, library = {}, {}, None
    for rnd in range(args.rounds):
        for p in ps:
            mine, auto = run_dllama(p, algos, sizes, args.iters, args.warmup, spin)
            autos.setdefault(p, auto)
            for (algo, size), (t, c) in mine.items():
                samples.setdefault((p, algo, size), []).append(t)
                chose[(p, algo, size)] = c
            theirs, library = run_mpi(p, sizes, args.iters, args.warmup)
            for size, t in theirs.items():
                samples.setdefault((p, "mpi", size), []).append(t)
            print(f"round {rnd + 1}/{args.rounds}, p={p} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in samples.items()}

    rows = []
    for p in ps:
        for size in sizes:
            t_mpi = med[(p, "mpi", size)]
            row = {"p": p, "size": size, "mpi_us": t_mpi * 1e6, "mpi_busbw_GBps": busbw(size, p, t_mpi)}
            for algo in algos:
                t = med[(p, algo, size)]
                row[algo] = {"us": t * 1e6, "busbw_GBps": busbw(size, p, t), "time_vs_mpi": t / t_mpi,
                             "busbw_vs_mpi": t_mpi / t, "chose": chose[(p, algo, size)]}
            rows.append(row)
    if args.json:
        print(json.dumps({"mpi": library, "rounds": args.rounds, "iters": args.iters, "auto": autos, "rows": rows},
                         indent=1))
        return
    print(f"# dllama vs {library}  (loopback TCP, float32 sum, median of {args.rounds} interleaved rounds "
          f"x {args.iters} calls)")
    head = f"{'p':>2} {'size':>5} | {'MPI us':>9} {'busbw':>7} |"
    for algo in algos:
        head += f" {algo + ' us':>12} {'busbw':>7} {'t/MPI':>6} |"
    print(head)
    print("-" * len(head))
    for row in rows:
        line = f"{row['p']:>2} {format_size(row['size']):>5} | {row['mpi_us']:>9.1f} {row['mpi_busbw_GBps']:>7.3f} |"
        for algo in algos:
            c = row[algo]
            name = f"{c['us']:.1f}" + (f"({c['chose'][:4]})" if algo == "auto" else "")
            line += f" {name:>12} {c['busbw_GBps']:>7.3f} {c['time_vs_mpi']:>6.2f} |"
        print(line)
    print("\nt/MPI: dllama time / MPI time (lower is better; busbw ratio = 1 / t/MPI).")
    for p in ps:
        big, small = max(sizes), 16 << 10
        if "ring" in algos and (p, "ring", big) in med:
            r = med[(p, "mpi", big)] / med[(p, "ring", big)]
            print(f"p={p}: ring busbw at {format_size(big)} = {r:.2f}x Open MPI (target >= 1.0)")
        if small in sizes:
            best = min(algos, key=lambda a: med[(p, a, small)])
            r = med[(p, best, small)] / med[(p, "mpi", small)]
            print(f"p={p}: 16K latency ({best}) = {r:.2f}x Open MPI (target <= 2)")


if __name__ == "__main__":
    main()
