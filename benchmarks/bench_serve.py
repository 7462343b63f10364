"""Serving many users at once: dllama serve (continuous batching) next to llama.cpp's llama-server
(-np N, continuous batching, a KV cache slot per client), same GGUF, same threads, in one run.

For each server and each concurrency N: the server is started for N clients (ours --max-batch N,
llama-server -np N, each slot the same context), warmed up, then N streaming clients (aiohttp,
the OpenAI chat API, stream with usage) ask N fixed different questions at once, greedy, with a
fixed max_tokens. Figures per run: aggregate generated tokens/s (all tokens / wall time from the
first request to the last answer), per-stream decode tokens/s (median over clients, after each
one's first token), time to first token p50 / p95. Several rounds; the table shows medians.

    python benchmarks/bench_serve.py [--model smollm2|PATH] [--clients 1,4,8,16] [--max-tokens 64]
                                     [--threads 2] [--servers ours,ours-3,llama-server] [--rounds 2]

ours: one node with --threads; ours-3: root + 2 local workers (one thread each: the machine's cores
are shared by three processes); llama-server: built by benchmarks/build_llama_server.sh from the
llama.cpp sources in the llama-cpp-python sdist that pyproject.toml pins (the script runs it if the
binary is missing). The machine may be shared: compare figures of the same run.
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

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LLAMA_SERVER = os.path.join(HERE, ".llama-server", "bin", "llama-server")
CTX_PER_SLOT = 512

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
                   "--max-batch", str(slots), "--ctx-size", str(CTX_PER_SLOT), "--max-queue", "64"]
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
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first = None
    pieces = 0
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
                    pieces += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else pieces
    first = end if first is None else first
    return {"ttft": first - t0, "tokens": tokens, "decode_tps": (tokens - 1) / (end - first) if end > first else 0.0,
            "end": end}


async def run_clients(url: str, n: int, max_tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
        await one_stream(http, url, "Hello", 4, time.perf_counter())  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(http, url, QUESTIONS[i % len(QUESTIONS)], max_tokens, t0)
                                         for i in range(n)))
    wall = max(r["end"] for r in results) - t0
    ttfts = sorted(r["ttft"] for r in results)
    return {"aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "stream_tps": statistics.median(r["decode_tps"] for r in results),
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p95_ms": 1e3 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "tokens": sum(r["tokens"] for r in results)}


async def measure(kind: str, model: str, threads: int, n: int, max_tokens: int) -> dict:
    server = Server(kind, model, threads, n)
    try:
        await server.ready()
        return await run_clients(server.url, n, max_tokens)
    except aiohttp.ClientError as e:
        raise RuntimeError(f"{type(e).__name__}: {e}; the server's log ends: {server.log_tail()[-400:]!r}") from e
    finally:
        server.stop()


# ------------------------------------------------------------------ the table


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--servers", default="ours,ours-3,llama-server")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from dllama.registry import resolve_model

    model = resolve_model(args.model)
    servers = args.servers.split(",")
    if "llama-server" in servers and not os.path.exists(LLAMA_SERVER):
        subprocess.run(["sh", os.path.join(HERE, "build_llama_server.sh")], check=True)
    clients = [int(c) for c in args.clients.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {}
    failures: dict[tuple[str, int], str] = {}
    for _ in range(args.rounds):  # interleaved: a shared machine's slow spells hit every server alike
        for n in clients:
            for kind in servers:
                try:
                    run = asyncio.run(measure(kind, model, args.threads, n, args.max_tokens))
                except (aiohttp.ClientError, OSError, RuntimeError) as e:  # a server that fell: say so, go on
                    failures.setdefault((kind, n), f"{type(e).__name__}: {e}")
                    print(f"  {kind} x{n}: failed: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                runs.setdefault((kind, n), []).append(run)
                print(f"  {kind} x{n}: {run}", file=sys.stderr)
    figures = {key: median_of(value) for key, value in runs.items()}
    if args.json:
        print(json.dumps({f"{k}x{n}": v for (k, n), v in figures.items()}, indent=1))
        return
    load = os.getloadavg()[0]
    print(f"model {os.path.basename(model)}, max_tokens {args.max_tokens}, greedy, {args.threads} thread(s) "
          f"(ours-3: 1 per node), medians of {args.rounds} round(s), load average {load:.1f}")
    print("| server | clients | aggregate tok/s | per-stream tok/s | TTFT p50 ms | TTFT p95 ms | aggregate vs "
          "llama-server |")
    print("|---|---|---|---|---|---|---|")
    for n in clients:
        anchor = figures.get(("llama-server", n))
        for kind in servers:
            if (kind, n) not in figures:
                print(f"| {kind} | {n} | failed: {failures[(kind, n)]} | | | | |")
                continue
            f = figures[(kind, n)]
            ratio = f"{f['aggregate_tps'] / anchor['aggregate_tps']:.2f}x" if anchor and kind != "llama-server" else ""
            print(f"| {kind} | {n} | {f['aggregate_tps']:.1f} | {f['stream_tps']:.1f} | {f['ttft_p50_ms']:.0f} | "
                  f"{f['ttft_p95_ms']:.0f} | {ratio} |")
    for kind in servers:
        if (kind, 1) in figures and (kind, 8) in figures:
            one, eight = figures[(kind, 1)], figures[(kind, 8)]
            print(f"{kind}: aggregate at 8 clients / 1 client = {eight['aggregate_tps'] / one['aggregate_tps']:.2f}x; "
                  f"TTFT p95 at 8 / at 1 = {eight['ttft_p95_ms'] / one['ttft_p95_ms']:.2f}x")


if __name__ == "__main__":
    main()
