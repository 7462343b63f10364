"""Cluster figures: tokens/s and ms/token (compute vs sync) for 1..N nodes and each sync
algorithm, bytes per token per node next to each algorithm's formula, and each worker's RSS.

    .venv/bin/python benchmarks/bench_cluster.py                    # default model, 1-4 nodes
    .venv/bin/python benchmarks/bench_cluster.py --model models/synthetic-1b-q4_0.gguf --steps 16

Every configuration runs the real CLI (`dllama inference --local-workers N --json`), so all nodes
share this machine's cores: the figures show the overheads of the protocol and the sync layer,
not the speed-up that separate machines give.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DLLAMA = [sys.executable, "-m", "dllama"]


def formula_bytes(algo: str, p: int, n_bytes: float) -> float:
    """Bytes one node sends per all-reduce of n_bytes (the busiest node for star: the root)."""
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


def run(model: str, workers: int, algo: str, dtype: str, steps: int, threads: int) -> dict:
    cmd = DLLAMA + ["inference", "--model", model, "--prompt", "The history of the lighthouse", "--steps",
                    str(steps), "--temperature", "0", "--sync", algo, "--sync-dtype", dtype, "--threads",
                    str(threads), "--json"]
    if workers:
        cmd += ["--local-workers", str(workers)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return json.loads(result.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--nodes", default="1,2,3,4", help="node counts (root included)")
    ap.add_argument("--algos", default="star,ring")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="threads per node (all nodes share this machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dllama.gguf_model import GGUFModel
    from dllama.registry import resolve_model

    model = resolve_model(args.model)
    cfg = GGUFModel(model).config
    value_bytes = {"f32": 4, "f64": 8, "f16": 2, "q80": 36 / 32}[args.dtype]
    per_token_allreduces = 2 * cfg.n_layers
    rows = []
    for p in [int(x) for x in args.nodes.split(",")]:
        for algo in args.algos.split(",") if p > 1 else ["none"]:
            r = run(model, p - 1, algo if p > 1 else "star", args.dtype, args.steps, args.threads)
            expect = per_token_allreduces * formula_bytes(algo, p, cfg.dim * value_bytes) if p > 1 else 0.0
            rows.append({"nodes": p, "algo": algo, "tok_s": r["tokens_per_s"], **{f"ms_{k}": v for k, v in
                         r["ms_per_token"].items()}, "sent_per_token": r["bytes_per_token"]["sent"],
                         "formula_per_token": expect, "root_peak_rss_mb": r["peak_rss_mb"],
                         "workers": r.get("workers", [])})
    if args.json:
        print(json.dumps({"model": os.path.basename(model), "dtype": args.dtype, "rows": rows}))
        return
    print(f"model {os.path.basename(model)}: dim {cfg.dim}, {cfg.n_layers} layers; sync payload {args.dtype}; "
          f"{args.threads} thread(s) per node, all nodes on this machine")
    print(f"{'nodes':>5} {'algo':>5} {'tok/s':>7} {'ms/tok':>7} {'compute':>8} {'sync':>7} "
          f"{'root sent B/tok':>15} {'formula':>9} {'root RSS':>9}  worker RSS MB")
    for row in rows:
        worker_rss = ", ".join(f"{w['rss_mb']:.0f}" for w in row["workers"] if w.get("rss_mb"))
        print(f"{row['nodes']:>5} {row['algo']:>5} {row['tok_s']:>7.1f} {row['ms_total']:>7.1f} "
              f"{row['ms_compute']:>8.1f} {row['ms_sync']:>7.1f} {row['sent_per_token']:>15.0f} "
              f"{row['formula_per_token']:>9.0f} {row['root_peak_rss_mb']:>9.0f}  {worker_rss}")


if __name__ == "__main__":
    main()
