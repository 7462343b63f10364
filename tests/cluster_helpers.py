"""Helpers for the cluster tests: worker daemons inside the test's event loop (real sockets, the
real protocol, compute serialized in one process), worker daemons as real processes, and the
1-node references the cluster must reproduce."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from dllama.cluster.root import ClusterEngine
from dllama.cluster.worker import Worker

DLLAMA = [sys.executable, "-m", "dllama"]


@contextlib.asynccontextmanager
async def in_process_cluster(model, n_workers: int, *, algo: str = "ring", sync_dtype: str = "f64",
                             sync_mode: str = "reduce", ctx: int = 256, weights=None, secret=None, cache_dirs=None,
                             timeout: float = 20.0):
    """A root (ClusterEngine) and n worker daemons, all in this event loop, over loopback TCP."""
    workers = [Worker(secret=secret, cache_dir=None if cache_dirs is None else cache_dirs[i], timeout=timeout)
               for i in range(n_workers)]
    try:
        addrs = [await w.start("127.0.0.1", 0) for w in workers]
        engine = await ClusterEngine(model, ctx, addrs, algo=algo, sync_dtype=sync_dtype, sync_mode=sync_mode,
                                     weights=weights, secret=secret, timeout=timeout, spin=0.0, progress=False).start()
        try:
            yield engine, workers
        finally:
            await engine.close()
    finally:
        for w in workers:
            await w.close()


class WorkerProcess:
    """`dllama worker` as a real process on a free loopback port."""

    def __init__(self, *args: str, threads: int = 1, env: dict | None = None):
        cmd = DLLAMA + ["worker", "--host", "127.0.0.1", "--port", "0", "--threads", str(threads), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"worker did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.port = int(line.rsplit(":", 1)[1])
        self.address = f"127.0.0.1:{self.port}"

    def kill(self, sig=signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> str:
        """Stop the worker; returns its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            _out, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _out, err = self.proc.communicate()
        return err


def run_dllama(*args: str, timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(DLLAMA + list(args), capture_output=True, text=True, timeout=timeout, input=input)
