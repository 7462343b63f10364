"""`dllama models`: list, pull and synthesize models; show how one splits across nodes."""

from __future__ import annotations

import dataclasses
import os

import click

from ..sync_config import SYNC_MODES
from ..registry import DEFAULT_MODEL, load_registry, models_dir, pull_model, resolve_model


@click.group()
def models():
    """Manage models: the registry, pulled files, synthetic models."""


@models.command("list")
def list_models():
    """Registry entries and whether each is pulled."""
    for name, entry in sorted(load_registry().items()):
        path = models_dir() / entry["file"]
        state = "pulled" if path.exists() else "not pulled"
        click.echo(f"{name:10s} {state:10s} {entry['description']}  [{path}]")


@models.command()
@click.argument("name", default=DEFAULT_MODEL)
@click.option("--quiet", "-q", is_flag=True)
def pull(name, quiet):
    """Download NAME (default: smollm2) into the models folder and check its sha256."""
    path = pull_model(name, quiet=quiet)
    click.echo(str(path))


@models.command()
@click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"]), default="llama",
              show_default=True,
              help="Architecture; qwen2, qwen3 and gemma3 take the shapes of Qwen2.5-0.5B, Qwen3-0.6B and Gemma 3 1B, "
                   "qwen3moe the layers of Qwen3-30B-A3B (12 of them, 32 experts, top-8).")
@click.option("--preset", type=click.Choice(["tiny", "1b"]), default=None,
              help="Shapes of a llama model (default: 1b).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="Output .gguf (default: models folder, synthetic-<preset>-<qtype>.gguf).")
@click.option("--qtype", default=None, help="Weight type (default: the preset's, Q4_0).")
@click.option("--dim", type=int, default=None)
@click.option("--layers", type=int, default=None)
@click.option("--heads", type=int, default=None)
@click.option("--kv-heads", type=int, default=None)
@click.option("--ffn", type=int, default=None)
@click.option("--tied/--untied", default=None, help="Reuse the token embedding as LM head.")
@click.option("--seed", type=int, default=None)
def synth(arch, preset, out, qtype, dim, layers, heads, kv_heads, ffn, tied, seed):
    """Write a synthetic GGUF: random weights, real metadata, the default model's tokenizer."""
    from ..errors import DllamaError
    from ..synthetic import PRESETS, write_synthetic

    if preset is not None and arch != "llama":
        raise DllamaError(f"--preset gives llama shapes; --arch {arch} has its own")
    preset = preset or ("1b" if arch == "llama" else arch)
    spec = PRESETS[preset]
    overrides = {"qtype": qtype, "dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads,
                 "ffn_dim": ffn, "tied_embeddings": tied, "seed": seed}
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    out = out or str(models_dir() / f"synthetic-{preset}-{spec.qtype.lower()}.gguf")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_synthetic(out, spec, resolve_model(DEFAULT_MODEL))
    click.echo(out)


@models.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--nodes", type=click.IntRange(1, 1024), default=1, show_default=True, help="Root + workers.")
@click.option("--weights", "node_weights", default=None, metavar="W0,W1,..",
              help="Relative share of each node (default: equal).")
@click.option("--sync-mode", type=click.Choice(SYNC_MODES), default="reduce", show_default=True)
def plan(model, nodes, node_weights, sync_mode):
    """How MODEL splits across nodes: each node's heads, FFN hidden units (the same units of every
    expert in a mixture of experts), vocabulary rows, and the bytes of weights it holds."""
    from ..errors import DllamaError
    from ..gguf_model import GGUFModel
    from ..model import shard_tensors
    from ..plan import Plan
    from .common import _parse_weights

    gguf = GGUFModel(resolve_model(model))
    weights = _parse_weights(node_weights) if node_weights else [1.0] * nodes
    if node_weights and len(weights) != nodes:
        raise DllamaError(f"--weights has {len(weights)} entries for {nodes} nodes")
    cfg = gguf.config
    experts = f", {cfg.n_experts} experts (top-{cfg.n_experts_used}) of {cfg.ffn_dim} units" if cfg.n_experts else ""
    click.echo(f"{gguf.path}: {cfg.arch}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads"
               f"{experts}; file {gguf.file_size / 1e6:.1f} MB")
    click.echo(f"{'node':>4}  {'query heads':>11}  {'KV heads':>8}  {'FFN units':>11}  {'vocab rows':>13}  "
               f"{'weights MB':>10}")
    for shard in Plan.split(cfg, weights).shards:
        held = sum(t.nbytes for _name, t in shard_tensors(gguf, shard, sync_mode))
        click.echo(f"{shard.node:>4}  {_span(shard.q_heads):>11}  {_span(shard.kv_heads):>8}  {_span(shard.ffn):>11}  "
                   f"{_span(shard.vocab):>13}  {held / 1e6:>10.1f}")
    embeddings = gguf.file.data("token_embd.weight").nbytes
    click.echo(f"(node 0, the root, also looks tokens up in the embeddings: {embeddings / 1e6:.1f} MB memory-mapped, "
               "of which it reads the rows of the tokens it sees)")


def _span(r: tuple[int, int]) -> str:
    return f"{r[0]}-{r[1] - 1}" if r[1] > r[0] else "-"
