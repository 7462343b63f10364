"""Single-node inference speed: dllama next to llama.cpp (llama-cpp-python), same model, same
prompt tokens, same thread count, in one run.

For each thread count, each side runs in its own subprocess (so peak RSS is each side's own) and
measures
- prefill: tokens/s of one forward pass over a ~128-token prompt (logits of the last token only),
- decode: tokens/s of single-token forward passes (greedy), from the median time per token.
dllama is measured in-process through `LocalEngine.feed`, computing on the caller's loop as
`dllama inference` does; llama.cpp through `Llama.eval` (flash attention off, as our numerics
follow its non-flash path). With --llama-no-repack, llama.cpp
also runs with its weight repacking off (on AVX2 it repacks Q4_0, IQ4_NL, Q4_K and Q2_K into 8-row
interleaved blocks whose decode keeps one float lane per row; without it, it runs the per-row dot
products whose order our kernels follow). The machine may be shared, so the sides are interleaved
over --rounds and every figure is a median over rounds and repeats; ratios (dllama / llama.cpp)
compare figures of the same run.

    python benchmarks/bench_inference.py [--model smollm2] [--threads 1,2] [--llama-no-repack] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Plain English, enough for a 128-token prompt (repeated if a longer one is asked for).
PROMPT_TEXT = (
    "The old railway line ran along the valley for almost forty miles, past farms, mills and small "
    "stone villages. When it closed in the nineteen sixties, the rails were lifted and the stations were "
    "sold, but the path remained. Today it is a quiet trail for walkers and cyclists. In spring the banks "
    "are covered with primroses, and in autumn the beech trees turn the whole valley copper and gold. "
    "Near the middle of the route, a long viaduct crosses the river on twenty-one arches. From the top you "
    "can see the roofs of the town, the church tower and, on a clear day, the hills on the far side of the "
    "county. Local volunteers keep the path open: they clear fallen branches, repair the drainage and "
    "count the birds that nest along the old embankments every year."
)


# ------------------------------------------------------------------ measuring (in a subprocess)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_dllama(path: str, threads: int, prompt: list[int], decode: int, repeats: int) -> dict:
    from dllama.cli.common import run_async
    from dllama.engine import LocalEngine
    from dllama.gguf_model import GGUFModel
    from dllama.kernels import set_threads
    from dllama.sampling import Sampler, SamplingParams

    set_threads(threads)
    greedy = SamplingParams(temperature=0.0)
    engine = LocalEngine(GGUFModel(path), len(prompt) + decode + 8, compute_here=True)  # as `dllama inference` runs it
    sampler = Sampler(greedy)

    async def run():
        await engine.feed(prompt[:8], greedy)  # warm-up: load the compiled kernels
        await engine.feed(prompt[8:9], greedy)
        prefill, steps = [], []
        for _ in range(repeats):
            engine.rewind(0)
            t0 = time.perf_counter()
            summaries = await engine.feed(prompt, greedy)
            prefill.append(len(prompt) / (time.perf_counter() - t0))
            for _ in range(decode):
                token = sampler.pick(summaries[-1])
                t0 = time.perf_counter()
                summaries = await engine.feed([token], greedy)
                steps.append(time.perf_counter() - t0)
        return prefill, steps

    prefill, steps = run_async(run())
    return {"prefill": prefill, "steps": steps, "peak_rss_mb": _peak_rss_mb()}


def measure_llama_cpp(path: str, threads: int, prompt: list[int], decode: int, repeats: int,
                      repack: bool = True) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    if not repack:  # Llama() takes no argument for it: its model parameters start from this function
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def without_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = without_repack

    llm = Llama(model_path=path, n_ctx=len(prompt) + decode + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, flash_attn=False, logits_all=False, verbose=False)
    llm.eval(prompt[:8])  # warm-up
    llm.reset()
    prefill, steps = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - t0))
        for _ in range(decode):
            # the last position's logits as llama.cpp holds them: with logits_all=False llama-cpp-python
            # keeps no scores (its rows are sized to the batch, so row n_tokens - 1 stops at 512)
            token = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                                        shape=(llm.n_vocab(),))))
            t0 = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - t0)
    return {"prefill": prefill, "steps": steps, "peak_rss_mb": _peak_rss_mb()}


NO_REPACK = "llama.cpp no repack"  # measured with --llama-no-repack only
SIDES = {"dllama": measure_dllama, "llama.cpp": measure_llama_cpp,
         NO_REPACK: lambda *args: measure_llama_cpp(*args, repack=False)}


# ------------------------------------------------------------------ orchestration


def prompt_tokens(path: str, n: int) -> list[int]:
    """The same token ids for both sides, from the model's own tokenizer (vocabulary-only load)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    ids: list[int] = []
    while len(ids) < n:
        ids += vocab.tokenize((" " + PROMPT_TEXT).encode(), add_bos=False)
    return ids[:n]


