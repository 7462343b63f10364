"""The root of a cluster: plans the split, streams each worker its slices, and runs its own
shard of every step alongside the workers' (`ClusterEngine`, an `Engine` like the local one)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..errors import DllamaError, NetworkError
from ..gguf_model import GGUFModel
from ..engine import Engine
from ..model import ShardModel, ShardWeights, shard_tensors
from ..net import connect
from ..net.frames import pack_msg
from ..plan import Plan
from ..sampling import LogitSummary
from ..sync import init_process_group
from ..sync.group import DEFAULT_SPIN
from . import protocol as P
from .node import NodeStep, measure_speed, mem_available
from .slices import make_entry, tensor_bytes

log = logging.getLogger("dllama.root")


@dataclass
class WorkerInfo:
    rank: int
    host: str
    port: int
    conn: object = None
    gmacs: float | None = None
    mem_available: int | None = None
    ready: dict | None = None
    last_stats: dict | None = None

    @property
    def name(self) -> str:
        return f"worker {self.rank} ({self.host}:{self.port})"


def parse_address(text: str, default_port: int = 9998) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise DllamaError(f"bad worker address {text!r}: expected HOST:PORT") from None


class ClusterEngine(Engine):
    """Root (rank 0) plus workers (ranks 1..N), one shard each, two all-reduces per layer."""

    def __init__(self, model: GGUFModel, ctx_size: int, workers: list[tuple[str, int]], *, algo: str = "auto",
                 sync_dtype: str = "f32", weights: list[float] | str | None = None, secret: str | None = None,
                 timeout: float = 30.0, spin: float | None = None, progress: bool = True):
        super().__init__()
        if sync_dtype not in P.CODEC_OF_SYNC_DTYPE:
            raise DllamaError(f"unknown sync dtype {sync_dtype!r} ({', '.join(P.CODEC_OF_SYNC_DTYPE)})")
        self.model_file = model
        self.config = model.config
        self.ctx_size = ctx_size
        self.workers = [WorkerInfo(i + 1, h, p) for i, (h, p) in enumerate(workers)]
        self.n_nodes = len(workers) + 1
        self.sync_name = algo
        self.sync_dtype = sync_dtype
        self.requested_weights = weights
        self.secret = secret
        self.timeout = timeout
        self.spin = DEFAULT_SPIN if spin is None else spin
        self.progress = progress
        self.embedding = model.matrix("token_embd.weight")
        self.plan: Plan | None = None
        self.group = None
        self.step: NodeStep | None = None
        self.session = uuid.uuid4().hex[:12]

    # ------------------------------------------------------------------ start-up

    async def start(self) -> "ClusterEngine":
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def _start(self) -> None:
        measure = self.requested_weights == "auto"
        await asyncio.gather(*(self._connect(w, measure) for w in self.workers))
        self.plan = Plan.split(self.config, self._node_weights(measure))
        self._check_memory()
        own = self.plan.shards[0]
        manifests = [[(make_entry(name, t), t) for name, t in shard_tensors(self.model_file, shard)]
                     for shard in self.plan.shards[1:]]
        total = sum(e.nbytes for m in manifests for e, _ in m)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"sending weights to {len(self.workers)} worker(s)",
                  disable=not self.progress or total == 0) as bar:
            await asyncio.gather(*(self._send_setup(w, s, m, bar)
                                   for w, s, m in zip(self.workers, self.plan.shards[1:], manifests)))
        model = ShardModel(self.config, own, ShardWeights.from_gguf(self.model_file, own), self.ctx_size,
                           wide_partials=self.sync_dtype == "f64")
        for w in self.workers:
            await w.conn.send_msg(P.GO, {})
        addrs = [None] + [(w.host, w.port) for w in self.workers]
        self.group = await init_process_group(0, self.n_nodes, addrs, session=self.session, algo=self.sync_name,
                                              secret=self.secret, timeout=self.timeout, spin=self.spin)
        self.step = NodeStep(model, self.group, self.sync_dtype)
        for w in self.workers:
            _kind, w.ready = await self._expect(w, P.READY)
        self.group.reset_stats()

    async def _connect(self, w: WorkerInfo, measure: bool) -> None:
        w.conn = await connect(w.host, w.port, role="control", secret=self.secret, peer_rank=w.rank,
                               timeout=self.timeout, heartbeat=self.timeout / 4, session=self.session,
                               max_frame=P.TENSOR_CHUNK + (1 << 20))
        await w.conn.send_msg(P.PROBE, {"measure": measure})
        _kind, probed = await self._expect(w, P.PROBED, timeout=max(self.timeout, 60.0))
        w.gmacs, w.mem_available = probed.get("gmacs"), probed.get("mem_available")

    def _node_weights(self, measured: bool) -> list[float]:
        if measured:
            return [measure_speed()] + [w.gmacs for w in self.workers]
        if self.requested_weights is None:
            return [1.0] * self.n_nodes
        weights = list(self.requested_weights)
        if len(weights) != self.n_nodes:
            raise DllamaError(f"--weights has {len(weights)} entries for {self.n_nodes} nodes (root + workers)")
        return weights

    def _check_memory(self) -> None:
        nodes = [("the root", mem_available())] + [(w.name, w.mem_available) for w in self.workers]
        for (name, available), shard in zip(nodes, self.plan.shards):
            weights = sum(t.nbytes for _name, t in shard_tensors(self.model_file, shard))
            kv_cache = 2 * self.config.n_layers * shard.n_kv_heads * self.config.head_dim * self.ctx_size * 2
            if available is not None and weights + kv_cache > available:
                raise DllamaError(f"model too big for the plan: {name} needs {(weights + kv_cache) / 1e6:.0f} MB "
                                  f"for its slice and KV cache but has {available / 1e6:.0f} MB available "
                                  "(add workers, shift --weights, or lower --ctx-size)")

    async def _send_setup(self, w: WorkerInfo, shard, manifest, bar) -> None:
        setup = {"session": self.session, "rank": w.rank, "world": self.n_nodes,
                 "addrs": [None] + [[x.host, x.port] for x in self.workers], "algo": self.sync_name,
                 "sync_dtype": self.sync_dtype, "config": self.config.to_dict(), "shard": shard.to_dict(),
                 "ctx_size": self.ctx_size, "spin": self.spin, "manifest": [e.to_dict() for e, _ in manifest]}
        await w.conn.send_msg(P.SETUP, setup)
        _kind, need = await self._expect(w, P.NEED)
        wanted = set(need.get("names", []))
        for entry, tensor in manifest:
            if entry.name not in wanted:
                bar.update(entry.nbytes)
                continue
            raw = tensor_bytes(tensor)
            for start, stop in P.chunks(entry.nbytes):
                await w.conn.send_array(raw[start:stop], kind=P.TENSOR)
                bar.update(stop - start)
        await self._expect(w, P.LOADED, timeout=max(self.timeout, 120.0))

    async def _expect(self, w: WorkerInfo, kind, timeout: float | None = None):
        got, msg = await w.conn.recv_msg((kind, P.FAILED), timeout=timeout or self.timeout)
        if got == P.FAILED.name:
            raise DllamaError(f"{w.name}: {msg.get('error', 'failed')}")
        return got, msg

    # ------------------------------------------------------------------ steps

    async def _forward(self, tokens, start, params, recent, targets, want_logits):
        t0 = time.perf_counter()
        sync0 = self.group.stats
        x = self.embedding.row_values(np.asarray(tokens))
        logits = "none" if not want_logits else ("all" if targets is not None else "last")
        msg = {"start": start, "n": len(tokens), "logits": logits, "params": params.to_dict(),
               "recent": list(recent), "targets": targets}
        packed = pack_msg(msg)
        for w in self.workers:
            w.conn.write_frame(P.FORWARD, packed)
            w.conn.write_frame(P.ACTIVATIONS, x)
        own = await self.step.run(x, start, logits, params, list(recent), targets)
        replies = await asyncio.gather(*(self._expect(w, P.RESULT) for w in self.workers))
        per_worker = []
        for w, (_kind, reply) in zip(self.workers, replies):
            w.last_stats = reply.get("stats")
            per_worker.append([LogitSummary.from_wire(s) for s in reply["summaries"]])
        sync1 = self.group.stats
        elapsed = time.perf_counter() - t0
        self.stats.sync_s += sync1.seconds - sync0.seconds
        self.stats.compute_s += elapsed - (sync1.seconds - sync0.seconds)
        self.stats.bytes_sent += sync1.bytes_sent - sync0.bytes_sent
        self.stats.bytes_recv += sync1.bytes_recv - sync0.bytes_recv
        return [[own[i]] + [ws[i] for ws in per_worker] for i in range(len(own))]

    async def close(self) -> None:
        for w in self.workers:
            if w.conn is not None and not w.conn.closed:
                try:
                    await w.conn.send_msg(P.END, {})
                except NetworkError:
                    pass
                await w.conn.close()
        if self.group is not None:
            await self.group.close()
            self.group = None
