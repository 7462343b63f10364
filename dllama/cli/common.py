"""Options and set-up shared by the commands that run a model (inference, chat, perplexity, serve)."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from dataclasses import dataclass

import click

from ..errors import DllamaError
from ..sampling import SamplingParams

DEFAULT_CTX = 4096


def run_async(coro):
    """Run a coroutine on uvloop where it is installed (faster sockets), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def model_options(f):
    @click.option("--model", "-m", default=None, metavar="NAME|PATH",
                  help="Registry name or .gguf path (default: smollm2, pulled on first use).")
    @click.option("--threads", "--nthreads", "-t", type=click.IntRange(1), default=None,
                  help="Compute threads per node (default: all cores).")
    @click.option("--ctx-size", "--max-seq-len", "-c", type=click.IntRange(16), default=None,
                  help=f"Context length in tokens (default: the model's, at most {DEFAULT_CTX}).")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


def sampling_options(f):
    @click.option("--temperature", "--temp", type=click.FloatRange(0.0), default=0.8, show_default=True,
                  help="0 means greedy.")
    @click.option("--top-p", "--topp", type=click.FloatRange(0.0, 1.0), default=0.9, show_default=True)
    @click.option("--top-k", type=click.IntRange(0), default=40, show_default=True, help="0 disables the cut.")
    @click.option("--repeat-penalty", type=click.FloatRange(0.0, min_open=True), default=1.0, show_default=True)
    @click.option("--seed", type=int, default=None, help="Random seed for sampling.")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


def sampling_params(opts: dict) -> SamplingParams:
    return SamplingParams(temperature=opts["temperature"], top_p=opts["top_p"], top_k=opts["top_k"],
                          repeat_penalty=opts["repeat_penalty"], seed=opts["seed"])


@dataclass
class Runtime:
    """What a model command needs: the engine and the tokenizer."""

    engine: object
    tokenizer: object
    model_path: str


def open_runtime(opts: dict, quiet: bool = False) -> Runtime:
    from ..engine import LocalEngine
    from ..gguf_model import GGUFModel
    from ..kernels import set_threads
    from ..registry import resolve_model
    from ..tokenizer import Tokenizer

    threads = set_threads(opts.get("threads"))
    path = resolve_model(opts.get("model"))
    model = GGUFModel(path)
    cfg = model.config
    ctx = min(opts.get("ctx_size") or min(cfg.context_length, DEFAULT_CTX), cfg.context_length)
    tokenizer = Tokenizer(path, model.chat_template, cfg.bos_id, cfg.eos_id)
    engine = LocalEngine(model, ctx)
    if not quiet:
        info(f"model {os.path.basename(path)}: {cfg.n_layers} layers, dim {cfg.dim}, "
             f"{cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}; context {engine.ctx_size}; "
             f"{engine.n_nodes} node(s), {threads} thread(s)")
    return Runtime(engine, tokenizer, path)


def info(message: str) -> None:
    click.echo(message, err=True)


def fail(message: str) -> None:
    raise DllamaError(message)


def read_text_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise DllamaError(f"cannot read {path}: {e.strerror}") from None


def stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
