"""A multi-host testbed on one Linux machine: p network namespaces ("hosts"), each with its own
address 10.77.0.<i+1>/24 on a bridge that lives in a namespace of its own, optionally shaped
with `tc ... tbf` in both directions of every host link (e.g. 100mbit: a small switch).

    with NetnsTestbed(4, rate="100mbit") as bed:
        with bed.cluster("dllama.sync.bench:bench_rank", args=(config,)) as cluster: ...

Nothing is created in the caller's namespace; everything is removed on exit. Needs root and
iproute2; `NetnsUnavailable` says why when namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ..errors import DllamaError

SUBNET = "10.77.0"


class NetnsUnavailable(DllamaError):
    """Network namespaces cannot be created here (not root, no iproute2, no permission)."""


def _ip(*args, check=True):
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {res.stderr.strip() or res.returncode}")
    return res


def _tc(ns, *args):
    res = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise NetnsUnavailable(f"`tc -n {ns} {' '.join(args)}` failed: {res.stderr.strip() or res.returncode}")


class NetnsTestbed:
    def __init__(self, p: int, rate: str | None = None, burst: str = "32kb", latency: str = "50ms"):
        if not 1 <= p <= 250:
            raise ValueError("a testbed has 1..250 hosts")
        self.p = p
        self.rate = rate
        self.burst = burst
        self.latency = latency
        tag = f"dls{os.getpid() % 100000}"
        self.bridge_ns = f"{tag}br"
        self.namespaces = [f"{tag}h{i}" for i in range(p)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(p)]
        self._made: list[str] = []

    def setup(self) -> "NetnsTestbed":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None or (self.rate and shutil.which("tc") is None):
            raise NetnsUnavailable("iproute2 (ip, tc) is not installed")
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                self._add_ns(ns)
                # Both ends are created inside their namespaces: the caller's namespace is untouched.
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}",
                    "netns", self.bridge_ns)
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.bridge_ns, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", f"port{i}", "up")
                if self.rate:
                    shape = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
                    _tc(ns, "qdisc", "add", "dev", "eth0", *shape)  # host -> switch
                    _tc(self.bridge_ns, "qdisc", "add", "dev", f"port{i}", *shape)  # switch -> host
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_ns(self, ns):
        _ip("netns", "add", ns)
        self._made.append(ns)

    def teardown(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends too
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self):
        return self.setup()

    def __exit__(self, *exc):
        self.teardown()

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program on host i."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def run(self, i: int, *cmd, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(i), *cmd], capture_output=True, text=True, timeout=timeout)

    def cluster(self, target: str, args=(), **kwargs):
        """A ProcessCluster with rank i on host i (not started: use it as a context manager).
        Busy-polling is off by default: the hosts share this machine's cores."""
        from .procs import ProcessCluster
        group_kwargs = {"spin": 0.0, **kwargs.pop("group_kwargs", {})}
        return ProcessCluster(self.p, target, args, hosts=self.addresses,
                              prefixes=[self.prefix(i) for i in range(self.p)], group_kwargs=group_kwargs, **kwargs)
