"""`dllama bench-sync`: all-reduce benchmark of the sync layer, in the style of nccl-tests."""

from __future__ import annotations

import json
import sys

import click

from ..errors import DllamaError


def _csv(ctx, param, value):
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command("bench-sync")
@click.option("--nodes", "-n", default="2,4", show_default=True, callback=_csv,
              help="Rank counts to run, comma-separated.")
@click.option("--algo", default="star,ring,mesh,rd,rabenseifner,auto", show_default=True, callback=_csv,
              help="Algorithms: star, ring, mesh, rd, rabenseifner, auto.")
@click.option("--sizes", default="2K,16K,1M,16M", show_default=True, callback=_csv,
              help="Message sizes in bytes of the array (K/M suffixes).")
@click.option("--dtype", "dtypes", default="f32,q80", show_default=True, callback=_csv,
              help="f32/f64/i32/i64: exact arrays of that type; f16/q80: float32 arrays sent with that codec.")
@click.option("--iters", default=20, show_default=True, help="Timed calls per row (the median is reported).")
@click.option("--warmup", default=3, show_default=True, help="Untimed calls before timing.")
@click.option("--op", default="sum", show_default=True, help="Reduction op (sum, avg, max, ...).")
@click.option("--processes/--in-process", default=True, show_default=True,
              help="One OS process per rank over loopback TCP, or all ranks in this process "
                   "(a smoke test: ranks then share one thread, so times are not comparable).")
@click.option("--netns", is_flag=True, help="Run each rank in its own Linux network namespace, joined "
                                            "through a bridge (needs root); see --rate.")
@click.option("--rate", default=None, help="With --netns: shape every link with tc tbf, e.g. 100mbit.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds a silent peer is given.")
@click.option("--spin-us", default=None, type=float, help="Busy-poll this many microseconds for a frame "
                                                          "before sleeping (default: the group's).")
@click.option("--chunk", default=None, help="Pipelining chunk size on the wire (e.g. 256K).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench_sync(nodes, algo, sizes, dtypes, iters, warmup, op, processes, netns, rate, timeout, spin_us, chunk,
               as_json):
    """Time all-reduce for every algorithm x nodes x size x dtype: median time, algbw, busbw
    (algbw * 2(p-1)/p), max error against the exact float64 sum, and a correctness check
    (exact inputs, zero tolerance or the codec's bound; all ranks bit-identical)."""
    from ..sync import algo_name
    from ..sync.bench import DTYPES, format_table, parse_size

    try:
        ps = [int(x) for x in nodes]
        algos = [algo_name(a) for a in algo]
        size_list = [parse_size(s) for s in sizes]
        chunk_bytes = parse_size(chunk) if chunk else None
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if any(p < 1 for p in ps):
        raise click.BadParameter("--nodes must be positive")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise click.BadParameter(f"unknown dtype {bad[0]!r}; choose from {', '.join(DTYPES)}")
    if rate and not netns:
        raise click.BadParameter("--rate shapes namespace links; it needs --netns")
    config = {"algos": algos, "sizes": size_list, "dtypes": dtypes, "iters": iters, "warmup": warmup, "op": op}
    group_kwargs = {}
    if spin_us is not None:
        group_kwargs["spin"] = spin_us * 1e-6
    if chunk_bytes:
        group_kwargs["chunk_bytes"] = chunk_bytes
    # auto measures the network at setup, so the groups are built with it; other rows override algo
    results = []
    for p in ps:
        if netns:
            results.append(_run_netns(p, config, rate, timeout, group_kwargs))
        elif processes:
            results.append(_run_processes(p, config, timeout, group_kwargs))
        else:
            results.append(_run_in_process(p, config, timeout, group_kwargs))
    if as_json:
        click.echo(json.dumps({"config": {**config, "nodes": ps, "netns": netns, "rate": rate,
                                          "mode": "netns" if netns else "processes" if processes else "in-process"},
                               "results": results}, indent=1))
        return
    for res in results:
        auto = res.get("auto")
        extra = ""
        if auto:
            extra = (f"  auto measured: alpha {auto['alpha_s'] * 1e6:.1f} us, "
                     f"beta {auto['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s, "
                     f"reduce {1 / auto['gamma_s_per_byte'] / 1e9:.2f} GB/s")
        click.echo(f"# p = {res['p']}{extra}")
        click.echo(format_table(res["rows"]))
        click.echo("")
    failed = [r for res in results for r in res["rows"] if r["check"] != "ok"]
    if failed:
        click.echo(f"{len(failed)} row(s) FAILED the correctness check", err=True)
        sys.exit(1)


def _run_processes(p, config, timeout, group_kwargs):
    from ..sync.procs import ChildError, ProcessCluster
    try:
        with ProcessCluster(p, "dllama.sync.bench:bench_rank", args=(config,), algo="auto", timeout=timeout,
                            group_kwargs=group_kwargs) as cluster:
            return cluster.results()[0]
    except ChildError as e:
        raise DllamaError(f"bench-sync with {p} ranks failed: {e}") from None


def _run_in_process(p, config, timeout, group_kwargs):
    import asyncio

    from ..net import run
    from ..sync import local_cluster
    from ..sync.bench import bench_rank

    async def main():
        async with local_cluster(p, algo="auto", timeout=timeout, **group_kwargs) as groups:
            out = await asyncio.gather(*(bench_rank(g, config) for g in groups))
            return out[0]

    return run(main())


def _run_netns(p, config, rate, timeout, group_kwargs):
    from ..sync.netns import NetnsTestbed
    from ..sync.procs import ChildError

    try:
        with NetnsTestbed(p, rate=rate) as bed:
            with bed.cluster("dllama.sync.bench:bench_rank", args=(config,), algo="auto", timeout=timeout,
                             group_kwargs=group_kwargs) as cluster:
                res = cluster.results()[0]
                res["netns"] = {"rate": rate, "addresses": bed.addresses}
                return res
    except ChildError as e:
        raise DllamaError(f"bench-sync in namespaces failed: {e}") from None
