"""The worker daemon (`dllama worker`): needs no model file. A root connects, sends the model's
config and this node's weight slices (checksummed; cached on disk so a restart is not sent them
again), and then drives forward steps. When the root leaves or fails, the worker frees the
session and waits for the next root.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time

import numpy as np

from .. import __version__
from ..errors import DllamaError, NetworkError, PeerTimeout
from ..model import ShardModel, ShardWeights, packed_for_kernels
from ..step import NodeStep, Step
from ..wire import InvalidMessage
from ..net import ConnectionInbox, Listener
from ..net.discovery import Advertiser
from ..net.handshake import HANDSHAKE_TIMEOUT
from ..node import measure_speed, mem_available, rss_mb
from ..sync import init_process_group
from . import messages as M
from . import protocol as P
from .slice_cache import SliceCache
from .slices import checksum, from_bytes

log = logging.getLogger("dllama.worker")

SETUP_TIMEOUT = 10.0  # default --setup-timeout: a root that connected must say PROBE or SETUP this soon
PLAN_TIMEOUT = 120.0  # after its PROBE, a root plans and checksums every slice before it sends SETUP
GO_TIMEOUT = 120.0  # after LOADED, the root waits until every other worker has its slices too
# what a step's activations and logits and the messages in flight need besides a session's slices and KV
# cache (the interpreter is in the figure it is taken from; measured: a worker in a memory cgroup used ~2 MB
# more than its slices and KV cache over a session of the default model, with its kernels' code)
MEMORY_MARGIN = 64 << 20
BUSY_LOG_EVERY = 10.0  # seconds between two log lines about roots refused while busy
COLLECT_AFTER = 16 << 20  # a session that held this many bytes is garbage-collected at its end


class Worker:
    def __init__(self, *, threads: int | None = None, secret: str | None = None, cache_dir=None,
                 timeout: float = 30.0, max_memory: int | None = None, setup_timeout: float = SETUP_TIMEOUT):
        self.threads = threads
        self.max_memory = max_memory  # bytes this worker may use for a slice and its KV cache
        self.secret = secret
        self.cache = SliceCache(cache_dir)
        self.timeout = timeout
        self.setup_timeout = setup_timeout
        self.inbox = ConnectionInbox()
        # (its peers check that it serves their session: see net/handshake.py)
        # (a client silent in its handshake is a silent peer too: dropped after --timeout, if that is shorter)
        self.listener = Listener(self._on_connection, secret=secret, timeout=timeout, heartbeat=timeout / 4,
                                 session=lambda: self.session_id, handshake_timeout=min(HANDSHAKE_TIMEOUT, timeout))
        self.busy = False
        self.session_id: str | None = None  # the session being served: its peers may connect
        self.sessions_served = 0
        self._busy_logged_at = -BUSY_LOG_EVERY
        self._busy_unlogged = 0  # refusals since the last line about them

    async def start(self, host: str, port: int) -> tuple[str, int]:
        await self.listener.start(host, port)
        return self.listener.address

    async def close(self) -> None:
        await self.listener.close()

    def memory_budget(self) -> int | None:
        """Bytes a session may declare (slices + KV cache): the tightest of --max-memory and what
        this process can still allocate (node.mem_available: the kernel's figure and its memory
        cgroups' limits) less a margin; None where neither is known."""
        available = mem_available()
        found = [x for x in (self.max_memory, None if available is None else max(available - MEMORY_MARGIN, 0))
                 if x is not None]
        return min(found) if found else None

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
            await self._refuse_busy(conn)
            return
        self.busy = True
        session = _Session(self, conn)
        try:
            await session.run()
        except Exception as e:  # the root hears why; the daemon lives on for the next root
            if isinstance(e, NetworkError):
                log.warning("session with root %s ended: %s", conn.peer, e)
                why = str(e)
            elif isinstance(e, DllamaError):  # an invalid message, a slice too big: one line
                log.warning("session with root %s failed: %s", conn.peer, e)
                why = str(e)
            else:  # a bug of ours: its traceback
                log.exception("session with root %s failed", conn.peer)
                why = f"internal error: {type(e).__name__}: {e}"
            if not conn.closed:
                try:
                    await conn.send_msg(P.FAILED, M.to_wire(M.Failed(why)))
                except NetworkError:
                    pass
        finally:
            held = session.held_bytes
            await session.close()
            if not conn.closed:
                await conn.close()
            if held >= COLLECT_AFTER:
                # A failure's traceback holds the frames that held the buffers, and the connection
                # that holds the failure holds the traceback: a cycle, which only a collection
                # frees, once this handler (which holds the connection) has returned.
                asyncio.get_running_loop().call_soon(gc.collect)
            self.busy = False
            self.sessions_served += 1
            log.info("ready for the next root")

    async def _refuse_busy(self, conn) -> None:
        now = time.monotonic()
        if now - self._busy_logged_at >= BUSY_LOG_EVERY:  # a retrying root would fill the log
            more = f" (and {self._busy_unlogged} more since the last such line)" if self._busy_unlogged else ""
            log.warning("refused root %s: busy with another root%s", conn.peer, more)
            self._busy_logged_at, self._busy_unlogged = now, 0
        else:
            self._busy_unlogged += 1
        try:
            await conn.send_msg(P.FAILED, M.to_wire(M.Failed("this worker is busy with another root")))
            await conn.recv_msg(P.END, timeout=1.0)  # let the root read why before the connection goes
        except NetworkError:
            pass
        await conn.close()


class _RootEnded(Exception):
    """The root sent END: the session is over, normally."""


class _Session:
    def __init__(self, worker: Worker, conn):
        self.worker = worker
        self.conn = conn
        self.group = None
        self.session_id = ""
        self.held_bytes = 0  # what the admitted SETUP declared

    async def close(self) -> None:
        self.worker.session_id = None
        if self.group is not None:
            await self.group.close()
            self.group = None
        self.worker.inbox.discard(self.session_id)

    async def _recv(self, kinds, timeout, what: str):
        """The next message of one of `kinds`; END from the root (at any point) ends the session.
        The timeout is a deadline: heartbeats do not extend it."""
        try:
            kind, body = await self.conn.recv_msg(tuple(kinds) + (P.END,), timeout=timeout)
        except PeerTimeout:
            raise PeerTimeout(f"sent no {what} within {timeout:.3g} s", self.conn.peer) from None
        if kind == P.END.name:
            M.decode(P.END, M.End, body)
            raise _RootEnded()
        return kind, body

    async def run(self) -> None:
        try:
            await self._run()
        except _RootEnded:
            log.info("session %s: the root ended it", self.session_id or "(not set up)")

    async def _run(self) -> None:
        conn = self.conn
        log.info("root %s connected", conn.peer)
        kind, body = await self._recv((P.PROBE, P.SETUP), self.worker.setup_timeout, "PROBE or SETUP")
        if kind == P.PROBE.name:
            probe = M.decode(P.PROBE, M.Probe, body)
            await conn.send_msg(P.PROBED, M.to_wire(M.Probed(
                gmacs=measure_speed() if probe.measure else None, mem_available=self.worker.memory_budget(),
                threads=self.worker.threads, version=__version__)))
            # the root may time the link first (--sync-mode auto): ECHOs, bounded in number, all
            # within the one deadline for SETUP (so they cannot hold this worker busy any longer)
            deadline = time.monotonic() + PLAN_TIMEOUT
            for echoes in range(P.MAX_ECHOES + 1):
                kind, body = await self._recv((P.SETUP, P.ECHO), max(0.0, deadline - time.monotonic()), "SETUP")
                if kind != P.ECHO.name:
                    break
                if echoes == P.MAX_ECHOES:
                    raise InvalidMessage(f"more than {P.MAX_ECHOES} {P.ECHO.name} messages before {P.SETUP.name}")
                await conn.send_msg(P.ECHO, M.to_wire(M.decode(P.ECHO, M.Echo, body)))
        setup = M.decode(P.SETUP, M.Setup, body)
        t0 = time.perf_counter()
        model, cached = await self._load(setup)
        await conn.send_msg(P.LOADED, M.to_wire(M.Loaded(cached)))
        _kind, body = await self._recv((P.GO,), GO_TIMEOUT, "GO")
        M.decode(P.GO, M.Go, body)
        self.group = await init_process_group(
            setup.rank, setup.world, setup.addrs, session=self.session_id, algo=setup.algo,
            secret=self.worker.secret, timeout=self.worker.timeout, incoming=self.worker.inbox, spin=setup.spin)
        node = NodeStep(model, self.group, setup.sync.codec)
        await conn.send_msg(P.READY, M.to_wire(M.Ready(rss_mb(), time.perf_counter() - t0, cached)))
        log.info("session %s: rank %d of %d, %s sync (%s, %s), ready", self.session_id, setup.rank, setup.world,
                 setup.algo, setup.sync_mode, setup.sync_dtype)
        await self._serve_steps(node, setup)

    async def _load(self, setup: M.Setup) -> tuple[ShardModel, int]:
        conn = self.conn
        self.session_id = self.worker.session_id = setup.session
        need, budget = setup.declared_bytes(), self.worker.memory_budget()
        if budget is not None and need > budget:
            raise DllamaError(f"the slice and its KV cache need {need / 1e6:.0f} MB, more than the "
                              f"{budget / 1e6:.0f} MB this worker has available"
                              + (" (--max-memory)" if budget == self.worker.max_memory else ""))
        self.held_bytes = need
        config, shard = setup.config.model_config(), setup.shard
        projection = setup.sync.projection([s.shard() for s in setup.shards], config.head_dim)
        vectors = setup.vector_names()
        tensors = {}
        for e in setup.manifest:  # a cached slice is used only if its bytes still match its checksum
            cached = self.worker.cache.load_verified(e)
            if cached is not None:
                tensors[e.name] = packed_for_kernels(e.name, from_bytes(e, cached, e.name in vectors))
        missing = [e for e in setup.manifest if e.name not in tensors]
        await conn.send_msg(P.NEED, M.to_wire(M.Need([e.name for e in missing])))
        for e in missing:
            raw = np.empty(e.nbytes, np.uint8)
            for start, stop in P.chunks(e.nbytes):
                await conn.recv_array(raw[start:stop], kind=P.TENSOR, timeout=self.worker.timeout)
            if checksum(raw) != e.sha256:
                raise DllamaError(f"tensor {e.name} arrived corrupted (checksum mismatch)")
            self.worker.cache.store(e, raw)
            tensors[e.name] = packed_for_kernels(e.name, from_bytes(e, raw, e.name in vectors))
        weights = ShardWeights.from_tensors(tensors)
        model = ShardModel(config, shard, weights, setup.ctx_size, projection, setup.slots, setup.kv_positions)
        log.info("session %s: %d tensors (%d from cache), %.1f MB of weights", self.session_id, len(setup.manifest),
                 len(setup.manifest) - len(missing), weights.nbytes / 1e6)
        return model, len(setup.manifest) - len(missing)

    async def _serve_steps(self, node: NodeStep, setup: M.Setup) -> None:
        conn, dim = self.conn, setup.config.dim
        while True:
            # no deadline for the next step: a user may think for minutes. The connection's
            # watchdog still fails a root that stops sending anything, heartbeats included.
            _kind, body = await self._recv((P.FORWARD,), None, "FORWARD")
            step = M.check_forward(M.decode(P.FORWARD, Step, body), setup)
            x = np.empty((step.n, dim), np.float32)
            await conn.recv_array(x, kind=P.ACTIVATIONS, timeout=self.worker.timeout)
            if not np.isfinite(x).all():
                raise InvalidMessage(f"invalid {P.ACTIVATIONS.name}: not every value is finite (NaN or infinity)")
            stats0 = self.group.stats
            t0 = time.perf_counter()
            summaries = await node.run(x, step)
            stats = self.group.stats
            await conn.send_msg(P.RESULT, M.to_wire(M.Result(
                [s.to_wire() for s in summaries],
                M.StepFigures(step_s=time.perf_counter() - t0, sync_s=stats.seconds - stats0.seconds,
                              sent=stats.bytes_sent - stats0.bytes_sent, recv=stats.bytes_recv - stats0.bytes_recv,
                              rss_mb=rss_mb()))))


async def serve(host: str, port: int, *, threads: int | None, secret: str | None, cache_dir, timeout: float,
                max_memory: int | None = None, setup_timeout: float = SETUP_TIMEOUT, announce=None,
                advertise_as: str | None = None) -> None:
    """Run a worker until SIGINT/SIGTERM. `announce(host, port)` is called once it listens;
    with `advertise_as` (a node name) it is announced on the LAN by mDNS too."""
    worker = Worker(threads=threads, secret=secret, cache_dir=cache_dir, timeout=timeout, max_memory=max_memory,
                    setup_timeout=setup_timeout)
    addr = await worker.start(host, port)
    if announce is not None:
        announce(*addr)
    advertiser = None
    if advertise_as is not None:
        advertiser = Advertiser(advertise_as, host, addr[1], threads=threads or 1, secret=secret is not None,
                                memory=worker.memory_budget, version=__version__)
        await advertiser.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if advertiser is not None:
            await advertiser.close()  # its goodbye tells the roots at once
        await worker.close()
