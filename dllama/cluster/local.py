"""`--local-workers N`: worker processes on this machine, started for one run and stopped after."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time

from ..errors import DllamaError

START_TIMEOUT = 120.0  # importing numpy/numba on a slow machine takes a while


class LocalWorkers:
    def __init__(self, n: int, threads: int | None, secret: str | None, timeout: float):
        self.n, self.threads, self.secret, self.timeout = n, threads, secret, timeout
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[tuple[str, int]] = []

    def start(self) -> list[tuple[str, int]]:
        env = dict(os.environ)
        if self.secret:
            env["DLLAMA_SECRET"] = self.secret
        cmd = [sys.executable, "-m", "dllama", "worker", "--host", "127.0.0.1", "--port", "0", "--no-cache",
               "--timeout", str(self.timeout), "--quiet"]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True))
            deadline = time.monotonic() + START_TIMEOUT
            for i, proc in enumerate(self.procs):
                line = _read_line(proc, deadline)  # "listening on HOST:PORT", once the port is open
                if not line.startswith("listening on "):
                    raise DllamaError(f"local worker {i + 1} did not start (exit code {proc.poll()})")
                host, port = line.split()[-1].rsplit(":", 1)
                self.addresses.append((host, int(port)))
        except BaseException:
            self.stop()
            raise
        return self.addresses

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The first line a worker prints, or "" if it prints none before the deadline."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(max(deadline - time.monotonic(), 0)):
            return ""
    return proc.stdout.readline()
