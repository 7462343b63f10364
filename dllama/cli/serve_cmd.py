"""`dllama serve`: the OpenAI-compatible HTTP API (see dllama/server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import replace

import click
from click.core import ParameterSource

from ..kv_cache import MAX_SLOTS
from .common import (cluster_options, info, model_options, open_runtime, require_credential_off_loopback, run_async,
                     sampling_options, sampling_params, speculate_option, speculation)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repeat_penalty", "seed")
DEFAULT_MAX_BATCH = 8  # where aggregate decode speed levels off on a 2-core machine (benchmarks/bench_serve.py)


@click.command()
@model_options
@cluster_options
@sampling_options
@speculate_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free port.")
@click.option("--max-batch", type=click.IntRange(1, MAX_SLOTS), default=DEFAULT_MAX_BATCH, show_default=True,
              help="Requests generating at once: they share every forward step (continuous batching), each with "
                   "its own KV cache.")
@click.option("--kv-budget", type=click.IntRange(16), default=None, metavar="TOKENS",
              help="Tokens the KV caches of all requests may hold (default: --max-batch x --ctx-size; on a cluster "
                   "at most half of what any node has left after its weights). A request reserves its prompt + "
                   "max_tokens; while the budget cannot hold that, it waits in the queue.")
@click.option("--max-queue", type=click.IntRange(0), default=16, show_default=True,
              help="Requests that may wait for a free slot or KV budget; more get HTTP 429.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=2048, show_default=True,
              help="Largest max_tokens a request may ask for (HTTP 400 above it).")
@click.option("--max-body-bytes", type=click.IntRange(1024), default=1 << 20, show_default=True,
              help="Largest request body (HTTP 413 above it).")
@click.option("--model-name", default=None, help="Model id in /v1/models and responses (default: the GGUF's stem).")
@click.option("--api-key", "api_keys", envvar="DLLAMA_API_KEY", multiple=True, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every request but /health and the chat page's files (env "
                   "DLLAMA_API_KEY, which keeps the key out of the process list). Give several (the option again, or "
                   "separated by spaces in DLLAMA_API_KEY) for one per user: each key is then one client for the "
                   "per-client limits, instead of each address.")
@click.option("--insecure", is_flag=True,
              help="Allow a --host other than loopback without --api-key (anyone who reaches the port may use it).")
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              metavar="S", help="Close a connection whose request head has not arrived in S seconds (also: an idle "
                                "kept-alive connection).")
@click.option("--body-timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              metavar="S", help="Answer 408 and close when a request body has not arrived in S seconds.")
@click.option("--write-timeout", type=click.FloatRange(0, min_open=True), default=15.0, show_default=True,
              metavar="S", help="End a streamed answer (and free its slot) when its client has read nothing for S "
                                "seconds.")
@click.option("--max-connections", type=click.IntRange(1), default=256, show_default=True,
              help="Open connections at most; more are answered 503 and closed at once.")
@click.option("--max-requests-per-client", type=click.IntRange(1), default=None, metavar="N",
              help="Requests one client (its address, or its API key when there are several) may have in the engine "
                   "at once; more wait their turn [default: below half of --max-batch].")
@click.option("--max-queued-per-client", type=click.IntRange(0), default=None, metavar="M",
              help="Requests one client may have waiting; more get HTTP 429 at once [default: below half of "
                   "--max-queue].")
@click.option("--queue-timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              metavar="S", help="A request that has waited S seconds to start (for its client's turn, a slot or KV "
                                "room) gets HTTP 503.")
def serve(host, port, max_batch, kv_budget, max_queue, max_tokens_limit, max_body_bytes, model_name, api_keys, insecure,
          header_timeout, body_timeout, write_timeout, max_connections, max_requests_per_client, max_queued_per_client,
          queue_timeout, **opts):
    """Serve the model over an OpenAI-compatible HTTP API (chat completions, completions, models,
    /health, /metrics) and a chat page at / (its panel polls /status). A request that omits a
    sampling field gets OpenAI's default (temperature 1, top_p 1) unless the option is given here."""
    from ..server import ServerConfig
    from ..server.openai_schema import OPENAI_SAMPLING

    api_keys = tuple(key for key in api_keys if key)  # DLLAMA_API_KEY= (empty) means no key
    require_credential_off_loopback(host, api_keys[0] if api_keys else None, insecure, what="API key",
                                    how="--api-key KEY (or DLLAMA_API_KEY)", whom="it")
    speculate, draft_model = speculation(opts, sampling_params(opts))  # the options' ranges, checked as the other commands do
    if opts["speculate"] is None:  # (each request's own sampling decides: auto, or plainly with a penalty)
        speculate = "auto"
    ctx = click.get_current_context()
    given = {name: opts[name] for name in SAMPLING_FIELDS
             if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    config = ServerConfig(model_name=model_name, max_queue=max_queue, max_tokens_limit=max_tokens_limit,
                          max_body_bytes=max_body_bytes, sampling=replace(OPENAI_SAMPLING, **given), api_keys=api_keys,
                          header_timeout=header_timeout, body_timeout=body_timeout, write_timeout=write_timeout,
                          max_connections=max_connections, max_running_per_client=max_requests_per_client,
                          max_queued_per_client=max_queued_per_client, queue_timeout=queue_timeout, speculate=speculate)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for name in ("dllama.server", "aiohttp.access"):  # one line per request, and the server's notes
        logging.getLogger(name).setLevel(logging.INFO)
    run_async(_serve(host, port, config, {**opts, "max_batch": max_batch, "kv_budget": kv_budget,
                                          "draft_model": draft_model}))


async def _serve(host, port, config, opts):
    from ..registry import resolve_model
    from ..server import attach, bound_port, make_app, start_server
    from ..server.app import SERVER

    path = resolve_model(opts.get("model"))
    opts = {**opts, "model": path}
    if config.model_name is None:
        config.model_name = os.path.splitext(os.path.basename(path))[0]
    # listen first: /health says "loading" (503) while the weights go out to the workers
    app = make_app(None, config)
    runner = await start_server(app, host, port)
    stop = asyncio.Event()
    with contextlib.suppress(NotImplementedError):  # Ctrl-C is asyncio.Runner's; SIGTERM ends cleanly too
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    loading = asyncio.ensure_future(open_runtime(opts))
    rt = None
    try:
        auth = "API key required" if config.api_keys else "no API key"
        info(f"dllama serve: listening on http://{host}:{bound_port(runner)} (loading {config.model_name}; {auth})")
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            return
        rt = loading.result()
        attach(app, rt)
        turns = app[SERVER].admission
        info(f"dllama serve: ready; model id {config.model_name!r}, {rt.engine.slots} requests at once, at most "
             f"{config.max_queue} queued; per client {turns.running} at once and {turns.queued} queued")
        await stopping
    finally:
        if not loading.done():
            loading.cancel()
            await asyncio.wait([loading])
        if rt is None and loading.done() and not loading.cancelled() and loading.exception() is None:
            rt = loading.result()  # finished loading just as the server was told to stop
        stopping.cancel()
        try:
            await runner.cleanup()  # running requests get a moment, then are cancelled
        finally:
            if rt is not None:
                await rt.close()
