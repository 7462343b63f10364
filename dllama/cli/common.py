"""Options and set-up shared by the commands that run a model (inference, chat, perplexity, serve)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from ..errors import DllamaError
from ..sampling import SamplingParams
from ..speculate import NEEDS_NO_PENALTY, can_speculate, parse_option
from ..sync import ALGO_NAMES
from ..sync_config import MODE_CHOICES, SYNC_DTYPES, SyncConfig

if TYPE_CHECKING:  # imported by the commands that run a model, when they run it
    from ..engine import Engine
    from ..tokenizer import Tokenizer

DEFAULT_CTX = 4096
DISCOVER_TIMEOUT = 2.0  # mDNS answers come within ~1 s on a LAN; resolving each takes one more round


def run_async(coro):
    """Run a coroutine on uvloop where it is installed (faster sockets), else asyncio's loop."""
    from ..net import run

    return run(coro)


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


def _split_list(values) -> list[str]:
    return [item for value in values for item in value.replace(",", " ").split()]


def cluster_options(f):
    @click.option("--workers", "-w", multiple=True, metavar="HOST:PORT|auto",
                  help="Worker daemons to use (repeat, or separate with commas); 'auto': every compatible "
                       "worker advertised on the LAN (mDNS), now and as they appear.")
    @click.option("--discover-timeout", type=click.FloatRange(0.1), default=None, metavar="S",
                  help=f"With --workers auto: how long to look for workers before starting "
                       f"(default {DISCOVER_TIMEOUT:g} s).")
    @click.option("--local-workers", type=click.IntRange(0), default=0,
                  help="Start N worker processes on this machine for this run (N workers + the root).")
    @click.option("--sync", "sync_algo", default="auto", show_default=True, type=click.Choice(ALGO_NAMES),
                  help="All-reduce algorithm between nodes.")
    @click.option("--sync-dtype", "--buffer-float-type", default=None, type=click.Choice(SYNC_DTYPES),
                  help="Payload of the sync points (default: f32 in reduce mode, q80 in gather mode); f64 "
                       "makes results independent of the node count.")
    @click.option("--sync-mode", default="auto", show_default=True, type=click.Choice(MODE_CHOICES),
                  help="reduce: one all-reduce of partial sums per sync point (fewest messages); gather: "
                       "all-gathers, every value computed whole on one node, so any node count gives "
                       "exactly the 1-node result (Q8 blocks where the next matmul reads them: fewest "
                       "bytes); auto: the one the measured link to the workers makes faster.")
    @click.option("--weights", "node_weights", default=None, metavar="W0,W1,..|auto",
                  help="Relative share of each node (root first), or 'auto' to measure their speed.")
    @click.option("--secret", envvar="DLLAMA_SECRET", default=None,
                  help="Shared secret for node authentication (env DLLAMA_SECRET).")
    @click.option("--timeout", type=click.FloatRange(0.1), default=30.0, show_default=True,
                  help="Seconds a silent node is given before it is declared dead.")
    @click.option("--recover/--no-recover", default=True, show_default=True,
                  help="When a worker dies, re-plan onto the others and finish (else stop with an error).")
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


def speculate_option(f):
    return click.option("--speculate", default=None, metavar="off|ngram|auto|draft:MODEL",
                        help="Draft tokens and verify them in one step each: fewer steps (on a cluster, round trips) "
                             "for the same tokens. ngram: from the text so far (prompt lookup); auto: ngram, paused "
                             "where drafts are refused, within the positions a step's measured cost makes worth it; "
                             "draft:MODEL: with a smaller model of the same vocabulary (a registry name or .gguf "
                             "path) on this node. [default: auto; off with a repetition penalty]")(f)


def speculation(opts: dict, params: SamplingParams) -> tuple[str, str | None]:
    """--speculate, checked against the sampling options: the mode, and the draft model's name or path.
    Not given: auto where the sampling allows it (plain decoding otherwise: the same tokens)."""
    if opts["speculate"] is None:
        return ("auto" if can_speculate(params) else "off"), None
    mode, draft_model = parse_option(opts["speculate"])
    if mode != "off" and not can_speculate(params):
        raise DllamaError(f"--speculate needs --repeat-penalty 1: {NEEDS_NO_PENALTY}")
    return mode, draft_model


