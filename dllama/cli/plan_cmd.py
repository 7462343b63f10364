"""`dllama plan`: measure the workers and the links, and print what each way of running a model on
them is predicted to cost per token (compute + sync), and the way the planner would choose."""

from __future__ import annotations

import json

import click

from ..registry import DEFAULT_MODEL
from ..sync_config import MODE_CHOICES
from .common import run_async


@click.command()
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help="A registry name or a GGUF path.")
@click.option("--workers", required=True, metavar="HOST:PORT,..", help="The workers to plan over.")
@click.option("--ctx-size", type=click.IntRange(16), default=4096, show_default=True,
              help="The context each node's KV cache must hold.")
@click.option("--sync-mode", type=click.Choice(MODE_CHOICES), default="auto", show_default=True)
@click.option("--secret", envvar="DLLAMA_SECRET", default=None,
              help="Shared secret for node authentication (env DLLAMA_SECRET).")
@click.option("--timeout", type=click.FloatRange(0.1), default=30.0, show_default=True,
              help="Seconds a silent node is given before it is declared dead.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the figures, candidates and choice.")
def plan(model, workers, ctx_size, sync_mode, secret, timeout, as_json):
    """Measure every node's speed and memory and the links (no slice is sent), then print each
    candidate (which nodes, their shares, the sync mode) with its predicted milliseconds per token,
    and the one chosen: the fastest that fits, leaving out nodes that slow the cluster down."""
    from ..cluster.survey import survey
    from ..cluster.sync_mode import gathers_q8
    from ..gguf_model import GGUFModel
    from ..model import shard_peak_bytes
    from ..plan import Plan
    from ..planner import candidates, choose
    from ..registry import resolve_model
    from ..sync_config import SyncConfig

    gguf = GGUFModel(resolve_model(model))
    config = gguf.config
    figures, link = run_async(survey([a for a in workers.split(",") if a], secret or None, timeout))

    def slice_bytes(plan, mode):
        return [shard_peak_bytes(gguf, shard, mode) for shard in plan.shards]

    q8_attention, q8_ffn = gathers_q8(gguf, Plan.split(config, [1.0, 1.0]).shards)
    found = candidates(config, figures, link, SyncConfig(mode=sync_mode), slice_bytes, ctx_size, q8_attention, q8_ffn)
    chosen = choose(found)
    if as_json:
        click.echo(json.dumps({
            "nodes": [{"name": f.name, "gmacs": f.gmacs, "mem_available": f.mem_available} for f in figures],
            "link": {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "gamma_s_per_byte": link.gamma},
            "candidates": [{"nodes": [figures[i].name for i in c.members], "weights": list(c.weights),
                            "sync_mode": c.sync.mode, "sync_dtype": c.sync.dtype,
                            "predicted_ms_per_token": {"compute": c.compute_s * 1e3, "sync": c.sync_s * 1e3,
                                                       "total": c.total_s * 1e3},
                            "short": c.short, "chosen": c is chosen} for c in found]}))
        return
    click.echo(f"{gguf.path}: {config.n_layers} layers; link {link.describe()}")
    for f in figures:
        rate = "?" if f.gmacs is None else f"{f.gmacs:.2f}"
        memory = "?" if f.mem_available is None else f"{f.mem_available / 1e6:.0f}"
        click.echo(f"  {f.name}: {rate} GMAC/s, {memory} MB free")
    click.echo(f"{'':2}{'nodes':<7}{'shares':<26}{'sync':<16}{'compute ms':>11}{'sync ms':>9}{'total ms':>9}{'tok/s':>7}")
    for c in found:
        shares = ",".join(f"{w:.2f}" for w in c.weights) or "-"
        mark = "*" if c is chosen else " "
        figures_ms = f"{c.compute_s * 1e3:>11.1f}{c.sync_s * 1e3:>9.1f}{c.total_s * 1e3:>9.1f}{1 / c.total_s:>7.1f}" \
            if c.short is None else f"  does not fit: {c.short}"
        click.echo(f"{mark} {len(c.members):<7}{shares:<26}{c.sync.label:<16}{figures_ms}")
    names = ", ".join(figures[i].name for i in chosen.members)
    click.echo(f"chosen (*): {names}; {chosen.sync.label}; predicted {1 / chosen.total_s:.1f} tok/s")
