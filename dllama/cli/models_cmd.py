"""`dllama models`: list, pull and synthesize models."""

from __future__ import annotations

import dataclasses
import os

import click

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
@click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3"]), default="llama", show_default=True,
              help="Architecture; qwen2 and qwen3 take the shapes of Qwen2.5-0.5B and Qwen3-0.6B.")
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
