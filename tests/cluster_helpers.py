"""Helpers for the cluster tests: worker daemons inside the test's event loop (real sockets, the
real protocol, compute serialized in one process), worker daemons as real processes, and the
1-node references the cluster must reproduce."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid

import msgspec
import numpy as np

from dllama.cluster import messages as M
from dllama.cluster import protocol as P
from dllama.node import rss_mb
from dllama.cluster.root import ClusterEngine
from dllama.cluster.slices import make_entry, tensor_bytes
from dllama.cluster.worker import Worker
from dllama.errors import NetworkError
from dllama.model import ShardModel, ShardWeights, shard_tensors
from dllama.net import connect
from dllama.net.frames import pack_msg
from dllama.plan import Plan
from dllama.sampling import Sampler, SamplingParams
from dllama.step import NodeStep, Step
from dllama.sync import init_process_group
from dllama.sync_config import SyncConfig

DLLAMA = [sys.executable, "-m", "dllama"]


@contextlib.asynccontextmanager
async def in_process_cluster(model, n_workers: int, *, algo: str = "ring", sync_dtype: str = "f64",
                             sync_mode: str = "reduce", ctx: int = 256, weights=None, secret=None, cache_dirs=None,
                             timeout: float = 20.0, slots: int = 1):
    """A root (ClusterEngine) and n worker daemons, all in this event loop, over loopback TCP."""
    workers = [Worker(secret=secret, cache_dir=None if cache_dirs is None else cache_dirs[i], timeout=timeout)
               for i in range(n_workers)]
    try:
        addrs = [await w.start("127.0.0.1", 0) for w in workers]
        engine = await ClusterEngine(model, ctx, addrs, sync=SyncConfig(algo, sync_mode, sync_dtype),
                                     weights=weights, secret=secret, timeout=timeout, spin=0.0, progress=False,
                                     slots=slots).start()
        try:
            yield engine, workers
        finally:
            await engine.close()
    finally:
        for w in workers:
            await w.close()


def free_port() -> int:
    """A loopback port nobody listens on (for now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`dllama worker` as a real process on a free loopback port. log_file: where its log goes
    (a file is never full, unlike a pipe nobody reads while a long test runs)."""

    def __init__(self, *args: str, threads: int = 1, env: dict | None = None, log_file=None, preexec_fn=None):
        cmd = DLLAMA + ["worker", "--host", "127.0.0.1", "--port", "0", "--threads", str(threads), *args]
        self.log_file = log_file
        stderr = subprocess.PIPE if log_file is None else open(log_file, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)
        if log_file is not None:
            stderr.close()
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"worker did not start: {line!r} {self.log()[-2000:]}")
        self.port = int(line.rsplit(":", 1)[1])
        self.address = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        """Its log so far (log_file only) or, once stopped, all of it."""
        if self.log_file is not None:
            with open(self.log_file) as f:
                return f.read()
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

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
        return err if self.log_file is None else self.log()


def run_dllama(*args: str, timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(DLLAMA + list(args), capture_output=True, text=True, timeout=timeout, input=input)


GREEDY = SamplingParams(temperature=0.0)


async def greedy_tokens(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, from any Engine (its context is rewound first)."""
    engine.rewind(0)
    sampler = Sampler(GREEDY)
    summaries = await engine.feed(prompt, GREEDY)
    tokens = []
    for _ in range(n):
        tokens.append(sampler.pick(summaries[-1]))
        summaries = await engine.feed([tokens[-1]], GREEDY)
    return tokens


class HandRoot:
    """A root driven message by message over real sockets, with the real messages of
    dllama.cluster.messages, which a test sends as they are or corrupted at any point. It is rank 0
    of a 2-node plan (gather mode, f32, star); the worker at `address` is rank 1."""

    def __init__(self, model, address: tuple[str, int], *, ctx: int = 64, timeout: float = 5.0):
        self.model, self.config = model, model.config
        self.host, self.port = address
        self.ctx, self.timeout = ctx, timeout
        self.plan = Plan.split(self.config, [1.0, 1.0])
        self.tensors = dict(shard_tensors(model, self.plan.shards[1], "gather"))
        self.manifest = [make_entry(name, t) for name, t in self.tensors.items()]
        self.own_weights = ShardWeights.from_gguf(model, self.plan.shards[0], "gather")
        self.embedding = model.matrix("token_embd.weight")
        self.session = ""
        self.current: M.Setup | None = None  # the SETUP of the session open_session opened
        self.conn = None
        self.group = None
        self.step: NodeStep | None = None

    def setup(self, **changes) -> M.Setup:
        """A valid SETUP of a new session, with `changes` to its fields (unchecked)."""
        self.session = uuid.uuid4().hex[:12]
        setup = M.Setup(session=self.session, rank=1, world=2, addrs=[None, (self.host, self.port)], algo="star",
                        sync_dtype="f32", sync_mode="gather", config=M.WireConfig.of(self.config),
                        shards=[M.WireShard.of(s) for s in self.plan.shards], ctx_size=self.ctx,
                        manifest=self.manifest, spin=0.0)
        return msgspec.structs.replace(setup, **changes)

    def forward(self, tokens: list[int], start: int = 0, **changes) -> tuple[Step, np.ndarray]:
        """A valid FORWARD of tokens at start (one sequence in slot 0, greedy, last logits), and
        their embeddings; `changes` to the sequence's fields."""
        [seq] = Step.of(start, len(tokens), GREEDY).seqs
        return Step([msgspec.structs.replace(seq, **changes)]), self.embedding.row_values(np.asarray(tokens))

    async def connect(self) -> None:
        self.conn = await connect(self.host, self.port, role="control", session=self.session, timeout=self.timeout,
                                  heartbeat=self.timeout / 4, max_frame=P.MAX_SETUP)

    async def send_setup(self, body: dict) -> tuple[str, dict]:
        """Connect and send a SETUP body; the worker's answer (NEED or FAILED)."""
        return await self._opening(P.SETUP, body, P.NEED)

    async def probe(self) -> None:
        """Connect and PROBE, as a root does before it plans; fails the test unless PROBED comes back."""
        kind, reply = await self._opening(P.PROBE, M.Probe().to_wire(), P.PROBED)
        assert kind == P.PROBED.name, reply

    async def _opening(self, kind, body: dict, answer) -> tuple[str, dict]:
        """Connect, send the session's first message and return the worker's answer (`answer` or
        FAILED). Like a real root, it tries again while the worker is still closing the previous
        session ("busy"), as it is for a moment after another test's root hung up."""
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            await self.connect()
            await self.conn.send_msg(kind, body)
            got, reply = await self.reply(answer)
            if "busy" not in reply.get("error", "") or asyncio.get_running_loop().time() > deadline:
                return got, reply
            await self.close()
            await asyncio.sleep(0.01)

    async def reply(self, kind, timeout: float | None = None) -> tuple[str, dict]:
        """The worker's next message: `kind` or FAILED."""
        return await self.conn.recv_msg((kind, P.FAILED), timeout=timeout or self.timeout)

    async def send_tensors(self, names, tensors: dict | None = None) -> None:
        tensors = {**self.tensors, **(tensors or {})}
        for name in names:
            raw = tensor_bytes(tensors[name])
            for start, stop in P.chunks(raw.nbytes):
                await self.conn.send_array(raw[start:stop], kind=P.TENSOR)

    async def open_session(self) -> None:
        """A whole valid set-up: SETUP, the slices the worker lacks, GO, the sync group, READY."""
        self.current = self.setup()
        await self.load(self.current)
        self.group = await init_process_group(0, 2, [None, (self.host, self.port)], session=self.session, algo="star",
                                              timeout=self.timeout, spin=0.0)
        kind, body = await self.reply(P.READY)
        assert kind == P.READY.name, body
        model = ShardModel(self.config, self.plan.shards[0], self.own_weights, self.ctx,
                           SyncConfig("star", "gather", "f32").projection(self.plan.shards, self.config.head_dim))
        self.step = NodeStep(model, self.group, None)

    async def load(self, setup: M.Setup) -> None:
        """SETUP, the slices the worker lacks, and GO once it has loaded them: it joins the sync group next."""
        kind, body = await self.send_setup(M.to_wire(setup))
        assert kind == P.NEED.name, body
        await self.send_tensors(body["names"])
        kind, body = await self.reply(P.LOADED, timeout=60)
        assert kind == P.LOADED.name, body
        await self.conn.send_msg(P.GO, {})

    async def send_step(self, body: dict, activations, run: Step | None,
                        activations_kind=P.ACTIVATIONS) -> tuple[str, dict]:
        """Send a FORWARD body and its ACTIVATIONS (an array or raw bytes, in a frame of
        `activations_kind`); `run`: the step the root computes its part of meanwhile (None: the
        step is invalid and the root stays out). The worker's reply."""
        self.conn.write_frame(P.FORWARD, pack_msg(body))
        self.conn.write_frame(activations_kind, activations)
        own = None
        if run is not None:
            x = np.frombuffer(activations, np.float32).reshape(run.n, self.config.dim)
            own = asyncio.ensure_future(self.step.run(x, run))
        try:
            return await self.reply(P.RESULT)
        finally:
            if own is not None:
                try:
                    await own
                except NetworkError:
                    pass  # the worker refused the step it had to take part in: the reply says so

    async def close(self) -> None:
        if self.conn is not None:
            if not self.conn.closed:
                try:
                    await self.conn.send_msg(P.END, {})
                except NetworkError:
                    pass
            await self.conn.close()
            self.conn = None
        if self.group is not None:
            self.group.abort("the test root closes")
            await self.group.close()
            self.group = None


async def root_answer(model, address: tuple[str, int], prompt: list[int], n: int, secret=None) -> list[int]:
    """The greedy answer of a real root (ClusterEngine) with the worker at `address`, in gather
    mode: bit for bit the 1-node answer (one_node_answer) when the worker computes right."""
    engine = await ClusterEngine(model, 64, [address], sync=SyncConfig("star", "gather", "f32"),
                                 secret=secret, timeout=10.0, spin=0.0, progress=False, recover=False).start()
    try:
        return await greedy_tokens(engine, prompt, n)
    finally:
        await engine.close()


async def one_node_answer(model, prompt: list[int], n: int) -> list[int]:
    from dllama.engine import LocalEngine

    engine = LocalEngine(model, 64)
    try:
        return await greedy_tokens(engine, prompt, n)
    finally:
        await engine.close()
