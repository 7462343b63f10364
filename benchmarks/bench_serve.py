"""Serving many users at once: dllama serve (continuous batching) next to llama.cpp's llama-server
(-np N, continuous batching, a KV cache slot per client), same GGUF, same threads, in one run.

For each server and each concurrency N, the server is started for N clients (ours --max-batch N,
llama-server -np N, each slot the same context) and warmed up. Streaming clients (aiohttp, the
OpenAI chat API, stream with usage) ask fixed different questions, greedy, with a fixed max_tokens,
in two loads (--loads):
- burst: N clients ask at the same instant, once each. The worst case for the first token: the
  last one waits for all N prompts.
- sustained: N users, each asking its next question as soon as its answer ends, for --duration
  seconds once all have started (they start --stagger seconds apart): the load of llama.cpp's own
  server benchmark (tools/server/bench: k6 virtual users in a loop). Requests arrive while others
  decode, as when people share a server. Figures over the requests started in that window.
Figures per run: aggregate generated tokens/s (burst: all tokens / wall time from the first
request to the last answer; sustained: tokens streamed within the window / its length), per-stream
decode tokens/s (median over requests, after each one's first token), time to first token p50 /
p95. Several rounds; the table shows medians. For ours, a second table: where its engine's time
went in the same window, from the batcher's counters (/metrics' dllama_batch_kind_*): the share of
the time in steps of each kind (decode: every sequence's next token; prompt: prompt tokens alone;
mixed: both), a decode step's sequences and milliseconds, and the engine's decode tokens/s while
decoding. The aggregate is about that rate times the decode steps' share of the time; the line under
the table splits the 8-client / 1-client ratio so.

    python benchmarks/bench_serve.py [--model smollm2|PATH] [--clients 1,4,8,16] [--max-tokens 64]
                                     [--threads 2] [--servers ours,ours-no-http,ours-3,llama-server]
                                     [--rounds 2]
                                     [--loads burst,sustained] [--duration 20] [--stagger 0.25]

ours: one node with --threads; ours-no-http: the same engine and scheduler with the users as
coroutines of its process (no HTTP, no JSON, no client process: the gap to ours is what its front
end costs); ours-3: root + 2 local workers (one thread each: the machine's
cores are shared by three processes); llama-server: built by benchmarks/build_llama_server.sh from the
llama.cpp sources in the llama-cpp-python sdist that pyproject.toml pins (the script runs it if the
binary is missing). The machine may be shared: compare figures of the same run. A 1B-class model:
`dllama models synth --preset 1b --qtype Q4_1`, then --model models/synthetic-1b-q4_1.gguf.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LLAMA_SERVER = os.path.join(HERE, ".llama-server", "bin", "llama-server")
CTX_PER_SLOT = 512
NO_HTTP = "ours-no-http"  # ours's engine and scheduler alone, the users in its process (no_http_loads)
NO_HTTP_TIMEOUT = 600  # s, beyond a sustained load's duration: loading, warming up, a burst

QUESTIONS = ["What is the capital of France?", "Name three colours and describe them.", "Count from one to ten.",
             "What do bees make, and how?", "Say hello in five languages.", "Explain what rain is.",
             "Name the planets of the solar system.", "What is the opposite of hot, and why?",
             "Describe a cat to a child.", "What is a computer?", "How do plants grow?", "Why is the sky blue?",
             "What is music?", "Describe the sea.", "What is a train?", "How does a bicycle work?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ servers


class Server:
    def __init__(self, kind: str, model: str, threads: int, slots: int):
        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "llama-server":
            cmd = [LLAMA_SERVER, "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                   "-c", str(CTX_PER_SLOT * slots), "--port", str(self.port), "--host", "127.0.0.1", "-fa", "off",
                   "--no-webui"]
        else:
            cmd = [sys.executable, "-m", "dllama", "serve", "--model", model, "--port", str(self.port),
                   "--max-batch", str(slots), "--ctx-size", str(CTX_PER_SLOT), "--max-queue", "64",
                   # every simulated user comes from 127.0.0.1: one client, given all of the engine
                   "--max-requests-per-client", str(slots), "--max-queued-per-client", "64"]
            cmd += ["--local-workers", "2", "--threads", "1"] if kind == "ours-3" else ["--threads", str(threads)]
        # the log to a file, not a pipe: nobody reads a pipe while the server runs, and once its buffer
        # is full (llama-server logs every request) the server would block writing to it
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, cwd=ROOT)

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    async def ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.kind} exited: {self.log_tail()}")
                try:
                    async with http.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.kind} did not become ready in {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------ clients


async def one_stream(http: aiohttp.ClientSession, url: str, question: str, max_tokens: int, t0: float) -> dict:
    """One streamed answer; its time to first token counts from t0."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks = []  # when each piece of text arrived
    usage = None
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    chunks.append(time.perf_counter())
    return _answer(start, t0, usage["completion_tokens"] if usage else len(chunks), chunks, time.perf_counter())


