"""p ranks in p separate processes (one OS process per rank, real TCP between them).

    with ProcessCluster(4, "mypkg.mod:job", args=(1024,), algo="ring") as cluster:
        results = cluster.results()          # job(group, 1024) of every rank, in rank order

`job` is an async (or plain) function `job(group, *args)` importable in the child; its return
value must be JSON-serialisable. A child runs `procs.main()`; it listens, tells
the parent its port, gets everyone's address back, builds its ProcessGroup and runs the job.
Parent and children talk over the children's stdin/stdout (lines starting with "@@dllama "), so
a rank may live in another network namespace (`prefixes=[["ip", "netns", "exec", "ns0"], ...]`).
A job can send progress events to the parent with `report(event, **fields)`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

PREFIX = "@@dllama "
_CHILD = "import sys; from dllama.sync.procs import main; sys.exit(main())"


def report(event: str, **fields) -> None:
    """From inside a child: send an event line to the parent (with the child's wall time)."""
    fields.update(event=event, wall=time.time())
    sys.stdout.write(PREFIX + json.dumps(fields) + "\n")
    sys.stdout.flush()


class ChildError(RuntimeError):
    """A rank process failed; `errors` maps rank -> its error event (type, message)."""

    def __init__(self, errors: dict[int, dict]):
        self.errors = errors
        lines = [f"rank {r}: {e.get('type', '?')}: {e.get('message', '')}" for r, e in sorted(errors.items())]
        super().__init__("; ".join(lines))


class ProcessCluster:
    def __init__(self, p: int, target: str, args=(), *, algo: str = "ring", hosts=None, ports=None,
                 prefixes=None, session: str = "procs", secret=None, timeout: float | None = 60.0,
                 group_kwargs: dict | None = None, start_timeout: float = 60.0, python: str | None = None,
                 env: dict | None = None):
        if p < 1:
            raise ValueError("a cluster needs at least one rank")
        self.p = p
        self.config = {"target": target, "args": list(args), "algo": algo, "session": session, "secret": secret,
                       "timeout": timeout, "group_kwargs": group_kwargs or {}}
        self.hosts = list(hosts) if hosts else ["127.0.0.1"] * p
        self.ports = list(ports) if ports else [0] * p
        self.prefixes = list(prefixes) if prefixes else [[] for _ in range(p)]
        self.start_timeout = start_timeout
        self.python = python or sys.executable
        self.env = env
        self.procs: list[subprocess.Popen] = []
        self.events: list[queue.Queue] = [queue.Queue() for _ in range(p)]
        self._stderr = []
        self._threads = []
        self._finished: dict[int, dict] = {}
        self.addrs: list[tuple[str, int]] = []  # where each rank listens, once started

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ProcessCluster":
        env = dict(os.environ if self.env is None else self.env)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.getcwd(), env.get("PYTHONPATH")) if x)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            for r in range(self.p):
                err = tempfile.TemporaryFile(mode="w+b")
                self._stderr.append(err)
                cmd = [*self.prefixes[r], self.python, "-c", _CHILD]
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                        text=True, bufsize=1, start_new_session=True)
                self.procs.append(proc)
                t = threading.Thread(target=self._read, args=(r, proc), daemon=True)
                t.start()
                self._threads.append(t)
                self._send(r, {**self.config, "rank": r, "world": self.p, "host": self.hosts[r],
                               "port": self.ports[r]})
            ports = [self.wait_event(r, "listening", self.start_timeout)["port"] for r in range(self.p)]
            addrs = [[self.hosts[r], ports[r]] for r in range(self.p)]
            self.addrs = [tuple(a) for a in addrs]
            for r in range(self.p):
                self._send(r, {"addrs": addrs})
        except BaseException:
            self.close()
            raise
        return self

    def _send(self, r: int, obj: dict) -> None:
        self.procs[r].stdin.write(json.dumps(obj) + "\n")
        self.procs[r].stdin.flush()

    def _read(self, r: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(PREFIX):
                try:
                    ev = json.loads(line[len(PREFIX):])
                except ValueError:
                    continue
                ev["t"] = time.monotonic()
                self.events[r].put(ev)
        self.events[r].put({"event": "exit", "t": time.monotonic()})

    def close(self, grace: float = 3.0) -> None:
        """Stop every rank: those that reported their outcome get `grace` seconds to exit on
        their own (closing their connections cleanly), the rest are killed."""
        deadline = time.monotonic() + grace
        for r, proc in enumerate(self.procs):
            if r in self._finished and proc.poll() is None:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # in case a test stopped it
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except Exception:
                    pass
        for t in self._threads:
            t.join(timeout=2)
        for f in self._stderr:
            f.close()
        self._stderr = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ observing
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self, rank: int, sig=signal.SIGKILL) -> float:
        """Send a signal to one rank; returns time.monotonic() right after."""
        os.kill(self.procs[rank].pid, sig)
        return time.monotonic()

    def stderr(self, rank: int) -> str:
        f = self._stderr[rank]
        f.seek(0)
        return f.read().decode(errors="replace")[-4000:]

    def _next_event(self, rank: int, deadline: float, missing: str) -> dict:
        try:
            return self.events[rank].get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise TimeoutError(f"rank {rank}: {missing}") from None

    def wait_event(self, rank: int, name: str, timeout: float) -> dict:
        """The next event `name` from `rank` (earlier other events are skipped). Raises ChildError
        if the rank reports an error or exits first, TimeoutError if nothing comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self._next_event(rank, deadline, f"no {name!r} event within {timeout:.3g} s")
            if ev["event"] == name:
                return ev
            if ev["event"] in ("error", "exit"):
                if ev["event"] == "exit":
                    ev = {"type": "exit", "message": f"exited (code {self.procs[rank].poll()}): "
                                                     f"{self.stderr(rank)[-1500:]}"}
                self._finished[rank] = ev
                raise ChildError({rank: ev})

    def outcome(self, rank: int, timeout: float) -> dict:
        """The rank's final event: {"event": "result", "value": ...} or {"event": "error", ...}."""
        if rank in self._finished:
            return self._finished[rank]
        deadline = time.monotonic() + timeout
        while True:
            ev = self._next_event(rank, deadline, f"no result within {timeout:.3g} s")
            if ev["event"] in ("result", "error"):
                self._finished[rank] = ev
                return ev
            if ev["event"] == "exit":
                ev = {"event": "error", "type": "exit", "t": ev["t"],
                      "message": f"exited (code {self.procs[rank].poll()}) without a result: "
                                 f"{self.stderr(rank)[-1500:]}"}
                self._finished[rank] = ev
                return ev

    def results(self, timeout: float = 600.0) -> list:
        """Every rank's return value, in rank order; raises ChildError if any rank failed."""
        deadline = time.monotonic() + timeout
        outcomes = [self.outcome(r, max(deadline - time.monotonic(), 0.001)) for r in range(self.p)]
        errors = {r: o for r, o in enumerate(outcomes) if o["event"] == "error"}
        if errors:
            raise ChildError(errors)
        return [o["value"] for o in outcomes]


