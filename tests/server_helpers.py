"""Helpers for the API server tests: the server's event loop in a thread (so tests drive it over
real sockets with ordinary blocking clients), raw SSE reading, Prometheus parsing."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from dllama.net.loop import new_event_loop
from dllama.server import bound_port, start_server


class ServerThread:
    """An event loop on its own thread that hosts the runtime and any number of apps."""

    def __init__(self):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="api-server", daemon=True)
        self.thread.start()
        self.runners = []

    def run(self, coro, timeout: float | None = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app) -> str:
        """Serve app on a free loopback port; returns its base URL."""
        runner = self.run(start_server(app, "127.0.0.1", 0, access_log=False))
        self.runners.append(runner)
        return f"http://127.0.0.1:{bound_port(runner)}"

    @contextlib.contextmanager
    def holding(self, engine):
        """Hold the engine's forward steps until the block ends (as if a long one ran), letting
        through as many as the test says (`gate.allow(n)`): requests are admitted into slots
        between steps, then wait in the step."""
        gate = self.run(_make_gate(self.loop))
        step = engine.step

        async def held_step(seqs, preempt=False):
            await gate.wait()
            return await step(seqs, preempt=preempt)

        engine.step = held_step
        try:
            yield gate
        finally:
            gate.allow(None)
            del engine.step

    def close(self, *closers) -> None:
        for runner in self.runners:
            self.run(runner.cleanup())
        for closer in closers:
            self.run(closer())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class StepGate:
    """Lets through `allow(n)` steps (None: all from now on); its counts live on the server's loop."""

    def __init__(self, loop):
        self.loop = loop
        self.allowed = 0
        self.open = False
        self.changed = asyncio.Event()
        self.passed = 0

    def allow(self, n: int | None) -> None:
        def change():
            if n is None:
                self.open = True
            else:
                self.allowed += n
            self.changed.set()
        self.loop.call_soon_threadsafe(change)

    async def wait(self) -> None:
        while not self.open and self.allowed == 0:
            self.changed.clear()
            await self.changed.wait()
        if not self.open:
            self.allowed -= 1
        self.passed += 1


async def _make_gate(loop) -> StepGate:
    return StepGate(loop)


def post(base_url: str, path: str, body: bytes | dict, timeout: float = 120,
         source: str | None = None) -> tuple[int, dict, dict]:
    """POST raw bytes (or a JSON object) without any client-side checks: (status, headers, JSON).
    source: the address to send from (another of 127/8 is another client on loopback)."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=timeout,
                                      source_address=None if source is None else (source, 0))
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def get(base_url: str, path: str, timeout: float = 30) -> tuple[int, str]:
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


class RawStream:
    """A streaming request read event by event, that can hang up at any point."""

    def __init__(self, base_url: str, path: str, body: dict, timeout: float = 120):
        self.conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()

    def events(self):
        """The data of each SSE event ("[DONE]" as a string, the rest parsed)."""
        data = []
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode().rstrip("\r\n")
            if line.startswith("data: "):
                data.append(line[len("data: "):])
            elif line == "" and data:
                text = "\n".join(data)
                data = []
                yield text if text == "[DONE]" else json.loads(text)

    def hang_up(self) -> None:
        self.conn.sock.close()  # what a client that goes away does: no more reads, FIN
        self.conn.close()


def metrics(base_url: str) -> dict:
    """{(name, ((label, value), ...)): value} from /metrics, parsed by prometheus_client."""
    status, text = get(base_url, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[re.Match | None, str]:
    """Read proc's stderr line by line until a line matches (or it ends / time runs out)."""
    seen = []
    found = []

    def reader():
        for line in proc.stderr:
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                found.append(m)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    return (found[0] if found else None), "".join(seen)


def children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def request(base_url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict, str]:
    """Any request with any headers: (status, headers, body text)."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode()
    finally:
        conn.close()


def raw_connect(base_url: str, timeout: float = 30):
    """A plain TCP connection to the server, for clients no HTTP library would be."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_to_close(sock, timeout: float) -> tuple[bytes, bool]:
    """Read until the server closes the connection (FIN or reset): (bytes read, closed in time)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data, True
        except socket.timeout:
            return data, False
        if not chunk:
            return data, True
        data += chunk


@contextlib.contextmanager
def cli_server(*args: str):
    """`dllama serve ARGS --port 0` as a subprocess, once /health says ready: (proc, base URL).
    On leaving, SIGTERM must stop it with exit code 0 and no traceback."""
    cmd = [sys.executable, "-m", "dllama", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={k: v for k, v in os.environ.items() if k != "DLLAMA_DEBUG"})
    try:
        m, log = read_until(proc, r"listening on (http://127\.0\.0\.1:\d+)", 120)
        assert m, log
        url = m.group(1)
        assert wait_until(lambda: get(url, "/health")[0] == 200, 180, interval=0.2), log
        yield proc, url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _m, log = read_until(proc, r"$^", 5)
        assert "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
