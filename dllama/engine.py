"""The root's view of the model: feed tokens, get logit summaries back.

`Engine` is what generation, chat, perplexity and the API server talk to; whether the model runs
on this process alone (`LocalEngine`) or across a cluster (`dllama.cluster`) is hidden behind it.
It keeps each sequence's tokens in a KV cache slot within a budget, and turns the batcher's
`SeqInput`s into a `Step`; where the steps run is `compute_thread`'s."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .compute_thread import CallerCompute, ComputeThread, Preemption
from .config import ModelConfig
from .errors import ContextOverflow, DllamaError
from .gguf_model import GGUFModel
from .kernels.matmul import SPANNED_TOKENS
from .kernels.simd_q8 import TILE_TOKENS
from .kv_cache import round_capacity
from .model import ShardModel, ShardWeights, shard_peak_bytes
from .node import mem_available
from .plan import Plan, check_fits, default_kv_budget, kv_cache_bytes
from .projection import Reduce
from .sampling import LogitSummary, SamplingParams
from .step import PREFILL_CHUNK, Copy, NodeStep, Seq, Step
from .sync_config import SyncConfig
from .weights import Matrix

# the warm-up prompt's tokens: two prefill tiles and one token past them (a strip), and more than take
# the one-token path over long rows: every kernel a prompt runs, not only a decode step's
WARM_UP_TOKENS = max(2 * TILE_TOKENS, SPANNED_TOKENS) + 1


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


@dataclass
class SeqInput:
    """One sequence's part of a step, as the batcher asks for it: tokens to append to the
    sequence in `slot`, and which of their logits to summarize how (see step.Seq)."""

    slot: int
    tokens: list[int]
    params: SamplingParams
    recent: list[int] = ()
    targets: list[int] | None = None
    want_logits: bool = True
    all_logits: bool = False  # every position's (speculation: a draft's verification), not the last one's


class Engine:
    """Holds the sequences' contexts, one per KV cache slot, and what their caches may hold.
    Subclasses implement `_forward`, which runs on the compute thread, like anything else of theirs
    that touches the model or the network."""

    config: ModelConfig
    ctx_size: int
    n_nodes: int = 1
    sync: SyncConfig = SyncConfig()
    sync_choice: dict | None = None  # --sync-mode auto on a cluster: what it settled on, and the figures why

    failed: str | None = None  # why the engine cannot serve any more (a cluster that lost its nodes)
    preempts: bool = False  # whether step(..., preempt=True) may run while another step is in flight
    batcher = None  # the batching.Batcher generating on it, once there is one

    @property
    def paused_s(self) -> float:
        """Seconds steps in flight have waited for preempting ones (where `preempts`), so far."""
        return 0.0

    def __init__(self, slots: int = 1, kv_budget: int | None = None, compute_here: bool = False):
        """slots: sequences that may decode together; kv_budget: positions their KV caches may
        hold in all (at least one whole context; default: each slot a whole context, which a
        cluster lowers to what its nodes' memory holds); compute_here: compute on the caller's
        loop (created there) instead of a thread of the engine's own."""
        self.events: list[str] = []  # failures and recoveries of a cluster, for logs, /health and /metrics
        self.replans = 0  # times a cluster re-planned (a failure, or workers that came back), for /metrics
        self.slots = slots
        self.kv_budget = kv_budget
        self.kv_budget_given: bool | None = None  # set with the budget (a default one fits the nodes' memory)
        self.contexts: list[list[int]] = [[] for _ in range(slots)]  # the tokens in each slot's KV cache
        self.capacities = [0] * slots  # positions each slot's cache holds, on every node
        self._to_free: set[int] = set()  # slots whose caches the next step drops
        self._copies: list[Copy] = []  # prompt starts the next step copies from slot to slot
        self._in_flight: list[Step] = []  # steps sent and not done (two: one preempted, one preempting)
        self.in_use: set[int] | None = None  # slots a batcher is generating in (None: all may be)
        self.stats = StepStats()
        self.compute = CallerCompute() if compute_here else ComputeThread()

    def _set_budget(self, ctx_size: int, nodes: list[tuple[int | None, int, int]] = ()) -> None:
        """Called by subclasses once the context is known; nodes: what default_kv_budget needs
        to fit a default budget (no --kv-budget) into each node's memory."""
        one = round_capacity(ctx_size)
        if self.kv_budget_given is None:
            self.kv_budget_given = self.kv_budget is not None
        if not self.kv_budget_given:
            self.kv_budget = default_kv_budget(self.config, ctx_size, self.slots, nodes)
        self.kv_budget = min(round_capacity(self.kv_budget), one * self.slots)  # (more could never be used)
        if self.kv_budget < one:
            raise DllamaError(f"a KV budget of {self.kv_budget} positions cannot hold one context of {ctx_size}")

    # ------------------------------------------------------------------ the KV cache slots

    @property
    def context(self) -> list[int]:
        """Slot 0's tokens: the one sequence of inference, chat and perplexity."""
        return self.contexts[0]

    @property
    def n_cached(self) -> int:
        return len(self.contexts[0])

    @property
    def kv_used(self) -> int:
        """Positions the slots' caches hold (what counts against the budget)."""
        return sum(self.capacities)

    def _capacity_for(self, slot: int, positions: int) -> int:
        # never smaller than it is: a node only resizes a slot when a step names it, so a shrink
        # the nodes never saw would leave them counting more than the root
        return max(round_capacity(min(positions, self.ctx_size)), self.capacities[slot])

    def fits(self, slot: int, positions: int) -> bool:
        """Whether `slot` can be given room for `positions` within the budget."""
        return self.kv_used - self.capacities[slot] + self._capacity_for(slot, positions) <= self.kv_budget

    def reserve(self, slot: int, positions: int) -> None:
        """Size slot's cache for `positions` (at most the context; a slot never shrinks until it
        is released), keeping its tokens."""
        capacity = self._capacity_for(slot, positions)
        if not self.fits(slot, positions):
            raise ContextOverflow(f"{capacity} positions for slot {slot} do not fit the KV budget of "
                                  f"{self.kv_budget} ({self.kv_used - self.capacities[slot]} in use by the others)")
        del self.contexts[slot][capacity:]
        self.capacities[slot] = capacity

    def release(self, slot: int) -> None:
        """Forget slot's sequence; every node frees its cache with the next step."""
        self.contexts[slot] = []
        self.capacities[slot] = 0
        self._to_free.add(slot)
        self._copies = [c for c in self._copies if c.dst != slot]  # (a copy from it still runs, first)

    @property
    def copy_sources(self) -> set[int]:
        """Slots the next step copies from (not to be evicted or reused before it)."""
        return {c.src for c in self._copies}

    @property
    def copy_targets(self) -> set[int]:
        """Slots the next step copies into (not a source before it)."""
        return {c.dst for c in self._copies}

    @property
    def freeing(self) -> set[int]:
        return set(self._to_free)

    def share_prefix(self, src: int, dst: int, n: int, upcoming: list[int] = ()) -> None:
        """dst (reserved) takes src's first n tokens and their cache, copied on every node with
        the next step, layer by layer after its keys and values: src may be computing some of the
        n in that step (`upcoming`, the tokens it appends then)."""
        have = self.contexts[src] + list(upcoming)
        if not n <= min(len(have), self.capacities[dst]):
            raise ValueError(f"cannot copy {n} positions from slot {src} into slot {dst}")
        self.contexts[dst] = have[:n]
        # a copy into dst asked before and not yet made is superseded: this one writes a longer start of
        # the same prompt (a request admitted with one slot's start, then a leader's longer one), and a
        # step copies into a slot once (a worker refuses a step that copies into one twice)
        self._copies = [c for c in self._copies if c.dst != dst]
        self._copies.append(Copy(src=src, dst=dst, n=n, capacity=self.capacities[dst]))

    def rewind(self, n_tokens: int, slot: int = 0) -> None:
        """Forget slot's context after its first n_tokens (the cache is overwritten from there)."""
        del self.contexts[slot][n_tokens:]

    # ------------------------------------------------------------------ steps

    async def step(self, seqs: list[SeqInput], preempt: bool = False) -> list[list[list[LogitSummary]]]:
        """One forward pass over several sequences' tokens (each slot at most once, within its
        capacity). Per sequence: for each position whose logits it asks, one summary per node.
        preempt (where `preempts`): run now, the step in flight waiting meanwhile; it must name
        none of that step's slots. It carries the frees and copies asked since that one was sent."""
        if preempt and not self.preempts:
            raise ValueError(f"{type(self).__name__} runs one step at a time")
        busy = {q.slot for other in self._in_flight for q in other.seqs} & {s.slot for s in seqs}
        if busy:
            raise ValueError(f"slots {sorted(busy)} are in a step in flight")
        wire, tokens = [], []
        for s in seqs:
            start = len(self.contexts[s.slot])
            if start + len(s.tokens) > self.capacities[s.slot]:
                raise ContextOverflow(f"{start + len(s.tokens)} tokens do not fit the "
                                      f"{self.capacities[s.slot]} positions reserved for slot {s.slot}")
            wire.append(Seq.of(s.slot, start, len(s.tokens), self.capacities[s.slot], s.params, s.recent,
                               s.targets, s.want_logits, s.all_logits))
            tokens += s.tokens
        sent_free = {slot for other in self._in_flight for slot in other.free}
        sent_copies = [c for other in self._in_flight for c in other.copies]
        step = Step(wire, sorted(self._to_free - sent_free),
                    [c for c in self._copies if not any(c is d for d in sent_copies)])
        self._in_flight.append(step)
        try:
            flat = await self._run(tokens, step, preempt)
        finally:
            self._in_flight.remove(step)
        self._to_free.difference_update(step.free)
        self._copies = [c for c in self._copies if not any(c is d for d in step.copies)]
        out, at = [], 0
        for s, w in zip(seqs, wire):
            self.contexts[s.slot] += s.tokens
            out.append(flat[at:at + w.n_summaries])
            at += w.n_summaries
        return out

    async def _run(self, tokens: list[int], step: Step, preempt: bool) -> list[list[LogitSummary]]:
        return await self.compute.run(self._forward(tokens, step))

    async def feed(self, tokens: list[int], params: SamplingParams, recent: list[int] = (),
                   targets: list[int] | None = None, slot: int = 0) -> list[list[LogitSummary]]:
        """Append tokens to one sequence (its cache grown as needed). Returns, for the last
        position (or with `targets`, one per token: the token that follows it, for every
        position), one summary per node."""
        have = len(self.contexts[slot])
        if have + len(tokens) > self.ctx_size:
            raise ContextOverflow(f"{have + len(tokens)} tokens do not fit the context of {self.ctx_size}")
        if have + len(tokens) > self.capacities[slot]:  # doubling: a few copies over a whole context
            doubled = max(have + len(tokens), 2 * self.capacities[slot])
            self.reserve(slot, doubled if self.fits(slot, doubled) else have + len(tokens))
        out: list[list[LogitSummary]] = []
        for i in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[i:i + PREFILL_CHUNK]
            chunk_targets = None if targets is None else targets[i:i + len(chunk)]
            want_logits = chunk_targets is not None or i + len(chunk) == len(tokens)
            [summaries] = await self.step([SeqInput(slot, chunk, params, recent, chunk_targets, want_logits)])
            out += summaries
        return out

    async def warm_up(self) -> None:
        """Throw-away steps of a few tokens and of one, so that loading the compiled kernels (on
        every node), or compiling those a prompt needs that were not compiled at install (another
        weight format's), is done while loading and not counted in the first prompt's time."""
        for n in (min(WARM_UP_TOKENS, self.ctx_size), 1):
            await self.feed([0] * n, SamplingParams(temperature=0.0))
            self.rewind(0)

    async def on_request(self) -> None:
        """Called before each generation (a cluster may re-admit workers that came back)."""

    def node_status(self) -> list[dict]:
        """Every node (the root first): {"node": name, "address": "host:port" (None for the root),
        "up", "rank", "share" (of the FFN hidden units, the unit --weights divides), "stats" (its
        figures of the last step, None for the root)}."""
        return [{"node": "root", "address": None, "up": True, "rank": 0, "share": 1.0, "stats": None}]

    async def _forward(self, tokens: list[int], step: Step) -> list[list[LogitSummary]]:
        """Run `step` on `tokens`: per position whose logits it asks for (sequence after
        sequence), one summary per node."""
        raise NotImplementedError

    async def close(self) -> None:
        self.compute.stop()


class LocalEngine(Engine):
    """The whole model in this process: one shard holding everything. On its own compute thread
    (not compute_here) its steps can be preempted (Engine.preempts)."""

    def __init__(self, model: GGUFModel, ctx_size: int, sync: SyncConfig = SyncConfig(), slots: int = 1,
                 kv_budget: int | None = None, compute_here: bool = False):
        super().__init__(slots, kv_budget, compute_here)
        self.config = model.config
        shard = Plan.single(self.config).shards[0]
        # the model and its KV cache must fit this machine's memory (its cgroups' limits too), as a
        # cluster's root checks every node's: else the kernel would kill this process while it loads
        held, available = shard_peak_bytes(model, shard), mem_available()
        self._set_budget(ctx_size, [(available, held, shard.n_kv_heads)])
        check_fits("this node", held + kv_cache_bytes(self.config, shard.n_kv_heads, self.kv_budget), available,
                   "run it across workers with --workers, or lower --ctx-size or --kv-budget")
        self.sync = sync = sync.alone()
        self.embedding: Matrix = model.matrix("token_embd.weight")
        # f64: the same float64 partial sums a cluster in f64 sync computes, for identical results;
        # either mode is the 1-node result on one node
        model = ShardModel(self.config, shard, ShardWeights.from_gguf(model, shard), ctx_size,
                           Reduce(wide=sync.dtype == "f64"), slots, self.kv_budget)
        self.model = model
        self.preempts = not compute_here
        self.preemption = Preemption()
        # a node without a group: its sync points only wait for a preempting step, whose own never do
        self.node = NodeStep(model, None, None, self.preemption)
        self._preempting_node = NodeStep(model, None, None)
        self.ctx_size = model.ctx_size

    @property
    def paused_s(self) -> float:
        return self.preemption.paused_s

    async def _run(self, tokens, step, preempt):
        if not preempt:
            return await super()._run(tokens, step, preempt)
        return await self.compute.run(self._forward(tokens, step, self._preempting_node), self.preemption)

    async def _forward(self, tokens, step, node: NodeStep | None = None):
        t0 = time.perf_counter()
        paused0 = self.preemption.paused_s
        x = self.embedding.row_values(np.asarray(tokens))
        summaries = await (node or self.node).run(x, step)
        # (a preempted step's wall time holds the preempting one's, which counts its own)
        self.stats.compute_s += time.perf_counter() - t0 - (self.preemption.paused_s - paused0)
        return [[s] for s in summaries]
