"""`dllama inference`, `dllama chat`, `dllama perplexity`."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time

import click

from ..errors import DllamaError
from ..generate import Generator
from ..stream import peak_rss_mb
from ..sampling import SamplingParams, target_logprob
from .common import (cluster_options, info, model_options, open_runtime, read_text_file, run_async,
                     sampling_options, sampling_params, speculate_option, speculation, stdout_write)


@click.command()
@model_options
@cluster_options
@sampling_options
@speculate_option
@click.option("--prompt", "-p", required=True, help="Raw prompt (no chat template), like llama.cpp's completion.")
@click.option("--steps", "-n", type=click.IntRange(1), default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and the figures.")
def inference(prompt, steps, stop, as_json, **opts):
    """Generate a completion of PROMPT and report speed (tokens/s, compute vs sync time)."""
    run_async(_inference(prompt, steps, list(stop), as_json, opts))


async def _inference(prompt, steps, stop, as_json, opts):
    params = sampling_params(opts)  # (checked before anything loads)
    speculate, opts["draft_model"] = speculation(opts, params)
    rt = await open_runtime(opts, quiet=as_json, compute_here=True)
    try:
        ids = rt.tokenizer.encode(prompt)
        if len(ids) > rt.engine.ctx_size:
            raise DllamaError(f"the prompt has {len(ids)} tokens; the context holds {rt.engine.ctx_size} "
                              "(raise --ctx-size)")
        if not as_json:
            stdout_write(prompt)
        gen = await Generator(rt.engine, rt.tokenizer, rt.drafter).generate(
            ids, params, steps, stop, on_text=None if as_json else stdout_write, speculate=speculate)
        report = gen.report(rt.engine)
        if as_json:
            click.echo(json.dumps(report))
        else:
            stdout_write("\n")
            ms = report["ms_per_token"]
            info(f"prompt: {len(ids)} tokens ({report['prefill_tokens_per_s']:.1f} tok/s); "
                 f"generated: {len(gen.tokens)} tokens, {report['tokens_per_s']:.2f} tok/s "
                 f"({ms['total']:.1f} ms/token: compute {ms['compute']:.1f}, sync {ms['sync']:.1f}); "
                 f"sent {report['bytes_per_token']['sent']:.0f} B/token, "
                 f"received {report['bytes_per_token']['recv']:.0f} B/token; peak RSS {report['peak_rss_mb']:.0f} MB")
        if gen.error:
            raise DllamaError(f"{gen.error} (after {len(gen.tokens)} generated tokens; the text so far is above)")
    finally:
        await rt.close()


@click.command()
@model_options
@cluster_options
@sampling_options
@speculate_option
@click.option("--system", "system_prompt", default=None, help="System prompt.")
@click.option("--max-tokens", "-n", type=click.IntRange(1), default=512, show_default=True,
              help="Tokens per answer at most.")
def chat(system_prompt, max_tokens, **opts):
    """Interactive chat with the model's chat template. Ctrl-D (or 'exit') ends it."""
    run_async(_chat(system_prompt, max_tokens, opts))


async def _chat(system_prompt, max_tokens, opts):
    params = sampling_params(opts)  # (checked before anything loads)
    speculate, opts["draft_model"] = speculation(opts, params)
    rt = await open_runtime(opts, compute_here=True)
    try:
        if not rt.tokenizer.has_chat_template:
            raise DllamaError("this model has no chat template; use `dllama inference`")
        generator = Generator(rt.engine, rt.tokenizer, rt.drafter)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        interactive = sys.stdin.isatty()
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 meet the tokenizer's clear error
            sys.stdin.reconfigure(errors="surrogateescape")
        if interactive:
            info("chat: type a message, Enter to send; Ctrl-D or 'exit' to quit")
        while True:
            if interactive:
                stdout_write("\n> ")
            # read in a thread: the event loop keeps answering the workers' heartbeats meanwhile
            line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() in ("exit", "quit", "/bye"):
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            ids = rt.tokenizer.chat_ids(messages)
            gen = await generator.generate(ids, params, max_tokens, on_text=stdout_write, speculate=speculate)
            stdout_write("\n")
            if gen.error:
                raise DllamaError(f"{gen.error} (the answer so far is above)")
            messages.append({"role": "assistant", "content": gen.text})
            if interactive:
                info(f"[{len(gen.tokens)} tokens, {gen.decode_tokens / gen.decode_s if gen.decode_s else 0:.1f} tok/s, "
                     f"{gen.prefill_tokens} prompt tokens computed, {len(ids) - gen.prefill_tokens} reused]")
    finally:
        await rt.close()


@click.command()
@model_options
@cluster_options
@click.option("--text-file", "-f", required=True, type=click.Path(dir_okay=False), help="UTF-8 text to score.")
@click.option("--max-tokens", type=click.IntRange(2), default=None, help="Score only the first N tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def perplexity(text_file, max_tokens, as_json, **opts):
    """Perplexity of the model on a text (teacher forcing, context windows of --ctx-size)."""
    run_async(_perplexity(text_file, max_tokens, as_json, opts))


async def _perplexity(text_file, max_tokens, as_json, opts):
    text = read_text_file(text_file)
    rt = await open_runtime(opts, quiet=as_json)  # its own thread computes: a Ctrl-C needs no turn of ours
    try:
        ids = rt.tokenizer.encode(text)
        if max_tokens:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise DllamaError(f"{text_file} has fewer than 2 tokens")
        window = rt.engine.ctx_size
        greedy = SamplingParams(temperature=0.0)
        logprobs: list[float] = []
        t0 = time.perf_counter()
        # independent windows, each scored from its first token (like llama.cpp's perplexity)
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            rt.engine.rewind(0)
            summaries = await rt.engine.feed(chunk[:-1], greedy, targets=chunk[1:])
            logprobs += [target_logprob(per_node) for per_node in summaries]
        elapsed = time.perf_counter() - t0
        mean = sum(logprobs) / len(logprobs)
        result = {"perplexity": math.exp(-mean), "mean_logprob": mean, "tokens": len(logprobs),
                  "nodes": rt.engine.n_nodes, "sync": rt.engine.sync.algo, "sync_dtype": rt.engine.sync.dtype,
                  "tokens_per_s": len(logprobs) / elapsed, "peak_rss_mb": peak_rss_mb()}
        if as_json:
            click.echo(json.dumps(result))
        else:
            click.echo(f"perplexity {result['perplexity']:.4f} (mean log-prob {mean:.4f} over {len(logprobs)} tokens, "
                       f"{result['tokens_per_s']:.1f} tok/s)")
    finally:
        await rt.close()