def sampling_params(opts: dict) -> SamplingParams:
    params = SamplingParams(temperature=opts["temperature"], top_p=opts["top_p"], top_k=opts["top_k"],
                            repeat_penalty=opts["repeat_penalty"], seed=opts["seed"])
    problem = params.problem()  # (click's ranges let NaN and infinities through)
    if problem:
        raise DllamaError(f"--{problem[0].replace('_', '-')} {problem[1]}")
    return params


@dataclass
class Runtime:
    """What a model command needs: the engine, the tokenizer, and what to stop at the end."""

    engine: Engine
    tokenizer: Tokenizer
    model_path: str
    local_workers: object = None
    drafter: object = None  # --speculate draft:MODEL's draft_model.DraftModel

    async def close(self) -> None:
        try:
            await self.engine.close()
            if self.drafter is not None:
                await self.drafter.close()
        finally:
            if self.local_workers is not None:
                self.local_workers.stop()


def _parse_weights(text: str | None):
    if text is None or text == "auto":
        return text
    try:
        weights = [float(x) for x in _split_list([text])]
    except ValueError:
        raise DllamaError(f"--weights takes numbers separated by commas, or 'auto' (got {text!r})") from None
    if not weights or any(w <= 0 for w in weights):
        raise DllamaError("--weights must be positive numbers")
    return weights


async def open_runtime(opts: dict, quiet: bool = False, compute_here: bool = False) -> Runtime:
    """The engine and tokenizer the options ask for. compute_here: a model run alone computes on this
    loop, for a command with nothing to answer during a step (serve's loop must stay responsive). A
    cluster's root keeps its compute thread: its connections keep their heartbeats even while this
    loop is blocked writing to a paused terminal, and its sync costs far more than the hop."""
    from ..draft_model import DraftModel
    from ..engine import LocalEngine
    from ..gguf_model import GGUFModel
    from ..kernels import set_threads
    from ..registry import resolve_model
    from ..tokenizer import Tokenizer

    listed = _split_list(opts.get("workers") or ())
    auto = "auto" in listed
    workers = [_address(a) for a in listed if a != "auto"]
    if opts.get("discover_timeout") is not None and not auto:
        fail("--discover-timeout applies to --workers auto")
    if auto and isinstance(_parse_weights(opts.get("node_weights")), list):
        fail("--weights with numbers needs a fixed --workers list; with --workers auto use --weights auto or none")
    sync = SyncConfig(opts.get("sync_algo", "auto"), opts.get("sync_mode", "auto"), opts.get("sync_dtype"))
    path = resolve_model(opts.get("model"))
    model = GGUFModel(path)
    cfg = model.config
    ctx = min(opts.get("ctx_size") or min(cfg.context_length, DEFAULT_CTX), cfg.context_length)
    tokenizer = Tokenizer(path, model.chat_template, cfg.bos_id, cfg.eos_id)
    draft_name = opts.get("draft_model")  # (speculation()'s, set by the commands that speculate)
    draft_model = None if draft_name is None else DraftModel.open(draft_name, model, ctx)  # (refused before loading)
    slots, kv_budget = opts.get("max_batch") or 1, opts.get("kv_budget")  # (serve's: the others run one sequence)
    if kv_budget is not None and kv_budget < ctx:
        fail(f"--kv-budget {kv_budget} cannot hold one context of {ctx} tokens (--ctx-size)")
    n_local = opts.get("local_workers") or 0
    threads = opts.get("threads")
    if n_local and threads is None:  # the root and its local workers share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // (n_local + 1))
    threads = set_threads(threads)
    local = None
    if workers or n_local or auto:
        from ..cluster.local import LocalWorkers
        from ..cluster.root import ClusterEngine

        if n_local:
            local = LocalWorkers(n_local, threads, opts.get("secret"), opts.get("timeout", 30.0))
            workers += local.start()
        browser = None
        try:
            if auto:
                browser = await _look_for_workers(opts.get("discover_timeout") or DISCOVER_TIMEOUT, opts.get("secret"))
            engine = await ClusterEngine(
                model, ctx, workers, sync=sync, weights=_parse_weights(opts.get("node_weights")), secret=opts.get("secret"),
                timeout=opts.get("timeout", 30.0), progress=not quiet, recover=opts.get("recover", True),
                browser=browser, slots=slots, kv_budget=kv_budget).start()  # the engine owns the browser from here
        except BaseException:
            if browser is not None:
                await browser.close()  # closing twice is harmless
            if local is not None:
                local.stop()
            raise
    else:
        engine = LocalEngine(model, ctx, sync, slots, kv_budget, compute_here)
    drafter = None
    try:
        await engine.warm_up()
        if draft_model is not None:
            drafter = await DraftModel.start(draft_model, draft_name, engine.ctx_size, engine.slots)
    except BaseException:
        await Runtime(engine, tokenizer, path, local).close()
        raise
    if not quiet:
        info(f"model {os.path.basename(path)}: {cfg.n_layers} layers, dim {cfg.dim}, "
             f"{cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}; context {engine.ctx_size}"
             + (f" (up to {slots} sequences at once, KV budget {engine.kv_budget} tokens); " if slots > 1 else "; ") +
             f"{engine.n_nodes} node(s) ({engine.sync.algo} sync, {engine.sync.mode}, {engine.sync.dtype}), "
             f"{threads} thread(s) each")
        choice = engine.sync_choice
        if choice is not None and "reason" in choice:
            info(f"--sync-mode auto: {choice['chosen']}, {choice['reason']}")
        elif choice is not None:
            predicted = ", ".join(f"{label} {ms:.2f}" for label, ms in choice["predicted_sync_ms_per_token"].items())
            info(f"--sync-mode auto: {choice['chosen']} on the measured link ({choice['link']}); "
                 f"predicted sync ms/token: {predicted}")
        if drafter is not None:
            info(f"--speculate draft:{draft_name}: {drafter.engine.config.n_layers} layers, dim "
                 f"{drafter.engine.config.dim}, on this node")
    return Runtime(engine, tokenizer, path, local, drafter)


