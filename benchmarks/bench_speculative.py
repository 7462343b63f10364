"""Speculative decoding: dllama serve with --speculate off / ngram / auto / draft, next to
llama.cpp's llama-server with and without its own n-gram speculation (--spec-type ngram-simple),
same GGUF, same threads, same prompts, in one run.

Tasks where drafts should hit (answer from a given document by quoting it, rewrite given code with
one change, copy a list) and free chat. Every request is greedy, through the OpenAI chat API, not
streamed; each prompt is asked once before it is timed, so both servers time a cached prompt and
the answer's decoding. tok/s = completion tokens / the request's wall time (the median of --rounds).

Setups:
- 1 node: ours with --threads, llama-server with -t (ours loads the model a second time as its own
  draft: `draft` is then the upper bound of acceptance, not of speed: the draft costs a full model).
- 3 nodes, LAN links: ours, root + 2 `dllama worker`s (1 thread each), every link to a worker through
  tests/lan_relay.py with --latency-ms one way (0.5: Ethernet); llama.cpp has no cluster here.
- 8 clients, 1 node: 8 requests at once (2 of each grounded task), aggregate tok/s; llama-server
  with -np 8.

    python benchmarks/bench_speculative.py [--model smollm2|PATH] [--tokens 96] [--threads 2]
                                           [--latency-ms 0.5] [--rounds 2] [--setups one,cluster,busy]
                                           [--no-llama-server]

Every answer is checked: each mode's text must be `off`'s (ours), else the run stops.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench_serve import LLAMA_SERVER, Server, free_port  # noqa: E402
from tests.lan_relay import RelayThread  # noqa: E402

DOCUMENT = ("The lighthouse at Port Ellen was built in 1832 by the engineer Robert Stevenson. Its light could be "
            "seen from twenty-two miles away on a clear night. In 1910 the keeper's cottage was extended with a "
            "second floor, and in 1958 the lamp was replaced by an electric one. The lighthouse was automated in "
            "1998, and the last keeper, Mary Campbell, left the island that year. Today the cottage is a small "
            "museum that opens from April to September.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total * (1 + tax_rate)
    return round(total, 2)
'''
TASKS = {
    "document": f"Read this text:\n\n{DOCUMENT}\n\nCopy the sentences of the text that mention a year, word for word.",
    "code": f"Here is a Python function:\n\n{CODE}\nRewrite it with the variable `total` renamed to `amount`. "
            "Give only the code.",
    "list": "Copy this list exactly:\n1. red apples\n2. green pears\n3. yellow bananas\n4. purple plums\n"
            "5. orange peaches\n6. blue berries\n7. white grapes",
    "free chat": "Tell me a short story about a dragon who is afraid of the dark.",
}
GROUNDED = ["document", "code", "list"]
MODES = ["off", "ngram", "auto", "draft"]


class Process(Server):
    """A server (or a worker) of this benchmark's own command line, started and stopped as bench_serve's."""

    def __init__(self, name: str, cmd: list[str], port: int):
        self.kind, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")  # (a file: a pipe nobody reads could fill up)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, cwd=ROOT)


async def ask(http, url: str, task: str, tokens: int, extra: dict) -> tuple[str, int, float]:
    body = {"messages": [{"role": "user", "content": TASKS[task]}], "max_tokens": tokens, "temperature": 0,
            **extra}
    t0 = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {answer}")
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], \
        time.perf_counter() - t0


async def metrics(http, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("dllama_speculative_")}


async def one_at_a_time(url: str, modes: list[str], tokens: int, rounds: int, ours: bool) -> dict:
    """{(task, mode): (tok/s, drafts kept share or None, text)} for each task alone."""
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        for task in TASKS:
            runs = {mode: [] for mode in modes}
            kept = {mode: [0, 0] for mode in modes}  # drafted, accepted
            for mode in modes:  # the prompt cached, as for every mode
                await ask(http, url, task, tokens, {"speculate": mode} if ours else {})
            for _ in range(rounds):  # the modes interleaved: a shared machine's noise falls on each alike
                for mode in modes:
                    before = await metrics(http, url) if ours else {}
                    runs[mode].append(await ask(http, url, task, tokens, {"speculate": mode} if ours else {}))
                    after = await metrics(http, url) if ours else {}
                    for i, name in enumerate(("drafted", "accepted")):
                        key = f"dllama_speculative_{name}_tokens_total"
                        kept[mode][i] += after.get(key, 0) - before.get(key, 0)
            for mode in modes:
                drafted, accepted = kept[mode]
                out[task, mode] = (statistics.median(n / s for _, n, s in runs[mode]),
                                   accepted / drafted if drafted else None, runs[mode][0][0])
    return out


async def all_at_once(url: str, modes: list[str], tokens: int, rounds: int, ours: bool) -> dict:
    """{mode: aggregate tok/s} of 8 requests at once (each grounded task, and free chat twice)."""
    tasks = (GROUNDED + ["free chat"]) * 2
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        for mode in modes:
            extra = {"speculate": mode} if ours else {}
            await asyncio.gather(*(ask(http, url, t, tokens, extra) for t in tasks))
            figures = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(ask(http, url, t, tokens, extra) for t in tasks))
                figures.append(sum(n for _, n, _ in answers) / (time.perf_counter() - t0))
            out[mode] = statistics.median(figures)
    return out


def ours_server(model: str, threads: int, slots: int, workers: list[str] = ()) -> Process:
    port = free_port()
    cmd = [sys.executable, "-m", "dllama", "serve", "--model", model, "--port", str(port), "--ctx-size", "1024",
           "--max-batch", str(slots), "--max-requests-per-client", str(slots), "--speculate", f"draft:{model}",
           "--threads", str(threads)]
    if workers:
        cmd += ["--workers", ",".join(workers)]
    return Process("dllama serve", cmd, port)


def llama_server(model_path: str, threads: int, slots: int, speculate: bool) -> Process:
    port = free_port()
    cmd = [LLAMA_SERVER, "-m", model_path, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(1024 * slots), "--port", str(port), "--host", "127.0.0.1", "--no-webui"]
    if speculate:
        cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"]
    return Process("llama-server", cmd, port)


async def run_server(make, work):
    server = make()
    try:
        await server.ready(600)
        return await work(server.url)
    finally:
        server.stop()


def check_same_text(results: dict, modes: list[str]) -> None:
    for task in TASKS:
        for mode in modes[1:]:
            if results[task, mode][2] != results[task, "off"][2]:
                sys.exit(f"error: {task}: speculate {mode} answered differently from off")


def print_table(title: str, ours: dict, modes: list[str], anchor: dict | None) -> None:
    print(f"\n{title}")
    head = f"{'task':<10}" + "".join(f"{m:>17}" for m in modes)
    if anchor:
        head += f"{'llama.cpp off':>15}{'llama.cpp ngram':>17}"
    print(head)
    for task in TASKS:
        base = ours[task, "off"][0]
        row = f"{task:<10}"
        for mode in modes:
            tps, kept, _ = ours[task, mode]
            share = f" {kept:.0%}" if kept is not None else ""
            row += f"{tps:>8.1f} {tps / base:>4.2f}x{share:>4}" if mode != "off" else f"{tps:>12.1f} tok/s"
        if anchor:
            off, ngram = anchor[task, "off"][0], anchor[task, "ngram"][0]
            row += f"{off:>15.1f}{ngram:>9.1f} {ngram / off:.2f}x"
        print(row)
    print("(each mode: tok/s, its ratio to off, the share of drafts kept)")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setups", default="one,cluster,busy")
    ap.add_argument("--no-llama-server", action="store_true")
    args = ap.parse_args()
    from dllama.registry import resolve_model

    model_path = resolve_model(args.model)
    setups = args.setups.split(",")
    with_llama = not args.no_llama_server
    if with_llama and not os.path.exists(LLAMA_SERVER):
        subprocess.run(["sh", os.path.join(HERE, "build_llama_server.sh")], check=True)
    n = args.tokens
    print(f"model {os.path.basename(model_path)}, {n} tokens a request, greedy; {os.cpu_count()} cores")

    if "one" in setups:
        ours = await run_server(lambda: ours_server(model_path, args.threads, 1),
                                lambda url: one_at_a_time(url, MODES, n, args.rounds, True))
        check_same_text(ours, MODES)
        anchor = None
        if with_llama:
            anchor = {}
            for spec, mode in ((False, "off"), (True, "ngram")):
                got = await run_server(lambda spec=spec: llama_server(model_path, args.threads, 1, spec),
                                       lambda url: one_at_a_time(url, ["off"], n, args.rounds, False))
                anchor.update({(task, mode): v for (task, _), v in got.items()})
        print_table(f"1 node, {args.threads} threads", ours, MODES, anchor)

    if "cluster" in setups:
        workers = [Process(f"worker {i}", [sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1",
                                           "--port", str(port), "--threads", "1"], port)
                   for i, port in enumerate((free_port(), free_port()))]
        ports = [w.port for w in workers]
        time.sleep(3)  # (the root tries a few times, too)
        for w in workers:
            if w.proc.poll() is not None:
                sys.exit(f"error: {w.kind} exited: {w.log_tail()}")
        try:
            with RelayThread([("127.0.0.1", p) for p in ports], one_way_s=args.latency_ms / 1e3) as relays:
                ours = await run_server(lambda: ours_server(model_path, 1, 1, relays.addresses),
                                        lambda url: one_at_a_time(url, MODES, n, args.rounds, True))
        finally:
            for w in workers:
                w.stop()
        check_same_text(ours, MODES)
        print_table(f"3 nodes (root + 2 workers, 1 thread each), links {args.latency_ms} ms one way", ours,
                    MODES, None)

    if "busy" in setups:
        modes = ["off", "ngram", "auto"]
        ours = await run_server(lambda: ours_server(model_path, args.threads, 8),
                                lambda url: all_at_once(url, modes, n, args.rounds, True))
        line = "8 clients at once, 1 node: aggregate tok/s " + ", ".join(
            f"{m} {ours[m]:.1f} ({ours[m] / ours['off']:.2f}x)" for m in modes)
        if with_llama:
            anchor = {}
            for spec, mode in ((False, "off"), (True, "ngram")):
                anchor[mode] = (await run_server(lambda spec=spec: llama_server(model_path, args.threads, 8, spec),
                                                 lambda url: all_at_once(url, ["off"], n, args.rounds, False)))["off"]
            line += f"; llama.cpp off {anchor['off']:.1f}, ngram {anchor['ngram']:.1f} " \
                    f"({anchor['ngram'] / anchor['off']:.2f}x)"
        print("\n" + line)


if __name__ == "__main__":
    asyncio.run(main())