def _answer(start: float, t0: float, tokens: int, chunks: list[float], end: float) -> dict:
    """One answer's figures: it was asked at `start`, its pieces of text came at `chunks`."""
    first = chunks[0] if chunks else end
    return {"start": start, "ttft": first - t0, "tokens": tokens, "chunks": chunks, "end": end,
            "decode_tps": (tokens - 1) / (end - first) if end > first else 0.0}


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


def _latency(requests: list[dict]) -> dict:
    ttfts = sorted(r["ttft"] for r in requests)
    return {"stream_tps": statistics.median(r["decode_tps"] for r in requests),
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p95_ms": 1e3 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "requests": len(requests)}


async def run_burst(ask, n: int, max_tokens: int, counters=None) -> dict:
    """n clients ask at the same instant, once each. ask(question, max_tokens, t0): one answer's
    figures (one_stream's). counters: ours' step counters (step_counters), or None."""
    before = await counters() if counters else None
    t0 = time.perf_counter()
    results = await asyncio.gather(*(ask(QUESTIONS[i % len(QUESTIONS)], max_tokens, t0) for i in range(n)))
    wall = max(r["end"] for r in results) - t0
    tokens = sum(r["tokens"] for r in results)
    steps = step_figures(before, await counters(), wall) if counters else {}
    return {"aggregate_tps": tokens / wall, **_latency(results), "tokens": tokens, **steps}


async def run_sustained(ask, n: int, max_tokens: int, duration: float, stagger: float, counters=None) -> dict:
    """n users, user i starting i * stagger seconds in, each asking again as soon as its answer
    ends, until `duration` seconds after the last one started; figures over that window. Every
    question is numbered, so that no server answers it from a cached earlier prompt. counters:
    ours' step counters (step_counters), read as the window opens and closes, or None."""
    asked = 0

    async def counted_window() -> dict:
        await asyncio.sleep(window_start - time.perf_counter())
        before = await counters()
        await asyncio.sleep(window_end - time.perf_counter())
        return step_figures(before, await counters(), duration)

    async def user(i: int) -> list[dict]:
        nonlocal asked
        await asyncio.sleep(i * stagger)
        answers = []
        while time.perf_counter() < window_end:
            asked += 1
            question = f"Question {asked}: {QUESTIONS[(i + len(answers) * n) % len(QUESTIONS)]}"
            answers.append(await ask(question, max_tokens, time.perf_counter()))
        return answers

    window_start = time.perf_counter() + (n - 1) * stagger
    window_end = window_start + duration
    window = asyncio.ensure_future(counted_window()) if counters else None
    answers = [a for user_answers in await asyncio.gather(*(user(i) for i in range(n))) for a in user_answers]
    steps = await window if window else {}
    # an answer's tokens spread over its pieces of text (a piece is a token, or a few)
    streamed = sum(a["tokens"] / len(a["chunks"]) * sum(window_start <= c < window_end for c in a["chunks"])
                   for a in answers if a["chunks"])
    inside = [a for a in answers if window_start <= a["start"] < window_end]
    return {"aggregate_tps": streamed / duration, **_latency(inside), "tokens": round(streamed), **steps}


async def run_loads(ask, n: int, max_tokens: int, loads: list[str], duration: float, stagger: float,
                    counters=None) -> dict:
    await ask("Hello", 4, time.perf_counter())  # warm-up, once for the loads that follow
    return {load: await (run_burst(ask, n, max_tokens, counters) if load == "burst" else
                         run_sustained(ask, n, max_tokens, duration, stagger, counters)) for load in loads}


# ------------------------------------------------------------------ where ours' time went

STEP_KINDS = ("decode", "prompt", "mixed")  # (dllama.batching.STEP_KINDS, as /metrics labels them)


def batcher_counters(batcher) -> dict:
    """The step counters of a Batcher (or None before its first request): {(what, kind): value}."""
    return {(what, kind): 0 if batcher is None else getattr(batcher, f"kind_{what}")[kind]
            for what in ("steps", "tokens", "seconds") for kind in STEP_KINDS}


async def metrics_counters(http: aiohttp.ClientSession, url: str) -> dict:
    """The same from a server's /metrics (dllama_batch_kind_{steps,tokens,seconds}_total{kind})."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what in ("steps", "tokens", "seconds"):
                if sample.name == f"dllama_batch_kind_{what}_total":
                    out[(what, sample.labels["kind"])] = sample.value
    if len(out) != 3 * len(STEP_KINDS):
        raise RuntimeError(f"{url}/metrics has no step counters by kind")
    return out


def step_figures(before: dict, after: dict, wall: float) -> dict:
    """Where the engine's time went between two readings of its counters, over `wall` seconds: each
    kind's share of the time; a decode step's sequences and milliseconds, and the decode tokens/s of
    the engine while it decodes; a prompt step's tokens."""
    d = {key: after[key] - before[key] for key in after}
    out = {f"{kind}_share": d[("seconds", kind)] / wall for kind in STEP_KINDS}
    out["idle_share"] = max(0.0, 1 - sum(out.values()))
    steps, tokens, seconds = d[("steps", "decode")], d[("tokens", "decode")], d[("seconds", "decode")]
    out["decode_batch"] = tokens / steps if steps else 0.0
    out["decode_step_ms"] = 1e3 * seconds / steps if steps else 0.0
    out["decode_rate_tps"] = tokens / seconds if seconds else 0.0
    out["prompt_step_tokens"] = d[("tokens", "prompt")] / d[("steps", "prompt")] if d[("steps", "prompt")] else 0.0
    return out


async def measure(kind: str, model: str, threads: int, n: int, max_tokens: int, loads: list[str],
                  duration: float, stagger: float) -> dict[str, dict]:
    if kind == NO_HTTP:
        return no_http_side(model, threads, n, max_tokens, loads, duration, stagger)
    server = Server(kind, model, threads, n)
    try:
        await server.ready()
        async with _session() as http:
            counters = partial(metrics_counters, http, server.url) if kind != "llama-server" else None
            return await run_loads(partial(one_stream, http, server.url), n, max_tokens, loads, duration, stagger,
                                   counters)
    except aiohttp.ClientError as e:
        raise RuntimeError(f"{type(e).__name__}: {e}; the server's log ends: {server.log_tail()[-400:]!r}") from e
    finally:
        server.stop()


# ------------------------------------------------------------------ ours without HTTP


def no_http_side(model: str, threads: int, n: int, max_tokens: int, loads: list[str], duration: float,
                 stagger: float) -> dict[str, dict]:
    """NO_HTTP's figures, from a process of its own (as the servers have)."""
    job = {"model": model, "threads": threads, "n": n, "max_tokens": max_tokens, "loads": loads,
           "duration": duration, "stagger": stagger}
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--no-http-job", json.dumps(job)],
                              cwd=ROOT, capture_output=True, text=True, timeout=NO_HTTP_TIMEOUT + duration)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{NO_HTTP} did not finish in {NO_HTTP_TIMEOUT + duration:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise RuntimeError(f"{NO_HTTP} exited with {done.returncode}: {last}")
    return json.loads(done.stdout)


async def no_http_loads(model: str, threads: int, n: int, max_tokens: int, loads: list[str], duration: float,
                        stagger: float) -> dict[str, dict]:
    """`ours` without its front end: the engine and the scheduler `serve` runs (Batcher, a compute
    thread beside the event loop) and the same prompts (the chat template); the users are coroutines
    of this process, counting the pieces of text as the server would stream them. No HTTP, no JSON,
    no client process: the gap between its figures and `ours`'s is what the front end costs."""
    from dllama.cli.common import open_runtime
    from dllama.generate import Generator
    from dllama.sampling import SamplingParams

    runtime = await open_runtime({"model": model, "threads": threads, "max_batch": n, "ctx_size": CTX_PER_SLOT},
                                 quiet=True)
    try:
        generator, tokenizer = Generator(runtime.engine, runtime.tokenizer), runtime.tokenizer
        greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0)  # (the API's defaults, at temperature 0)

        async def ask(question: str, max_tokens: int, t0: float) -> dict:
            prompt = tokenizer.chat_ids([{"role": "user", "content": question}])  # (as ServerState.chat_prompt)
            start, chunks = time.perf_counter(), []
            gen = await generator.generate(prompt, greedy, max_tokens,
                                           on_text=lambda piece: piece and chunks.append(time.perf_counter()))
            return _answer(start, t0, len(gen.tokens), chunks, time.perf_counter())

        async def counters() -> dict:
            return batcher_counters(runtime.engine.batcher)

        return await run_loads(ask, n, max_tokens, loads, duration, stagger, counters)
    finally:
        await runtime.close()


