"""Soak: thousands of mixed requests against `dllama serve` with two `dllama worker` daemons (root
+ 2 workers on loopback), then, once idle, whether everything came back: every process's RSS
within --rss-margin MB of its value after the warm-up, its open file descriptors back to their
count, no KV cache held by a request, no request running or waiting, and a greedy answer unchanged.

The mix, in equal parts (each client, from an address of its own in 127/8, sends one request after
the other): a chat answer, a stream read to its end, a stream the client hangs up on after two
events, a chat with stop strings, a long prompt, an invalid request (400 expected), a client that
vanishes before its request is whole or right after sending it, and a sampled completion (top-p,
seed). Any status other than the expected one is counted, printed, and fails the run.

    python benchmarks/soak.py [--model smollm2|PATH] [--requests 2000] [--clients 8] [--seed 0]

tests/test_soak.py runs it at a smaller count in the suite.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from dllama.node import rss_mb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DLLAMA = [sys.executable, "-m", "dllama"]
CTX = 512
KINDS = ("chat", "stream", "cancel", "stop", "long", "invalid", "vanish", "sampled")
EXPECTED = {"chat": 200, "stream": 200, "cancel": "hung up", "stop": 200, "long": 200, "invalid": 400,
            "vanish": "vanished", "sampled": 200}
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.",
             "What do bees make?", "Say hello in five languages.", "Explain what rain is.",
             "Why is the sky blue?", "Describe a cat to a child."]
LONG_PROMPT = ("The lighthouse keeper climbed the stairs every evening to light the lamp, and every "
               "morning he wrote in his log what the sea had done in the night. ") * 12
INVALID = [b'{"messages": [{"role": "user", "content": "hi"}', b'{"messages": []}',
           b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
           b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
           b'{"messages": [{"role": "user", "content": "hi"}], "top_p": "high"}',
           b'{"prompt": "hi", "repeat_penalty": 1e-308}', b'{"prompt": "hi", "n": 2}', b'[1, 2, 3]']
GREEDY_CHECK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0}


# ------------------------------------------------------------------ processes


class Cluster:
    """Two workers and a root serving on loopback, their logs in `folder` (a temporary one by
    default); stop() ends them."""

    def __init__(self, model: str, threads: int = 1, extra: tuple[str, ...] = (), folder: str | None = None):
        self.folder = folder or tempfile.mkdtemp(prefix="dllama-soak-")
        self.workers = [self._worker(threads, os.path.join(self.folder, f"worker{i + 1}.log")) for i in range(2)]
        addresses = ",".join(f"127.0.0.1:{port}" for _proc, port in self.workers)
        self.log = open(os.path.join(self.folder, "root.log"), "w")
        self.port = _free_port()
        self.root = subprocess.Popen(DLLAMA + ["serve", "--model", model, "--port", str(self.port), "--workers",
                                               addresses, "--ctx-size", str(CTX), "--threads", str(threads), *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        self.url = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while not self._ready():
            if self.root.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("dllama serve did not become ready")
            time.sleep(0.2)

    @staticmethod
    def _worker(threads: int, log: str) -> tuple[subprocess.Popen, int]:
        with open(log, "w") as err:
            proc = subprocess.Popen(DLLAMA + ["worker", "--host", "127.0.0.1", "--port", "0", "--threads",
                                              str(threads)], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            proc.kill()
            raise RuntimeError(f"the worker did not start: {line!r}")
        return proc, int(line.rsplit(":", 1)[1])

    def _ready(self) -> bool:
        try:
            return request(self.url, "GET", "/health")[0] == 200
        except OSError:
            return False

    def tracebacks(self) -> int:
        """Tracebacks in the logs so far: none is the rule (a bad request is one line)."""
        count = 0
        for name in os.listdir(self.folder):
            with open(os.path.join(self.folder, name), errors="replace") as f:
                count += f.read().count("Traceback")
        return count

    @property
    def pids(self) -> dict[str, int]:
        return {"root": self.root.pid, **{f"worker {i + 1}": p.pid for i, (p, _port) in enumerate(self.workers)}}

    def stop(self) -> None:
        for proc in [self.root] + [p for p, _port in self.workers]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [self.root] + [p for p, _port in self.workers]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ------------------------------------------------------------------ clients


def request(url: str, method: str, path: str, body: bytes | None = None, source: str | None = None,
            timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(url, timeout=timeout, source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics (enough for the gauges the soak checks)."""
    _status, text = request(url, "GET", "/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _stream(url: str, body: dict, source: str, hang_up_after: int | None) -> str | int:
    conn = http.client.HTTPConnection(url, timeout=300, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status
        events = 0
        while line := resp.readline():
            if line.startswith(b"data: "):
                events += 1
                if line.strip() == b"data: [DONE]":
                    return 200
                if b'"error"' in line:
                    return "error event"
                if hang_up_after is not None and events >= hang_up_after:
                    conn.sock.close()  # what a client that leaves does: no more reads, FIN
                    return "hung up"
        return "no [DONE]"
    finally:
        conn.close()


def _vanish(url: str, source: str, rng: random.Random) -> str:
    host, port = url.rsplit(":", 1)
    body = json.dumps({"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 64}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection((host, int(port)), source_address=(source, 0)) as sock:
        whole = rng.random() < 0.5  # the whole request, then gone; or gone before the body is complete
        sock.sendall(head + (body if whole else body[:len(body) // 2]))
    return "vanished"


def one(url: str, kind: str, source: str, rng: random.Random) -> str | int:
    question = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    if kind == "chat":
        return request(url, "POST", "/v1/chat/completions", json.dumps(
            {"messages": question, "max_tokens": rng.randint(1, 16), "temperature": 0}).encode(), source)[0]
    if kind == "stream":
        return _stream(url, {"messages": question, "max_tokens": rng.randint(1, 16), "temperature": 0}, source, None)
    if kind == "cancel":
        return _stream(url, {"messages": question, "max_tokens": 200, "temperature": 0}, source, 2)
    if kind == "stop":
        return request(url, "POST", "/v1/chat/completions", json.dumps(
            {"messages": question, "max_tokens": 24, "temperature": 0, "stop": [" the", "."]}).encode(), source)[0]
    if kind == "long":
        return request(url, "POST", "/v1/completions", json.dumps(
            {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}).encode(), source)[0]
    if kind == "invalid":
        return request(url, "POST", "/v1/chat/completions", rng.choice(INVALID), source)[0]
    if kind == "vanish":
        return _vanish(url, source, rng)
    if kind == "sampled":
        return request(url, "POST", "/v1/completions", json.dumps(
            {"prompt": rng.choice(QUESTIONS), "max_tokens": rng.randint(1, 12), "temperature": 0.8, "top_p": 0.9,
             "seed": rng.randrange(1 << 30)}).encode(), source)[0]
    raise ValueError(kind)


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome)
    unexpected: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unexpected


def run_mix(url: str, n: int, clients: int, seed: int) -> Outcomes:
    """n requests of the mix from `clients` clients (127.0.0.10, .11, ...), one after another each."""
    out, lock = Outcomes(), threading.Lock()
    jobs = [KINDS[i % len(KINDS)] for i in range(n)]
    random.Random(seed).shuffle(jobs)

    def client(k: int) -> None:
        rng, source = random.Random(seed * 1000 + k), f"127.0.0.{10 + k}"
        for kind in jobs[k::clients]:
            try:
                got = one(url, kind, source, rng)
            except Exception as e:  # a reset, a timeout: counted, never raised
                got = f"{type(e).__name__}: {e}"
            with lock:
                out.counts[kind, got] += 1
                if got != EXPECTED[kind]:
                    out.unexpected.append((kind, got))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def wait_idle(url: str, pids: dict[str, int], fds_before: dict[str, int], timeout: float = 60) -> dict[str, float]:
    """Until nothing runs, waits or holds KV cache, and the fds are back (or timeout): /metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["dllama_requests_running"] == 0 and m["dllama_queue_length"] == 0
                and m["dllama_kv_cache_in_use_tokens"] == 0 and m["dllama_http_connections"] <= 1)
        if idle and all(open_fds(pid) <= fds_before[name] for name, pid in pids.items()):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.25)


@dataclass
class SoakResult:
    requests: int
    seconds: float
    outcomes: Outcomes
    rss_warm: dict[str, float]
    rss_after: dict[str, float]
    fds_warm: dict[str, int]
    fds_after: dict[str, int]
    idle_metrics: dict[str, float]
    greedy_before: str
    greedy_after: str
    tracebacks: int
    logs: str

    def problems(self, rss_margin: float) -> list[str]:
        found = [f"{len(self.outcomes.unexpected)} unexpected outcomes: {Counter(self.outcomes.unexpected)}"] \
            if self.outcomes.unexpected else []
        for name in self.rss_warm:
            if self.rss_after[name] - self.rss_warm[name] > rss_margin:
                found.append(f"{name}: RSS {self.rss_warm[name]:.0f} -> {self.rss_after[name]:.0f} MB")
            if self.fds_after[name] > self.fds_warm[name]:
                found.append(f"{name}: {self.fds_warm[name]} -> {self.fds_after[name]} open fds")
        m = self.idle_metrics
        for gauge in ("dllama_requests_running", "dllama_queue_length", "dllama_kv_cache_in_use_tokens"):
            if m[gauge]:
                found.append(f"{gauge} {m[gauge]:g} once idle")
        if self.tracebacks:
            found.append(f"{self.tracebacks} tracebacks in the logs ({self.logs})")
        if self.greedy_after != self.greedy_before:
            found.append(f"the greedy answer changed: {self.greedy_before!r} -> {self.greedy_after!r}")
        return found

    def table(self, rss_margin: float) -> str:
        lines = [f"soak: {self.requests} requests in {self.seconds:.0f} s "
                 f"({self.requests / self.seconds:.1f}/s), root + 2 workers on loopback", "",
                 "| kind | outcomes |", "|---|---|"]
        for kind in KINDS:
            got = {o: c for (k, o), c in sorted(self.outcomes.counts.items(), key=str) if k == kind}
            lines.append(f"| {kind} | {', '.join(f'{o}: {c}' for o, c in got.items())} |")
        lines += ["", "| process | RSS after warm-up (MB) | RSS once idle (MB) | change | fds after warm-up | fds once idle |",
                  "|---|---|---|---|---|---|"]
        for name in self.rss_warm:
            lines.append(f"| {name} | {self.rss_warm[name]:.1f} | {self.rss_after[name]:.1f} | "
                         f"{self.rss_after[name] - self.rss_warm[name]:+.1f} | {self.fds_warm[name]} | "
                         f"{self.fds_after[name]} |")
        m = self.idle_metrics
        lines += ["", f"once idle: {m['dllama_requests_running']:g} running, {m['dllama_queue_length']:g} waiting, "
                      f"{m['dllama_kv_cache_in_use_tokens']:g} KV positions held by requests "
                      f"({m['dllama_kv_cache_reserved_tokens']:g} by idle slots kept for reuse); greedy answer "
                      f"{'unchanged' if self.greedy_after == self.greedy_before else 'CHANGED'}; "
                      f"{self.tracebacks} tracebacks in the logs"]
        problems = self.problems(rss_margin)
        lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
        return "\n".join(lines)


def greedy_answer(url: str) -> str:
    status, body = request(url, "POST", "/v1/chat/completions", json.dumps(GREEDY_CHECK).encode())
    if status != 200:
        raise RuntimeError(f"the greedy check got {status}: {body[:200]!r}")
    return json.loads(body)["choices"][0]["message"]["content"]


def soak(cluster: Cluster, n: int, clients: int, seed: int, warm_up: int | None = None) -> SoakResult:
    url, pids = cluster.url, cluster.pids
    warm = run_mix(cluster.url, warm_up or 2 * clients * len(KINDS) // 2, clients, seed + 1)
    if not warm.ok:
        raise RuntimeError(f"the warm-up had unexpected outcomes: {Counter(warm.unexpected)} (logs: {cluster.folder})")
    greedy_before = greedy_answer(url)
    fds_warm = {name: open_fds(pid) for name, pid in pids.items()}
    wait_idle(url, pids, fds_warm)
    rss_warm = {name: rss_mb(pid) for name, pid in pids.items()}
    fds_warm = {name: open_fds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    outcomes = run_mix(url, n, clients, seed)
    seconds = time.monotonic() - t0
    idle = wait_idle(url, pids, fds_warm)
    return SoakResult(n, seconds, outcomes, rss_warm, {name: rss_mb(pid) for name, pid in pids.items()},
                      fds_warm, {name: open_fds(pid) for name, pid in pids.items()}, idle, greedy_before,
                      greedy_answer(url), cluster.tracebacks(), cluster.folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-margin", type=float, default=50.0, help="MB (default 50)")
    args = parser.parse_args()
    from dllama.registry import resolve_model

    cluster = Cluster(resolve_model(args.model))
    try:
        result = soak(cluster, args.requests, args.clients, args.seed)
    finally:
        cluster.stop()
    print(result.table(args.rss_margin))
    sys.exit(0 if not result.problems(args.rss_margin) else 1)


if __name__ == "__main__":
    main()
