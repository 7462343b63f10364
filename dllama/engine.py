"""The root's view of the model: feed tokens, get logit summaries back.

`Engine` is what generation, chat, perplexity and the API server talk to; whether the model runs
on this process alone (`LocalEngine`) or across a cluster (`dllama.cluster`) is hidden behind it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow
from .gguf_model import GGUFModel
from .model import ShardModel, ShardWeights
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


class Engine:
    """Holds the KV cache position. Subclasses implement `_forward`."""

    config: ModelConfig
    ctx_size: int
    n_nodes: int = 1
    sync: SyncConfig = SyncConfig()

    failed: str | None = None  # why the engine cannot serve any more (a cluster that lost its nodes)

    def __init__(self):
        self.events: list[str] = []  # failures and recoveries of a cluster, for logs, /health and /metrics
        self.context: list[int] = []  # the tokens in the KV cache, in order
        self.stats = StepStats()
        self.lock = asyncio.Lock()  # one generation at a time drives the engine

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
            out += await self._forward(chunk, Step.of(self.n_cached, len(chunk), params, recent, chunk_targets,
                                                      want_logits))
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
        pass


def _run_to_end(coroutine):
    """Run a coroutine that never suspends (a forward pass without a network all-reduce)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a local forward pass tried to wait on something")


class LocalEngine(Engine):
    """The whole model in this process: one shard holding everything."""

    def __init__(self, model: GGUFModel, ctx_size: int, sync: SyncConfig = SyncConfig()):
        super().__init__()
        self.config = model.config
        self.sync = sync
        self.embedding: Matrix = model.matrix("token_embd.weight")
        shard = Plan.single(self.config).shards[0]
        # f64: the same float64 partial sums a cluster in f64 sync computes, for identical results;
        # either mode is the 1-node result on one node
        model = ShardModel(self.config, shard, ShardWeights.from_gguf(model, shard), ctx_size,
                           Reduce(wide=sync.dtype == "f64"))
        self.model = model
        self.node = NodeStep(model, None, None)  # a node without a group: its sync points are no-ops
        self.ctx_size = model.ctx_size
        # numba's thread count is per calling thread: hand ours (set_threads) to the compute thread
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="dllama-compute",
                                           initializer=numba.set_num_threads, initargs=(numba.get_num_threads(),))

    async def _forward(self, tokens, step):
        # in a thread, so that the event loop (an API server's health checks, a client's
        # disconnect) stays responsive during a long step; the kernels release the GIL. Always
        # the same thread: OpenMP keeps a team of workers per calling thread.
        return await asyncio.get_running_loop().run_in_executor(self._compute, self._forward_sync, tokens, step)

    async def close(self) -> None:
        self._compute.shutdown(wait=False)

    def _forward_sync(self, tokens, step):
        t0 = time.perf_counter()
        x = self.embedding.row_values(np.asarray(tokens))
        summaries = _run_to_end(self.node.run(x, step))
        self.stats.compute_s += time.perf_counter() - t0
        return [[s] for s in summaries]
