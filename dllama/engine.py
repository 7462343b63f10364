"""The root's view of the model: feed tokens, get logit summaries back.

`Engine` is what generation, chat, perplexity and the API server talk to; whether the model runs
on this process alone (`LocalEngine`) or across a cluster (`dllama.cluster`) is hidden behind it.

One threading model on every node: a node computes on the thread that runs its network loop,
so a step's sync points are awaited where the kernels run (no thread hop per layer). A worker's
main loop is that thread; the root's engine runs its own (`ComputeThread`), and the front end
(chat, the API server) hands it each step once, its own loop staying responsive meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numba
import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow
from .gguf_model import GGUFModel
from .model import ShardModel, ShardWeights
from .net.loop import new_event_loop
from .plan import Plan
from .projection import Reduce
from .sampling import LogitSummary, SamplingParams
from .step import PREFILL_CHUNK, NodeStep, Step
from .sync_config import SyncConfig
from .weights import Matrix


@dataclass
class StepStats:
    """Cumulative counters; generation reports differences of two snapshots."""

    compute_s: float = 0.0
    sync_s: float = 0.0
    bytes_sent: int = 0
    bytes_recv: int = 0

    def copy(self) -> "StepStats":
        return StepStats(self.compute_s, self.sync_s, self.bytes_sent, self.bytes_recv)

    def __sub__(self, other: "StepStats") -> "StepStats":
        return StepStats(self.compute_s - other.compute_s, self.sync_s - other.sync_s,
                         self.bytes_sent - other.bytes_sent, self.bytes_recv - other.bytes_recv)


class ComputeThread:
    """The root's compute thread: its own event loop, on which the engine's steps (and a cluster's
    connections) run. Always the same thread: OpenMP keeps a team of workers per calling thread,
    and numba's thread count is per calling thread (the creator's is handed over)."""

    def __init__(self):
        self.loop = new_event_loop()
        self._stopping = False
        threads = numba.get_num_threads()
        self._thread = threading.Thread(target=self._main, args=(threads,), name="dllama-compute", daemon=True)
        self._thread.start()

    def _main(self, threads: int) -> None:
        numba.set_num_threads(threads)
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def run(self, coroutine):
        """Await `coroutine` on the compute loop; cancelling the wait cancels it there."""
        if self.stopped:
            coroutine.close()
            raise RuntimeError("the engine is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive() or self._stopping

    def stop(self) -> None:
        if not self.stopped:
            self._stopping = True
            self.loop.call_soon_threadsafe(self.loop.stop)


class Engine:
    """Holds the KV cache position. Subclasses implement `_forward`, which runs on the compute
    thread, like anything else of theirs that touches the model or the network."""

    config: ModelConfig
    ctx_size: int
    n_nodes: int = 1
    sync: SyncConfig = SyncConfig()
    sync_choice: dict | None = None  # --sync-mode auto on a cluster: what it settled on, and the figures why

    failed: str | None = None  # why the engine cannot serve any more (a cluster that lost its nodes)

    def __init__(self):
        self.events: list[str] = []  # failures and recoveries of a cluster, for logs, /health and /metrics
        self.context: list[int] = []  # the tokens in the KV cache, in order
        self.stats = StepStats()
        self.lock = asyncio.Lock()  # one generation at a time drives the engine
        self.compute = ComputeThread()

    async def feed(self, tokens: list[int], params: SamplingParams, recent: list[int] = (),
                   targets: list[int] | None = None) -> list[list[LogitSummary]]:
        """Append tokens to the context. Returns, for the last position (or with `targets`, one
        per token: the token that follows it, for every position), one summary per node."""
        if self.n_cached + len(tokens) > self.ctx_size:
            raise ContextOverflow(f"{self.n_cached + len(tokens)} tokens do not fit the context of {self.ctx_size}")
        out: list[list[LogitSummary]] = []
        for i in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[i:i + PREFILL_CHUNK]
            chunk_targets = None if targets is None else targets[i:i + len(chunk)]
            want_logits = chunk_targets is not None or i + len(chunk) == len(tokens)
            step = Step.of(self.n_cached, len(chunk), params, recent, chunk_targets, want_logits)
            out += await self.compute.run(self._forward(chunk, step))
            self.context += chunk
        return out

    async def warm_up(self) -> None:
        """One throw-away step, so that loading the compiled kernels (on every node) is not
        counted as the first prompt's time."""
        await self.feed([0], SamplingParams(temperature=0.0))
        self.rewind(0)

    @property
    def n_cached(self) -> int:
        return len(self.context)

    def rewind(self, n_tokens: int) -> None:
        """Forget the context after its first n_tokens (the cache is overwritten from there)."""
        del self.context[n_tokens:]

    async def on_request(self) -> None:
        """Called before each generation (a cluster may re-admit workers that came back)."""

    def node_status(self) -> list[dict]:
        """Every node (the root first): {"node": name, "address": "host:port" (None for the root),
        "up", "rank", "share" (of the FFN hidden units, the unit --weights divides), "stats" (its
        figures of the last step, None for the root)}."""
        return [{"node": "root", "address": None, "up": True, "rank": 0, "share": 1.0, "stats": None}]

    async def _forward(self, tokens: list[int], step: Step) -> list[list[LogitSummary]]:
        """Run `step` on `tokens`: per position whose logits it asks for, one summary per node."""
        raise NotImplementedError

    async def close(self) -> None:
        self.compute.stop()


class LocalEngine(Engine):
    """The whole model in this process: one shard holding everything."""

    def __init__(self, model: GGUFModel, ctx_size: int, sync: SyncConfig = SyncConfig()):
        super().__init__()
        self.config = model.config
        self.sync = sync = sync.alone()
        self.embedding: Matrix = model.matrix("token_embd.weight")
        shard = Plan.single(self.config).shards[0]
        # f64: the same float64 partial sums a cluster in f64 sync computes, for identical results;
        # either mode is the 1-node result on one node
        model = ShardModel(self.config, shard, ShardWeights.from_gguf(model, shard), ctx_size,
                           Reduce(wide=sync.dtype == "f64"))
        self.model = model
        self.node = NodeStep(model, None, None)  # a node without a group: its sync points are no-ops
        self.ctx_size = model.ctx_size

    async def _forward(self, tokens, step):
        t0 = time.perf_counter()
        x = self.embedding.row_values(np.asarray(tokens))
        summaries = await self.node.run(x, step)
        self.stats.compute_s += time.perf_counter() - t0
        return [[s] for s in summaries]