def run_processes(p: int, target: str, args=(), **kwargs) -> list:
    """Run `target(group, *args)` on p ranks in p processes; the results in rank order."""
    timeout = kwargs.pop("result_timeout", 600.0)
    with ProcessCluster(p, target, args, **kwargs) as cluster:
        return cluster.results(timeout)


# ---------------------------------------------------------------- the child side
def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


async def _child_main(cfg: dict) -> None:
    import asyncio

    from ..net import ConnectionInbox, Listener
    from .rendezvous import init_process_group, peers_of

    session = cfg["session"]
    inbox = ConnectionInbox()
    listener = await Listener(peers_of(session, inbox), secret=cfg["secret"], rank=cfg["rank"],
                              session=session).start(cfg["host"], cfg["port"])
    report("listening", port=listener.port)
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    addrs = [tuple(a) for a in json.loads(line)["addrs"]]
    group = await init_process_group(cfg["rank"], cfg["world"], addrs, session=session, algo=cfg["algo"],
                                     secret=cfg["secret"], timeout=cfg["timeout"], incoming=inbox,
                                     **cfg["group_kwargs"])
    report("ready")
    try:
        fn = _load(cfg["target"])
        value = fn(group, *cfg["args"])
        if inspect.isawaitable(value):
            value = await value
        report("result", value=value)
    finally:
        await group.close()
        await listener.close()


def main() -> int:
    from ..net.loop import run

    cfg = json.loads(sys.stdin.readline())
    try:
        run(_child_main(cfg))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        report("error", type=type(e).__name__, message=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
