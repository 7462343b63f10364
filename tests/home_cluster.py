"""A home cluster in a box, for tests and benchmarks (not the product): a root and workers that behave
like separate small machines on a LAN, on this one machine.

- **Memory**: each node in a memory cgroup of its own (v2 or v1, whichever this machine has, under
  this process's own cgroup) with a limit, as `docker compose` or a systemd `MemoryMax` sets one.
- **Cores**: each node pinned to the cores it is given (a Pi has its own; here nodes may share one).
- **Links** (namespaces=True): each node in a network namespace of its own, with its own address on
  a bridge (dllama.sync.netns), every link shaped to a bandwidth (tc tbf) and delayed by a one-way
  latency: this kernel has no netem, so a relay process (tests/lan_relay.py) in each worker's
  namespace listens on the worker's address and forwards to it, delaying each direction. Without
  namespaces the nodes talk over loopback, through relays in this process where a latency is asked.

    with HomeCluster(3, memory=500_000_000, cores=[{0}, {1}, {0}, {1}]) as cluster:
        cluster.start_workers()
        result = cluster.run_root("inference", "-p", "Hi", "-n", "8", "--json")

`Unavailable` says why a part cannot be made here (not root, no cgroup controller, no namespaces).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dllama.sync.netns import NetnsTestbed, NetnsUnavailable

from .cluster_helpers import DLLAMA, free_port
from .lan_relay import RelayThread

WORKER_PORT = 9870  # in a namespace: every worker has the same port on its own address
INNER_PORT = 9871  # ... and, behind its relay, listens on its namespace's loopback
SECRET = "home-cluster-secret"  # workers on a non-loopback address refuse to start without one


class Unavailable(Exception):
    """A part of the test bed cannot be made on this machine (the message says why)."""


class MemoryCgroup:
    """A memory cgroup (v2 or v1, whichever the machine has, under this process's own) limited to
    `limit` bytes; `join` is a preexec_fn that moves the child process into it."""

    def __init__(self, limit: int, name: str):
        self.limit = limit
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")), None)
        v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
            parent = "/sys/fs/cgroup/memory" + v1
            self.folder = os.path.join(parent if os.path.isdir(parent) else "/sys/fs/cgroup/memory", name)
            self.version, limit_file = 1, "memory.limit_in_bytes"
        elif v2 is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.folder, self.version, limit_file = os.path.join("/sys/fs/cgroup" + v2.rstrip("/"), name), 2, "memory.max"
        else:
            raise Unavailable("no memory cgroup controller here (v1 or v2)")
        try:
            os.mkdir(self.folder)
            Path(self.folder, limit_file).write_text(str(limit))
        except OSError as e:
            self.remove()
            raise Unavailable(f"cannot make a memory cgroup here ({e})") from None

    def join(self) -> None:
        Path(self.folder, "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        """The most it held (v1: max_usage_in_bytes; v2: memory.peak, Linux 5.19+), None if unknown."""
        try:
            return int(Path(self.folder, "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak").read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for _ in range(50):  # (its processes are gone once killed and reaped)
            try:
                os.rmdir(self.folder)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class HomeCluster:
    """A root (node 0) and n_workers workers (nodes 1..n). memory: each node's limit in bytes (or a
    list, one per node; None: none); cores: the CPUs each node may run on (a list of sets, one per
    node; None: any); rate: each link's bandwidth for tc ("100mbit"; namespaces only); one_way_s: each
    link's latency one way."""

    def __init__(self, n_workers: int, *, memory=None, cores=None, namespaces: bool = False, rate: str | None = None,
                 one_way_s: float = 0.0):
        if rate and not namespaces:
            raise ValueError("links are shaped to a rate in network namespaces only")
        self.n_nodes = n_workers + 1
        self.memory = memory if isinstance(memory, list) else [memory] * self.n_nodes
        self.cores = cores or [None] * self.n_nodes
        self.namespaces, self.rate, self.one_way_s = namespaces, rate, one_way_s
        self.bed: NetnsTestbed | None = None
        self.cgroups: list[MemoryCgroup | None] = [None] * self.n_nodes
        self.workers: list[subprocess.Popen] = []
        self.relays: list[subprocess.Popen] = []
        self.relay_thread: RelayThread | None = None
        self.addresses: list[str] = []  # what the root dials, per worker
        self.logs: list[Path] = []

    def __enter__(self) -> "HomeCluster":
        try:
            if self.namespaces:
                try:
                    self.bed = NetnsTestbed(self.n_nodes, rate=self.rate).setup()
                except NetnsUnavailable as e:
                    raise Unavailable(f"cannot build network namespaces here: {e}") from None
            for i, limit in enumerate(self.memory):
                if limit is not None:
                    self.cgroups[i] = MemoryCgroup(limit, f"dllama-home-{os.getpid()}-{i}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def node_setup(self, i: int):
        """The preexec_fn of node i's process: into its cgroup, onto its cores."""
        cgroup, cores = self.cgroups[i], self.cores[i]

        def setup():
            if cgroup is not None:
                cgroup.join()
            if cores is not None:
                os.sched_setaffinity(0, cores)

        return setup

    def prefix(self, i: int) -> list[str]:
        return self.bed.prefix(i) if self.bed is not None else []

    def start_workers(self, *args: str, log_dir: Path | None = None) -> None:
        """`dllama worker` on every worker node (one thread each, no slice cache) and, where links have
        a latency, the relays in front of them; returns once all of them listen."""
        for i in range(1, self.n_nodes):
            relayed = self.one_way_s > 0
            if self.bed is not None:
                host, port = ("127.0.0.1", INNER_PORT) if relayed else (self.bed.addresses[i], WORKER_PORT)
            else:
                host, port = "127.0.0.1", free_port()
            log = (log_dir or Path("/tmp")) / f"home-cluster-{os.getpid()}-worker{i}.log"
            self.logs.append(log)
            with open(log, "w") as err:
                proc = subprocess.Popen([*self.prefix(i), *DLLAMA, "worker", "--host", host, "--port", str(port),
                                         "--threads", "1", "--no-cache", "--secret", SECRET, *args],
                                        stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=self.node_setup(i))
            self.workers.append(proc)
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError(f"worker {i} did not start: {line!r} {log.read_text()[-2000:]}")
            if self.bed is not None and relayed:
                address = f"{self.bed.addresses[i]}:{WORKER_PORT}"
                relay = subprocess.Popen([*self.prefix(i), sys.executable, str(Path(__file__).with_name("lan_relay.py")),
                                          address, f"127.0.0.1:{INNER_PORT}", "--one-way-ms", str(self.one_way_s * 1e3)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                self.relays.append(relay)
                line = relay.stdout.readline()
                if not line.startswith("relaying "):
                    raise RuntimeError(f"relay {i} did not start: {line!r} {relay.stderr.read()[-2000:]}")
                self.addresses.append(address)
            else:
                self.addresses.append(f"{host}:{port}")
        if self.bed is None and self.one_way_s > 0:
            direct = [tuple(a.rsplit(":", 1)) for a in self.addresses]
            self.relay_thread = RelayThread([(h, int(p)) for h, p in direct], self.one_way_s)
            self.addresses = self.relay_thread.addresses

    def root_command(self, *args: str, workers: bool = True) -> list[str]:
        with_workers = ["--workers", ",".join(self.addresses)] if workers and self.addresses else []
        return [*self.prefix(0), *DLLAMA, *args, *with_workers, "--secret", SECRET]

    def run_root(self, *args: str, workers: bool = True, input: str | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        """A root command (`inference`, `chat`, ...) on node 0, given the workers (unless workers=False)."""
        return subprocess.run(self.root_command(*args, workers=workers), capture_output=True, text=True, input=input,
                              timeout=timeout, preexec_fn=self.node_setup(0))

    def alive(self) -> list[bool]:
        return [proc.poll() is None for proc in self.workers]

    def close(self) -> None:
        for proc in self.workers + self.relays:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers + self.relays:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        self.workers, self.relays = [], []
        if self.relay_thread is not None:
            self.relay_thread.close()
            self.relay_thread = None
        for cgroup in self.cgroups:
            if cgroup is not None:
                cgroup.remove()
        if self.bed is not None:
            self.bed.teardown()
            self.bed = None
        for log in self.logs:
            log.unlink(missing_ok=True)