async def _look_for_workers(timeout: float, secret: str | None):
    """A running mDNS browser, after `timeout` seconds of looking; what it found is told."""
    from ..net.discovery import Browser

    browser = await Browser().start()
    try:
        await asyncio.sleep(timeout)
    except BaseException:
        await browser.close()
        raise
    found = browser.found()
    usable = [f"{ad.name} ({ad.host}:{ad.port})" for ad in found if ad.unusable_reason(secret) is None]
    left_out = [f"{ad.name} ({ad.host}:{ad.port}) {ad.unusable_reason(secret)}" for ad in found
                if ad.unusable_reason(secret) is not None]
    info(f"--workers auto: {len(usable)} worker(s) found in {timeout:g} s"
         + (f": {', '.join(usable)}" if usable else " (more join at the next request as they appear)")
         + (f"; not used: {'; '.join(left_out)}" if left_out else ""))  # even with --json: it is on stderr
    return browser


def _address(text: str) -> tuple[str, int]:
    from ..cluster.link import parse_address

    return parse_address(text)


def is_loopback(host: str) -> bool:
    """Whether every address `host` stands for is a loopback one (127.0.0.0/8, ::1). A name that
    does not resolve counts as not loopback: the check errs on the safe side."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def require_credential_off_loopback(host: str, credential: str | None, insecure: bool, *, what: str,
                                    how: str, whom: str) -> None:
    """A server bound to a non-loopback address without `what` (a secret, an API key) refuses to
    start, unless --insecure, which only warns: anyone who reaches the port could use it."""
    if credential is not None or is_loopback(host):
        return
    if not insecure:
        fail(f"--host {host} is not a loopback address and no {what} is set: give {how}, or --insecure to let "
             f"anyone who reaches the port use {whom}")
    info(f"warning: serving on {host} without {'an' if what[0] in 'aeiouAEIOU' else 'a'} {what} (--insecure): "
         f"anyone who reaches the port may use {whom}")


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
    except UnicodeDecodeError as e:
        raise DllamaError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
