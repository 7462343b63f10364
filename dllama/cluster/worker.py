"""The worker daemon (`dllama worker`): needs no model file. A root connects, sends the model's
config and this node's weight slices (checksummed; cached on disk so a restart is not sent them
again), and then drives forward steps. When the root leaves or fails, the worker frees the
session and waits for the next root.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import numpy as np

from .. import __version__
from ..config import ModelConfig
from ..errors import DllamaError, NetworkError
from ..model import ShardModel, ShardWeights
from ..net import ConnectionInbox, Listener
from ..plan import Shard
from ..sampling import SamplingParams
from ..sync import init_process_group
from . import protocol as P
from .node import NodeStep, measure_speed, mem_available, projection_of, rss_mb
from .slice_cache import SliceCache
from .slices import TensorEntry, checksum, from_bytes

log = logging.getLogger("dllama.worker")

SETUP_TIMEOUT = 120.0  # a root that connected but says nothing


class Worker:
    def __init__(self, *, threads: int | None = None, secret: str | None = None, cache_dir=None,
                 timeout: float = 30.0, max_memory: int | None = None):
        self.threads = threads
        self.max_memory = max_memory  # bytes this worker may use for a slice and its KV cache
        self.secret = secret
        self.cache = SliceCache(cache_dir)
        self.timeout = timeout
        self.inbox = ConnectionInbox()
        self.listener = Listener(self._on_connection, secret=secret, timeout=timeout, heartbeat=timeout / 4)
        self.busy = False
        self.session_id: str | None = None  # the session being served: its peers may connect
        self.sessions_served = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        await self.listener.start(host, port)
        return self.listener.address

    async def close(self) -> None:
        await self.listener.close()

    async def _on_connection(self, conn, hello) -> None:
        if hello.role == "peer":
            # only peers of the session in progress are parked for its group: a connection that
            # claims another session would wait in the inbox for ever
            if self.session_id is None or hello.session != self.session_id:
                await conn.close()
                return
            self.inbox.put(conn, hello)
            return
        if self.busy:
            log.warning("refused root %s: busy with another root", conn.peer)
            await conn.send_msg(P.FAILED, {"error": "this worker is busy with another root"})
            try:  # let the root read why before the connection goes
                await conn.recv_msg(P.END, timeout=1.0)
            except NetworkError:
                pass
            await conn.close()
            return
        self.busy = True
        session = None
        try:
            session = _Session(self, conn)
            await session.run()
        except NetworkError as e:
            log.warning("session with root %s ended: %s", conn.peer, e)
        except Exception as e:  # the root hears why; the daemon lives on for the next root
            if isinstance(e, DllamaError):
                log.warning("session with root %s failed: %s", conn.peer, e)
            else:
                log.exception("session with root %s failed", conn.peer)
            if not conn.closed:
                try:
                    await conn.send_msg(P.FAILED, {"error": str(e) if isinstance(e, DllamaError)
                                                   else f"internal error: {type(e).__name__}: {e}"})
                except NetworkError:
                    pass
        finally:
            if session is not None:
                await session.close()
            if not conn.closed:
                await conn.close()
            self.busy = False
            self.sessions_served += 1
            log.info("ready for the next root")


class _RootEnded(Exception):
    """The root sent END: the session is over, normally."""


class _Session:
    def __init__(self, worker: Worker, conn):
        self.worker = worker
        self.conn = conn
        self.group = None
        self.session_id = ""

    async def close(self) -> None:
        self.worker.session_id = None
        if self.group is not None:
            await self.group.close()
            self.group = None
        self.worker.inbox.discard(self.session_id)

    async def _recv(self, kinds, timeout):
        """The next message of one of `kinds`; END from the root (at any point) ends the session."""
        kind, msg = await self.conn.recv_msg(tuple(kinds) + (P.END,), timeout=timeout)
        if kind == P.END.name:
            raise _RootEnded()
        return kind, msg

    async def run(self) -> None:
        try:
            await self._run()
        except _RootEnded:
            log.info("session %s: the root ended it", self.session_id or "(not set up)")

    async def _run(self) -> None:
        conn = self.conn
        log.info("root %s connected", conn.peer)
        kind, msg = await self._recv((P.PROBE, P.SETUP), SETUP_TIMEOUT)
        if kind == P.PROBE.name:
            speed = measure_speed() if msg.get("measure") else None
            available = [m for m in (mem_available(), self.worker.max_memory) if m is not None]
            await conn.send_msg(P.PROBED, {"gmacs": speed, "mem_available": min(available) if available else None,
                                           "threads": self.worker.threads, "version": __version__})
            kind, msg = await self._recv((P.SETUP,), SETUP_TIMEOUT)
        t0 = time.perf_counter()
        step, cached = await self._load(msg)
        await conn.send_msg(P.LOADED, {"cached": cached})
        await self._recv((P.GO,), SETUP_TIMEOUT)
        addrs = [None if a is None else tuple(a) for a in msg["addrs"]]
        self.group = await init_process_group(
            msg["rank"], msg["world"], addrs, session=self.session_id, algo=msg["algo"],
            secret=self.worker.secret, timeout=self.worker.timeout, incoming=self.worker.inbox,
            spin=msg.get("spin"))
        step.group = self.group
        await conn.send_msg(P.READY, {"rss_mb": rss_mb(), "load_s": time.perf_counter() - t0, "cached": cached})
        log.info("session %s: rank %d of %d, %s sync (%s, %s), ready", self.session_id, msg["rank"], msg["world"],
                 msg["algo"], msg["sync_mode"], msg["sync_dtype"])
        await self._serve_steps(step, ModelConfig.from_dict(msg["config"]).dim)

    async def _load(self, setup: dict) -> tuple[NodeStep, int]:
        conn = self.conn
        self.session_id = self.worker.session_id = str(setup["session"])
        config = ModelConfig.from_dict(setup["config"])
        shards = [Shard.from_dict(d) for d in setup["shards"]]
        shard = shards[int(setup["rank"])]
        projection = projection_of(setup["sync_mode"], setup["sync_dtype"], shards, config.head_dim)
        entries = [TensorEntry.from_dict(e) for e in setup["manifest"]]
        need = sum(e.nbytes for e in entries) + 4 * config.n_layers * shard.n_kv_heads * config.head_dim * int(setup["ctx_size"])
        if self.worker.max_memory is not None and need > self.worker.max_memory:
            raise DllamaError(f"the slice needs {need / 1e6:.0f} MB, more than this worker's --max-memory "
                              f"{self.worker.max_memory / 1e6:.0f} MB")
        tensors = {}
        for e in entries:  # a cached slice is used only if its bytes still match its checksum
            cached = self.worker.cache.load_verified(e)
            if cached is not None:
                tensors[e.name] = from_bytes(e, cached)
        missing = [e for e in entries if e.name not in tensors]
        await conn.send_msg(P.NEED, {"names": [e.name for e in missing]})
        for e in missing:
            raw = np.empty(e.nbytes, np.uint8)
            for start, stop in P.chunks(e.nbytes):
                await conn.recv_array(raw[start:stop], kind=P.TENSOR, timeout=self.worker.timeout)
            if checksum(raw) != e.sha256:
                raise DllamaError(f"tensor {e.name} arrived corrupted (checksum mismatch)")
            self.worker.cache.store(e, raw)
            tensors[e.name] = from_bytes(e, raw)
        weights = ShardWeights.from_tensors(tensors)
        model = ShardModel(config, shard, weights, int(setup["ctx_size"]), projection)
        log.info("session %s: %d tensors (%d from cache), %.1f MB of weights", self.session_id, len(entries),
                 len(entries) - len(missing), weights.nbytes / 1e6)
        return NodeStep(model, None, setup["sync_dtype"]), len(entries) - len(missing)

    async def _serve_steps(self, step: NodeStep, dim: int) -> None:
        conn = self.conn
        while True:
            # no deadline for the next step: a user may think for minutes. The connection's
            # watchdog still fails a root that stops sending anything, heartbeats included.
            _kind, msg = await self._recv((P.FORWARD,), None)
            n = int(msg["n"])
            x = np.empty((n, dim), np.float32)
            await conn.recv_array(x, kind=P.ACTIVATIONS, timeout=self.worker.timeout)
            stats0 = self.group.stats
            t0 = time.perf_counter()
            params = SamplingParams(**msg["params"])
            summaries = await step.run(x, int(msg["start"]), msg["logits"], params, msg.get("recent") or [],
                                       msg.get("targets"))
            stats = self.group.stats
            await conn.send_msg(P.RESULT, {
                "summaries": [s.to_wire() for s in summaries],
                "stats": {"step_s": time.perf_counter() - t0, "sync_s": stats.seconds - stats0.seconds,
                          "sent": stats.bytes_sent - stats0.bytes_sent, "recv": stats.bytes_recv - stats0.bytes_recv,
                          "rss_mb": rss_mb()}})


async def serve(host: str, port: int, *, threads: int | None, secret: str | None, cache_dir, timeout: float,
                max_memory: int | None = None, announce=None) -> None:
    """Run a worker until SIGINT/SIGTERM. `announce(host, port)` is called once it listens."""
    worker = Worker(threads=threads, secret=secret, cache_dir=cache_dir, timeout=timeout, max_memory=max_memory)
    addr = await worker.start(host, port)
    if announce is not None:
        announce(*addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await worker.close()