def run_side(side: str, path: str, threads: int, prompt: list[int], decode: int, repeats: int) -> dict:
    job = json.dumps({"side": side, "path": path, "threads": threads, "prompt": prompt, "decode": decode,
                      "repeats": repeats})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", job], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{side} with {threads} thread(s) failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="registry name or .gguf path (default: smollm2)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default: 1,2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="prefill + decode runs per subprocess")
    ap.add_argument("--rounds", type=int, default=3, help="subprocesses per side and thread count, interleaved")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="also measure llama.cpp with its weight repacking off (use_extra_bufts)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.measure:  # a subprocess measuring one side
        job = json.loads(args.measure)
        out = SIDES[job["side"]](job["path"], job["threads"], job["prompt"], job["decode"], job["repeats"])
        print(json.dumps(out))
        return

    from dllama.registry import resolve_model

    path = resolve_model(args.model)
    threads = [int(t) for t in args.threads.split(",")]
    prompt = prompt_tokens(path, args.prompt_tokens)
    sides = [side for side in SIDES if args.llama_no_repack or side != NO_REPACK]
    raw = {(t, side): [] for t in threads for side in sides}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for t in threads:
            for side in sides:
                raw[(t, side)].append(run_side(side, path, t, prompt, args.decode_tokens, args.repeats))

    rows = []
    for t in threads:
        figures = {}
        for side in sides:
            runs = raw[(t, side)]
            prefill = statistics.median(v for r in runs for v in r["prefill"])
            step = statistics.median(v for r in runs for v in r["steps"])
            figures[side] = {"threads": t, "engine": side, "prefill_tok_s": prefill, "decode_tok_s": 1.0 / step,
                             "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
            rows.append(figures[side])
        ours = figures["dllama"]
        for side in sides:
            if side == "dllama":
                continue
            ref = figures[side]
            rows.append({"threads": t, "engine": f"ratio dllama/{side}",
                         "prefill_tok_s": ours["prefill_tok_s"] / ref["prefill_tok_s"],
                         "decode_tok_s": ours["decode_tok_s"] / ref["decode_tok_s"],
                         "peak_rss_mb": ours["peak_rss_mb"] / ref["peak_rss_mb"]})

    setup = {"model": os.path.basename(path), "model_mb": os.path.getsize(path) / 1e6,
             "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens, "repeats": args.repeats,
             "rounds": args.rounds, "cpus": os.cpu_count(), "load_avg_before": load_before[0],
             "load_avg_after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}, indent=2))
        return
    print(f"model {setup['model']} ({setup['model_mb']:.1f} MB); prompt {len(prompt)} tokens, decode "
          f"{args.decode_tokens} tokens; {args.repeats} repeats x {args.rounds} rounds, medians; "
          f"{setup['cpus']} CPUs, load average {load_before[0]:.2f} -> {setup['load_avg_after']:.2f}")
    print(f"{'threads':>7}  {'engine':<32} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS MB':>11}")
    for r in rows:
        if r["engine"].startswith("ratio"):
            print(f"{r['threads']:>7}  {r['engine']:<32} {r['prefill_tok_s']:>12.2f}x {r['decode_tok_s']:>11.2f}x "
                  f"{r['peak_rss_mb']:>10.2f}x")
        else:
            print(f"{r['threads']:>7}  {r['engine']:<32} {r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} "
                  f"{r['peak_rss_mb']:>11.0f}")


if __name__ == "__main__":
    main()