# ------------------------------------------------------------------ the table


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    if sys.argv[1:2] == ["--no-http-job"]:  # (no_http_side's process)
        sys.path.insert(0, ROOT)
        try:
            print(json.dumps(asyncio.run(no_http_loads(**json.loads(sys.argv[2])))))
        except Exception as e:  # the traceback for whoever debugs it, then the line no_http_side reports
            traceback.print_exc()
            raise SystemExit(f"error: {type(e).__name__}: {e}") from None
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--servers", default=f"ours,{NO_HTTP},ours-3,llama-server")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loads", default="burst,sustained", help="burst, sustained, or both (comma-separated)")
    ap.add_argument("--duration", type=float, default=20.0, help="sustained: seconds measured once all users ask")
    ap.add_argument("--stagger", type=float, default=0.25, help="sustained: seconds between users' first questions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loads = args.loads.split(",")
    if not loads or set(loads) - {"burst", "sustained"}:
        ap.error(f"--loads: burst and/or sustained, not {args.loads!r}")
    if args.duration <= 0 or args.stagger < 0:
        ap.error("--duration must be > 0 and --stagger >= 0")
    sys.path.insert(0, ROOT)
    from dllama.registry import resolve_model

    model = resolve_model(args.model)
    servers = args.servers.split(",")
    if "llama-server" in servers:  # built once (the script returns at once after that)
        subprocess.run(["sh", os.path.join(HERE, "build_llama_server.sh")], check=True)
    clients = [int(c) for c in args.clients.split(",")]
    by_round: dict[tuple[str, str, int], dict[int, dict]] = {}  # (load, server, clients) -> round -> figures
    failures: dict[tuple[str, int], str] = {}
    for round_ in range(args.rounds):  # interleaved: a shared machine's slow spells hit every server alike
        for n in clients:
            for kind in servers:
                try:
                    figures = asyncio.run(measure(kind, model, args.threads, n, args.max_tokens, loads,
                                                  args.duration, args.stagger))
                except (aiohttp.ClientError, OSError, RuntimeError) as e:  # a server that fell: say so, go on
                    failures.setdefault((kind, n), f"{type(e).__name__}: {e}")
                    print(f"  {kind} x{n}: failed: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                for load, run in figures.items():
                    by_round.setdefault((load, kind, n), {})[round_] = run
                    print(f"  {kind} x{n} {load}: {run}", file=sys.stderr)
    figures = {key: median_of(list(value.values())) for key, value in by_round.items()}
    if args.json:
        print(json.dumps({f"{load}:{k}x{n}": v for (load, k, n), v in figures.items()}, indent=1))
        return
    load_average = os.getloadavg()[0]
    print(f"model {os.path.basename(model)}, max_tokens {args.max_tokens}, greedy, {args.threads} thread(s) "
          f"(ours-3: 1 per node), medians of {args.rounds} round(s), load average {load_average:.1f}")
    for load in loads:
        print(f"\n{load}" + (f" ({args.duration:g} s once all users ask, {args.stagger:g} s apart)"
                             if load == "sustained" else " (all clients at once, one question each)"))
        print("| server | clients | aggregate tok/s | per-stream tok/s | TTFT p50 ms | TTFT p95 ms | requests | "
              "aggregate vs llama-server |")
        print("|---|---|---|---|---|---|---|---|")
        for n in clients:
            anchor = figures.get((load, "llama-server", n))
            for kind in servers:
                if (load, kind, n) not in figures:
                    print(f"| {kind} | {n} | failed: {failures.get((kind, n), '?')} | | | | | |")
                    continue
                f = figures[(load, kind, n)]
                ratio = f"{f['aggregate_tps'] / anchor['aggregate_tps']:.2f}x" \
                    if anchor and kind not in ("llama-server", NO_HTTP) else ""
                print(f"| {kind} | {n} | {f['aggregate_tps']:.1f} | {f['stream_tps']:.1f} | {f['ttft_p50_ms']:.0f} | "
                      f"{f['ttft_p95_ms']:.0f} | {f['requests']:.0f} | {ratio} |")
        for kind in servers:
            if (load, kind, 1) in figures and (load, kind, 8) in figures:
                one, eight = figures[(load, kind, 1)], figures[(load, kind, 8)]
                # each round's own ratio too: its 1- and 8-client runs are minutes apart, not rounds apart
                ones, eights = by_round[(load, kind, 1)], by_round[(load, kind, 8)]
                each = ", ".join(f"{eights[r]['aggregate_tps'] / ones[r]['aggregate_tps']:.2f}x"
                                 for r in sorted(ones.keys() & eights.keys()))
                print(f"{load}, {kind}: aggregate at 8 clients / 1 client = "
                      f"{eight['aggregate_tps'] / one['aggregate_tps']:.2f}x (rounds: {each}); "
                      f"TTFT p95 at 8 / at 1 = {eight['ttft_p95_ms'] / one['ttft_p95_ms']:.2f}x")
        print_steps(load, figures, servers, clients)


def print_steps(load: str, figures: dict, servers: list[str], clients: list[int]) -> None:
    """The second table: where ours' engine time went (step_figures), and the 8 / 1 ratio split."""
    ours = [kind for kind in servers if kind != "llama-server"]
    if not any("decode_share" in figures.get((load, kind, n), {}) for kind in ours for n in clients):
        return
    print(f"\n{load}, where ours' time went (share of the time in steps of each kind; a decode step: "
          f"sequences, ms, and the engine's decode tok/s)")
    print("| server | clients | decode | prompt | mixed | idle | sequences a decode step | ms a decode step | "
          "decode tok/s | tokens a prompt step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in clients:
        for kind in ours:
            f = figures.get((load, kind, n), {})
            if "decode_share" in f:
                print(f"| {kind} | {n} | {f['decode_share']:.0%} | {f['prompt_share']:.0%} | {f['mixed_share']:.0%} | "
                      f"{f['idle_share']:.0%} | {f['decode_batch']:.2f} | {f['decode_step_ms']:.2f} | "
                      f"{f['decode_rate_tps']:.0f} | {f['prompt_step_tokens']:.1f} |")
    for kind in ours:
        one, eight = figures.get((load, kind, 1), {}), figures.get((load, kind, 8), {})
        if one.get("decode_rate_tps") and eight.get("decode_rate_tps") and one.get("decode_share"):
            print(f"{load}, {kind}, 8 clients / 1: the engine's decode tok/s "
                  f"{eight['decode_rate_tps'] / one['decode_rate_tps']:.2f}x (a step of "
                  f"{eight['decode_batch']:.2f} sequences {eight['decode_step_ms']:.2f} ms, of 1 "
                  f"{one['decode_step_ms']:.2f} ms) x the decode steps' share of the time "
                  f"{eight['decode_share'] / one['decode_share']:.2f}x ({one['decode_share']:.0%} -> "
                  f"{eight['decode_share']:.0%})")


if __name__ == "__main__":
    main()
