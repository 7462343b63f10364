"""Cluster figures: tokens/s and ms/token (compute vs sync) for 1..N nodes, each sync mode and
algorithm, bytes per token per node next to the formula, and each worker's RSS.

    .venv/bin/python benchmarks/bench_cluster.py                    # default model, 1-4 nodes
    .venv/bin/python benchmarks/bench_cluster.py --modes reduce,gather --dtype q80
    .venv/bin/python benchmarks/bench_cluster.py --model models/synthetic-1b-q4_0.gguf --steps 16
    .venv/bin/python benchmarks/bench_cluster.py --nodes 1,2 --modes auto,reduce,gather --pin

Every configuration runs the real CLI (`dllama inference --local-workers N --json`), so all nodes
share this machine's cores: the figures show the overheads of the protocol and the sync layer,
not the speed-up that separate machines give. With --pin each node is its own process pinned to
one core (taskset: the root on core 0, worker i on core i), so 2 nodes on 2 cores compute as two
machines would, and a last line gives their ceiling here: one process with all the nodes' threads on
those cores (cores that share one memory bus give it well under N times one core's speed). Mode `auto`
lets the root choose (the row says what it chose).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

DLLAMA = [sys.executable, "-m", "dllama"]


def all_reduce_bytes(algo: str, p: int, n_bytes: float) -> float:
    """Bytes the root sends per all-reduce of n_bytes (for star the root is the busiest node)."""
    if p == 1:
        return 0.0
    if algo == "star":
        return (p - 1) * n_bytes
    if algo == "ring":
        return 2 * (p - 1) / p * n_bytes
    if algo == "mesh":
        return (p - 1) * n_bytes
    if algo == "rd":
        k = p.bit_length() - 1
        fold = 0 if p == 1 << k else 1  # non-power-of-two: extra ranks fold in and out
        return (k + 2 * fold) * n_bytes
    return float("nan")


def all_gather_bytes(algo: str, p: int, n_bytes: float) -> float:
    """Bytes the root sends per all-gather of n_bytes in all (equal blocks of n_bytes / p)."""
    if p == 1:
        return 0.0
    if algo == "star":  # gather to the root, which broadcasts the whole
        return (p - 1) * n_bytes
    if algo in ("ring", "mesh"):  # ring: forwards p-1 blocks; mesh: its block to p-1 peers
        return (p - 1) / p * n_bytes
    return float("nan")  # rd: depends on where the root sits in the fold


def formula_per_token(mode: str, algo: str, p: int, cfg, dtype: str) -> float:
    """Per token: reduce mode, 2 all-reduces of dim values per layer; gather mode, 4 all-gathers
    per layer: the attention output and the FFN hidden layer (as Q8 blocks with q80: 36 bytes per
    32 values) and twice the dim-long projection output (f32)."""
    if mode == "reduce":
        value = {"f32": 4, "f64": 8, "f16": 2, "q80": 36 / 32}[dtype]
        return 2 * cfg.n_layers * all_reduce_bytes(algo, p, cfg.dim * value)
    value = 36 / 32 if dtype == "q80" else 4
    per_layer = (all_gather_bytes(algo, p, (cfg.n_heads * cfg.head_dim + cfg.ffn_dim) * value)
                 + 2 * all_gather_bytes(algo, p, cfg.dim * 4))
    return cfg.n_layers * per_layer


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core % (os.cpu_count() or 1)), *cmd]


def start_workers(n: int, threads: int) -> list[tuple[subprocess.Popen, str]]:
    """n `dllama worker` processes on loopback, worker i pinned to core i; (process, address)."""
    started = []
    for i in range(1, n + 1):
        proc = subprocess.Popen(pinned(i, DLLAMA + ["worker", "--host", "127.0.0.1", "--port", "0", "--threads",
                                                    str(threads), "--no-cache"]),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise SystemExit(f"a worker did not start: {line!r}")
        started.append((proc, line.split()[-1]))
    return started


def run(model: str, workers: int, mode: str, algo: str, dtype: str | None, steps: int, threads: int,
        pin: bool = False, cores: str | None = None) -> dict:
    cmd = DLLAMA + ["inference", "--model", model, "--prompt", "The history of the lighthouse", "--steps",
                    str(steps), "--temperature", "0", "--sync-mode", mode, "--sync", algo,
                    "--threads", str(threads), "--json"] + (["--sync-dtype", dtype] if dtype else [])
    started = start_workers(workers, threads) if pin and workers else []
    try:
        if started:
            cmd = pinned(0, cmd + ["--workers", ",".join(address for _, address in started)])
        elif cores:  # one node on these cores (taskset -c syntax)
            cmd = ["taskset", "-c", cores, *cmd]
        elif workers:
            cmd += ["--local-workers", str(workers)]
        result = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait()
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return json.loads(result.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--nodes", default="1,2,3,4", help="node counts (root included)")
    ap.add_argument("--algos", default="auto,star,ring", help="all-reduce algorithms; auto (the CLI's default) lets "
                    "the cost model pick per call")
    ap.add_argument("--modes", default="reduce", help="sync modes: reduce, gather, auto")
    ap.add_argument("--dtype", default=None, help="sync dtype (default: the mode's: f32 reduce, q80 gather)")
    ap.add_argument("--pin", action="store_true", help="one process per node, each pinned to its own core")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="threads per node (all nodes share this machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dllama.gguf_model import GGUFModel
    from dllama.registry import resolve_model

    model = resolve_model(args.model)
    cfg = GGUFModel(model).config
    rows = []
    for p in [int(x) for x in args.nodes.split(",")]:
        for mode in args.modes.split(",") if p > 1 else ["-"]:
            for algo in args.algos.split(",") if p > 1 else ["none"]:
                dtype = args.dtype if mode != "gather" or args.dtype in (None, "f32", "q80") else "f32"
                r = run(model, p - 1, "reduce" if p == 1 else mode, algo if p > 1 else "star", dtype, args.steps,
                        args.threads, args.pin)
                ran, dtype = r["sync_mode"], r["sync_dtype"]  # auto: what the root chose
                expect = formula_per_token(ran, algo, p, cfg, dtype) if p > 1 else 0.0
                expect = None if math.isnan(expect) else expect
                label = "-" if p == 1 else f"{ran}*" if mode == "auto" else mode
                rows.append({"nodes": p, "mode": label, "algo": algo, "dtype": dtype, "tok_s": r["tokens_per_s"],
                             **{f"ms_{k}": v for k, v in
                                r["ms_per_token"].items()}, "sent_per_token": r["bytes_per_token"]["sent"],
                             "formula_per_token": expect, "root_peak_rss_mb": r["peak_rss_mb"],
                             "workers": r.get("workers", [])})
    # With --pin, the ceiling of a split on this machine: one process with every pinned node's threads on
    # their cores (where the cores share a memory bus, well under N x one core)
    most = max(row["nodes"] for row in rows)
    ceiling = None
    if args.pin and most > 1 and most <= (os.cpu_count() or 1):
        r = run(model, 0, "reduce", "star", None, args.steps, args.threads * most, cores=f"0-{most - 1}")
        ceiling = {"nodes": 1, "threads": args.threads * most, "cores": most, "tok_s": r["tokens_per_s"]}
    if args.json:
        print(json.dumps({"model": os.path.basename(model), "rows": rows, "one_node_all_cores": ceiling}))
        return
    print(f"model {os.path.basename(model)}: dim {cfg.dim}, {cfg.n_layers} layers; "
          f"{args.threads} thread(s) per node, all nodes on this machine"
          + ("; each node pinned to its own core" if args.pin else "") + "; mode*: chosen by --sync-mode auto")
    print(f"{'nodes':>5} {'mode':>7} {'algo':>5} {'dtype':>5} {'tok/s':>7} {'ms/tok':>7} {'compute':>8} {'sync':>7} "
          f"{'root sent B/tok':>15} {'formula':>9} {'root RSS':>9}  worker RSS MB")
    for row in rows:
        worker_rss = ", ".join(f"{w['rss_mb']:.0f}" for w in row["workers"] if w.get("rss_mb"))
        # auto and rd: no one formula
        formula = "-" if row["formula_per_token"] is None else f"{row['formula_per_token']:.0f}"
        print(f"{row['nodes']:>5} {row['mode']:>7} {row['algo']:>5} {row['dtype']:>5} {row['tok_s']:>7.1f} "
              f"{row['ms_total']:>7.1f} "
              f"{row['ms_compute']:>8.1f} {row['ms_sync']:>7.1f} {row['sent_per_token']:>15.0f} "
              f"{formula:>9} {row['root_peak_rss_mb']:>9.0f}  {worker_rss}")
    one = next((row["tok_s"] for row in rows if row["nodes"] == 1), None)
    if ceiling is not None:
        versus = f" ({ceiling['tok_s'] / one:.2f}x the 1-node row)" if one else ""
        print(f"ceiling: 1 node with {ceiling['threads']} threads on cores 0-{most - 1}: {ceiling['tok_s']:.1f} tok/s"
              f"{versus}: what these cores give together, the most a {most}-node split can expect here")


if __name__ == "__main__":
    main()
