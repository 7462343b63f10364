"""The root of a cluster: plans the split, streams each worker its slices, and runs its own
shard of every step alongside the workers' (`ClusterEngine`, an `Engine` like the local one).

When a worker dies or hangs mid-step, the root (which holds the whole model) re-plans onto the
nodes that still answer, streams them their new slices, replays the context to rebuild the KV
caches, and finishes the step: the caller never sees the failure. With no worker left, the root
carries on alone. A worker that comes back joins again at the start of the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import numpy as np
from tqdm import tqdm

from ..engine import Engine
from ..errors import AuthError, DllamaError, NetworkError, VersionMismatch
from ..gguf_model import GGUFModel
from ..model import ShardModel, ShardWeights, shard_peak_bytes, shard_tensors
from ..net.frames import pack_msg
from ..node import measure_speed, mem_available
from ..plan import Plan, check_fits, kv_cache_bytes
from ..sampling import LogitSummary, SamplingParams
from ..step import PREFILL_CHUNK, NodeStep, Step
from ..sync import init_process_group
from ..sync_config import SyncConfig
from . import messages as M
from . import protocol as P
from .link import WorkerLink, answers
from .slices import make_entry
from .sync_mode import reduce_fits, settle_sync

log = logging.getLogger("dllama.root")

REJOIN_PROBE_EVERY_S = 10.0  # how often requests look for missing workers (each look may wait 1 s)
DISCOVERED_BUSY_WAIT_S = 5.0  # a found worker still "busy" after this serves another root: left out


class ClusterEngine(Engine):
    """Root (rank 0) plus workers (ranks 1..N), one shard each, two sync points per layer."""

    def __init__(self, model: GGUFModel, ctx_size: int, workers: list[tuple[str, int]], *,
                 sync: SyncConfig = SyncConfig(), weights: list[float] | str | None = None,
                 secret: str | None = None, timeout: float = 30.0, spin: float | None = None, progress: bool = True,
                 recover: bool = True, browser=None, slots: int = 1, kv_budget: int | None = None):
        super().__init__(slots, kv_budget)
        self.requested_sync = sync
        self.sync = sync  # settled per session (--sync-mode auto: from the measured links)
        self.sync_choice: dict | None = None  # what auto settled on, and why
        self.model_file = model
        self.config = model.config
        self.ctx_size = ctx_size
        self._set_budget(ctx_size)
        self.addresses = [tuple(a) for a in workers]  # as configured; active ones are in self.workers
        self.workers: list[WorkerLink] = []
        self.requested_weights = weights
        self.secret = secret
        self.timeout = timeout
        self.spin = spin
        self.progress = progress
        self.recover = recover
        self.embedding = model.matrix("token_embd.weight")
        self.plan: Plan | None = None
        self.group = None
        self.node: NodeStep | None = None  # the root's own shard
        self.session = ""
        self.failed: str | None = None  # set when a failure could not be recovered from
        self._last_probe = 0.0
        # --workers auto: the LAN's advertised workers join the configured ones; those the handshake
        # refuses (another version, another secret) are left out for good
        self.browser = browser
        self.discovered: set[tuple[str, int]] = set()
        self.refused: set[tuple[str, int]] = set()

    @property
    def n_nodes(self) -> int:
        return len(self.workers) + 1

    def node_status(self) -> list[dict]:
        """Every configured node and whether it takes part now."""
        active = {w.address: w for w in self.workers}
        status = [{"node": "root", "address": None, "up": True, "rank": 0, "share": self._share(0), "stats": None}]
        for address in self.addresses:
            w = active.get(address)
            name = w.name if w else f"worker ({address[0]}:{address[1]})"
            status.append({"node": name, "address": f"{address[0]}:{address[1]}", "up": w is not None,
                           "rank": w.rank if w else None, "share": self._share(w.rank) if w else 0.0,
                           "stats": w.last_stats if w else None})
        return status

    def _share(self, rank: int) -> float:
        if self.plan is None or rank >= len(self.plan.shards):
            return 0.0
        start, stop = self.plan.shards[rank].ffn
        return (stop - start) / self.config.ffn_dim

    # ------------------------------------------------------------------ building a session

    async def start(self) -> "ClusterEngine":
        """Plan, connect and load the workers (on the compute thread, where the connections live)."""
        try:
            await self.compute.run(self._start())
        except BaseException:
            await self._close_front()
            raise
        return self

    async def _start(self) -> None:
        try:
            self._add_discovered(starting=True)
            await self._build(self.addresses, tolerate_missing=False)  # a configured worker must answer
        except BaseException:
            await self._teardown()
            raise

    def _add_discovered(self, starting: bool = False) -> list[tuple[str, int]]:
        """Usable workers the browser sees that are not configured yet: they are from now on."""
        if self.browser is None:
            return []
        fresh = [ad for ad in self.browser.usable(self.secret)
                 if ad.address not in self.refused and ad.address not in self.addresses]
        for ad in fresh:
            self.addresses.append(ad.address)
            self.discovered.add(ad.address)
            if not starting:  # those found before the start are told by whoever started the search
                self._event(f"found worker {ad.name} at {ad.host}:{ad.port} on the network")
        return [ad.address for ad in fresh]

    async def _build(self, addresses, tolerate_missing: bool, keep_sync: bool = False) -> None:
        """A new session over the workers at `addresses` that answer: plan, settle the sync mode,
        stream slices, form the sync group. An unreachable configured worker is an error, or
        (tolerate_missing) left out; a discovered one that fails in any way is left out. keep_sync
        (a recovery): the mode the session had, where it still fits, so the answer goes on as it began."""
        self.session = uuid.uuid4().hex[:12]
        measure = self.requested_weights == "auto"
        candidates = [WorkerLink(i + 1, h, p, self.timeout) for i, (h, p) in enumerate(addresses)]
        results = await asyncio.gather(*(self._open(w, measure) for w in candidates), return_exceptions=True)
        self.workers = []
        for w, result in zip(candidates, results):
            if isinstance(result, (AuthError, VersionMismatch)) and w.address in self.discovered:
                self._event(f"{w.name} is left out: {result}")  # advertised, but not for this root
                self.addresses.remove(w.address)
                self.refused.add(w.address)
            elif isinstance(result, BaseException):
                # a discovered worker that does not answer, or serves another root, is left out; a
                # configured one only when tolerating (a rejoin or a recovery), and only if unreachable
                found = w.address in self.discovered
                if not isinstance(result, DllamaError if found else NetworkError) or not (tolerate_missing or found):
                    for other in candidates:
                        if other.conn is not None:
                            await other.conn.close()
                    raise result
                self._event(f"{w.name} is not available: {result}")
            else:
                self.workers.append(w)
        for rank, w in enumerate(self.workers, start=1):  # ranks are contiguous among the present
            w.renumber(rank)
        self.plan = Plan.split(self.config, self._node_weights(measure))
        keep = keep_sync and self.workers and (self.sync.mode != "reduce" or reduce_fits(self.model_file,
                                                                                           self.plan.shards))
        if not keep:
            self.sync, self.sync_choice = await settle_sync(self.requested_sync, self.model_file, self.workers,
                                                            self.plan.shards)
        self._check_memory()
        own = self.plan.shards[0]
        manifests = [[(make_entry(name, t), t) for name, t in shard_tensors(self.model_file, shard, self.sync.mode)]
                     for shard in self.plan.shards[1:]]
        total = sum(e.nbytes for m in manifests for e, _ in m)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"sending weights to {len(self.workers)} worker(s)",
                  disable=not self.progress or total == 0) as bar:
            await asyncio.gather(*(w.set_up(self._setup(w, m), m, bar) for w, m in zip(self.workers, manifests)))
        model = ShardModel(self.config, own, ShardWeights.from_gguf(self.model_file, own, self.sync.mode),
                           self.ctx_size, self.sync.projection(self.plan.shards, self.config.head_dim), self.slots,
                           self.kv_budget)
        self.group = None
        if self.workers:
            for w in self.workers:
                await w.conn.send_msg(P.GO, {})
            addrs = [None] + [w.address for w in self.workers]
            self.group = await init_process_group(0, self.n_nodes, addrs, session=self.session, algo=self.sync.algo,
                                                  secret=self.secret, timeout=self.timeout, spin=self.spin)
            for w in self.workers:
                w.ready = (await w.expect(P.READY, M.Ready)).to_wire()
        self.node = NodeStep(model, self.group, self.sync.codec)

    async def _open(self, w: WorkerLink, measure: bool) -> None:
        # a discovered worker still "busy" after a short while serves another root: not waited for
        patience = self.timeout if w.address not in self.discovered else min(self.timeout, DISCOVERED_BUSY_WAIT_S)
        await w.open(session=self.session, secret=self.secret, measure=measure, patience=patience)

    def _node_weights(self, measured: bool) -> list[float]:
        if measured:
            return [measure_speed()] + [w.gmacs for w in self.workers]
        if self.requested_weights is None:
            return [1.0] * self.n_nodes
        weights = list(self.requested_weights)
        if len(weights) == len(self.addresses) + 1 and len(self.workers) < len(self.addresses):
            present = {w.address for w in self.workers}  # keep the shares of the nodes still here
            weights = weights[:1] + [x for a, x in zip(self.addresses, weights[1:]) if a in present]
        if len(weights) != self.n_nodes:
            raise DllamaError(f"--weights has {len(weights)} entries for {self.n_nodes} nodes (root + workers)")
        return weights

    def _check_memory(self) -> None:
        nodes = [("the root", mem_available())] + [(w.name, w.mem_available) for w in self.workers]
        weights = [shard_peak_bytes(self.model_file, shard, self.sync.mode) for shard in self.plan.shards]
        if not self.kv_budget_given and self.kv_used == 0:  # (never under sequences' reservations)
            self._set_budget(self.ctx_size, [(available, w, shard.n_kv_heads) for (_name, available), w, shard
                                             in zip(nodes, weights, self.plan.shards)])
        for (name, available), shard, held in zip(nodes, self.plan.shards, weights):
            check_fits(name, held + kv_cache_bytes(self.config, shard.n_kv_heads, self.kv_budget), available,
                       "add workers, shift --weights, or lower --ctx-size or --kv-budget")

    def _setup(self, w: WorkerLink, manifest) -> M.Setup:
        return M.Setup(session=self.session, rank=w.rank, world=self.n_nodes,
                       addrs=[None] + [x.address for x in self.workers], algo=self.sync.algo,
                       sync_dtype=self.sync.dtype, sync_mode=self.sync.mode, config=M.WireConfig.of(self.config),
                       shards=[M.WireShard.of(s) for s in self.plan.shards], ctx_size=self.ctx_size,
                       slots=self.slots, kv_budget=self.kv_budget,
                       manifest=[e for e, _ in manifest], spin=self.spin)

    async def _teardown(self, reason: str | None = None) -> None:
        """End the session on every worker (they go back to waiting for a root). With a reason
        (a failure), the sync group is aborted first: a worker blocked on a dead peer gives up now."""
        if reason is not None and self.group is not None:
            self.group.abort(reason)
        for w in self.workers:
            await w.end()
        if self.group is not None:
            await self.group.close()
            self.group = None

    # ------------------------------------------------------------------ failures

    def _event(self, message: str) -> None:
        log.warning("%s", message)
        self.events.append(message)

    async def _recover(self, error: Exception, step: Step | None = None) -> None:
        """Re-plan onto the nodes that still answer and rebuild the running sequences' KV caches
        (those of `step` among them), so the failed step can run again."""
        t0 = time.perf_counter()
        self._event(f"{error}; re-planning onto the nodes that still answer")
        self.replans += 1
        await self._teardown(reason=f"the root re-plans after: {error}")
        await self._build([w.address for w in self.workers], tolerate_missing=True, keep_sync=True)
        # the failed step's sequences, and the slots it copies from, whether running or not
        keep = set() if step is None else {s.slot for s in step.seqs} | {c.src for c in step.copies}
        replayed = await self._replay(keep)
        self._event(f"recovered in {time.perf_counter() - t0:.1f} s: {self.n_nodes} node(s), "
                    f"{replayed} token(s) of context replayed")

    async def _replay(self, keep: set[int] = frozenset()) -> int:
        """Rebuild every running sequence's KV cache on a new session's nodes (idle slots kept for
        reuse are forgotten instead); the tokens replayed. The kernels are batch-invariant: any
        chunking rebuilds the caches that were lost, bit for bit."""
        greedy, replayed = SamplingParams(temperature=0.0), 0
        for slot, context in enumerate(self.contexts):
            if self.in_use is not None and slot not in self.in_use and slot not in keep:
                self.release(slot)
                continue
            for position in range(0, len(context), PREFILL_CHUNK):
                n = min(PREFILL_CHUNK, len(context) - position)
                await self._step(context[position:position + n], Step.of(
                    position, n, greedy, want_logits=False, slot=slot, capacity=self.capacities[slot]))
            replayed += len(context)
        return replayed

    async def on_request(self) -> None:
        await self.compute.run(self._rejoin())

    async def _rejoin(self) -> None:
        """Before a request: configured workers that are missing may have come back, and (--workers
        auto) new ones may have appeared; if any, re-plan with them and replay every sequence's cache."""
        fresh = self._add_discovered()
        present = {w.address for w in self.workers}
        missing = [a for a in self.addresses if a not in present and a not in fresh]
        back = []
        if missing and self.recover and time.monotonic() - self._last_probe >= REJOIN_PROBE_EVERY_S:
            self._last_probe = time.monotonic()
            answered = await asyncio.gather(*(answers(a, self.secret) for a in missing))
            back = [a for a, yes in zip(missing, answered) if yes]
        if not back and not fresh:
            return
        self._event(f"{len(back)} worker(s) answer again, {len(fresh)} new; re-planning")
        self.replans += 1
        await self._teardown()
        await self._build([a for a in self.addresses if a in present or a in back or a in fresh],
                          tolerate_missing=True)
        try:
            replayed = await self._replay()  # other sequences may be mid-answer
        except NetworkError as e:  # a node that came back and fell again: re-plan without it
            await self._recover(e)
            return
        self._event(f"re-planned onto {self.n_nodes} node(s), {replayed} token(s) of context replayed")

    # ------------------------------------------------------------------ steps

    async def _forward(self, tokens, step):
        attempts = len(self.addresses) + 1  # each failure costs a node, so this bounds the retries
        failure = None
        while True:
            try:
                if failure is not None:
                    await self._recover(failure, step)
                out = await self._step(tokens, step)
                self.failed = None  # the cluster computes again (workers that came back, re-planned)
                return out
            except NetworkError as e:
                attempts -= 1
                if not self.recover or attempts < 0:
                    self.failed = str(e)
                    raise
                failure = e

    async def _step(self, tokens, step: Step):
        t0 = time.perf_counter()
        sync0 = self.group.stats if self.group is not None else None
        x = self.embedding.row_values(np.asarray(tokens))
        packed = pack_msg(step.to_wire())
        for w in self.workers:
            w.conn.write_frame(P.FORWARD, packed)
            w.conn.write_frame(P.ACTIVATIONS, x)
        own = await self.node.run(x, step)
        replies = await asyncio.gather(*(w.expect(P.RESULT, M.Result) for w in self.workers))
        per_worker = []
        for w, reply in zip(self.workers, replies):
            w.last_stats = M.to_wire(reply.stats)
            per_worker.append([LogitSummary.from_wire(s) for s in reply.summaries])
        elapsed = time.perf_counter() - t0
        if sync0 is not None:
            sync1 = self.group.stats
            self.stats.sync_s += sync1.seconds - sync0.seconds
            self.stats.bytes_sent += sync1.bytes_sent - sync0.bytes_sent
            self.stats.bytes_recv += sync1.bytes_recv - sync0.bytes_recv
            elapsed -= sync1.seconds - sync0.seconds
        self.stats.compute_s += elapsed
        return [[own[i]] + [ws[i] for ws in per_worker] for i in range(len(own))]

    async def close(self) -> None:
        try:
            if not self.compute.stopped:  # (closing twice is harmless)
                await self.compute.run(self._teardown())
        finally:
            await self._close_front()

    async def _close_front(self) -> None:
        """What lives on the front end's loop: the discovery browser; then the compute thread."""
        try:
            if self.browser is not None:
                await self.browser.close()
        finally:
            self.compute.stop()
