"""The engines alone, without a server: one decode step of B sequences, dllama next to llama.cpp.

How much a batch gains is the engine's before it is the server's: `bench_serve.py`'s aggregate at
N clients over 1 client can only approach what one decode step of N sequences gives over a step
of one, with no HTTP, sampling or prompts around it. This measures that ceiling for both engines on
the same GGUF, threads and positions, in one run:

- dllama: `LocalEngine.step` of B sequences, one new token each (on the caller's loop, as
  `inference` runs);
- llama.cpp (llama-cpp-python's low-level API, flash attention off as our numerics follow): one
  `llama_decode` of a batch of B tokens, one per sequence id, each asking for its logits (what
  llama-server's continuous batching decodes).

Every sequence first reads --prompt-tokens tokens; each step then appends one token at the same
position, which is rewound before the next, so every step sees the same context. Each engine runs in
its own subprocess; the sides alternate over --rounds and the figures are medians, so a shared
machine's slow spells hit both alike.

    python benchmarks/bench_batch.py [--model smollm2|PATH] [--batches 1,4,8,16] [--threads 2]
                                     [--prompt-tokens 64] [--steps 20] [--rounds 3] [--json]

Per engine and batch size: the median step in ms, tokens/s (B / step) and the batch's gain, its
tokens/s over its own tokens/s at B = 1. `bench_serve.py`'s "aggregate at 8 clients / 1 client"
is bounded by the gain at 8, less what prompt steps and the server take.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def measure_dllama(path: str, threads: int, batches: list[int], prompt_tokens: int, steps: int) -> dict[int, list]:
    import asyncio

    from dllama.engine import LocalEngine, SeqInput
    from dllama.gguf_model import GGUFModel
    from dllama.kernels import set_threads
    from dllama.sampling import SamplingParams

    set_threads(threads)
    greedy = SamplingParams(temperature=0.0)
    most = max(batches)
    tokens = _tokens(most, prompt_tokens + steps)

    async def run() -> dict[int, list]:
        engine = LocalEngine(GGUFModel(path), prompt_tokens + 32, slots=most, compute_here=True)
        await engine.warm_up()
        for s in range(most):
            await engine.feed(tokens[s][:prompt_tokens], greedy, slot=s)  # (in steps of at most PREFILL_CHUNK)
            engine.reserve(s, prompt_tokens + 1)
        times = {b: [] for b in batches}
        for i in range(steps):
            for b in batches:  # (interleaved: a slow spell hits every batch size)
                for s in range(b):
                    engine.rewind(prompt_tokens, s)
                t0 = time.perf_counter()
                await engine.step([SeqInput(s, [tokens[s][prompt_tokens + i]], greedy) for s in range(b)])
                times[b].append(time.perf_counter() - t0)
        await engine.close()
        return times

    return asyncio.run(run())


def measure_llama_cpp(path: str, threads: int, batches: list[int], prompt_tokens: int, steps: int) -> dict[int, list]:
    import llama_cpp as lc

    lc.llama_backend_init()
    most = max(batches)
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_seq_max = most
    params.n_ctx = most * (prompt_tokens + 32)
    params.n_batch = params.n_ubatch = max(512, prompt_tokens)
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, params)
    if not model or not ctx:
        raise SystemExit(f"error: llama.cpp could not load {path}")
    memory = lc.llama_get_memory(ctx)
    tokens = _tokens(most, prompt_tokens + steps)
    batch = lc.llama_batch_init(max(512, prompt_tokens), 0, most)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (sequence, position, token, logits) entries."""
        batch.n_tokens = len(entries)
        for i, (seq, pos, token, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("error: llama_decode failed")

    for s in range(most):
        decode([(s, p, tokens[s][p], p == prompt_tokens - 1) for p in range(prompt_tokens)])
    decode([(0, prompt_tokens, tokens[0][prompt_tokens], True)])  # (a first step of one token: warm)
    times = {b: [] for b in batches}
    for i in range(steps):
        for b in batches:
            for s in range(b):
                lc.llama_memory_seq_rm(memory, s, prompt_tokens, -1)
            t0 = time.perf_counter()
            decode([(s, prompt_tokens, tokens[s][prompt_tokens + i], True) for s in range(b)])
            times[b].append(time.perf_counter() - t0)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return times


def _tokens(sequences: int, n: int) -> list[list[int]]:
    """Fixed token ids per sequence (the same for both engines), within any real vocabulary."""
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(100, 20000, n)] for _ in range(sequences)]


SIDES = {"dllama": measure_dllama, "llama.cpp": measure_llama_cpp}


def run_side(side: str, args: argparse.Namespace, model: str) -> dict[int, list]:
    """One side in its own subprocess (its threads, caches and memory its own)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model", model, "--batches", args.batches,
           "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"error: {side} failed: {out.stderr.strip().splitlines()[-1:] or out.returncode}")
    return {int(b): t for b, t in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps per batch size in each subprocess")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # (a subprocess's own side)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        ap.error(f"--batches: sizes separated by commas, not {args.batches!r}")
    if batches[0] < 1 or args.prompt_tokens < 1 or args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--batches, --prompt-tokens, --steps, --rounds and --threads must be at least 1")
    if 1 not in batches:
        batches = [1, *batches]  # (the gain is over one sequence)
        args.batches = ",".join(map(str, batches))
    sys.path.insert(0, ROOT)
    if args.side:
        print(json.dumps(SIDES[args.side](args.model, args.threads, batches, args.prompt_tokens, args.steps)))
        return
    from dllama.registry import resolve_model

    model = str(resolve_model(args.model))
    times: dict[str, dict[int, list]] = {side: {b: [] for b in batches} for side in SIDES}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for side in SIDES:
            for b, t in run_side(side, args, model).items():
                times[side][b] += t
            print(f"  {side}: round done", file=sys.stderr)
    figures = {side: {b: statistics.median(t) * 1e3 for b, t in by_batch.items()} for side, by_batch in times.items()}
    if args.json:
        print(json.dumps({side: {str(b): {"step_ms": ms, "tokens_per_s": b / ms * 1e3,
                                          "gain": b / ms * f[1]} for b, ms in f.items()}
                          for side, f in figures.items()}, indent=1))
        return
    print(f"model {os.path.basename(model)}, {args.threads} thread(s), decode steps at position {args.prompt_tokens}, "
          f"medians of {args.rounds} x {args.steps} steps, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| batch | dllama step ms | dllama tok/s | dllama gain | llama.cpp step ms | llama.cpp tok/s | llama.cpp gain "
          "| dllama / llama.cpp tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    ours, anchor = figures["dllama"], figures["llama.cpp"]
    for b in batches:
        print(f"| {b} | {ours[b]:.2f} | {b / ours[b] * 1e3:.0f} | {b * ours[1] / ours[b]:.2f}x | {anchor[b]:.2f} | "
              f"{b / anchor[b] * 1e3:.0f} | {b * anchor[1] / anchor[b]:.2f}x | {anchor[b] / ours[b]:.2f}x |")


if __name__ == "__main__":
    main()
