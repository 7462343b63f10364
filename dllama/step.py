"""One forward step, the unit every node runs, and how a node runs it.

The root's engine cuts prompts and answers into steps; a step says which positions of which
sequences run (several sequences share a step when they decode together, each with its KV cache
in its own slot), which logits come back and how to summarize them. The root sends it to each
worker as the FORWARD message (`to_wire` / `from_wire`, its embeddings following as raw
activations) and runs its own shard of it with the same `NodeStep`; a node alone (LocalEngine) is
a NodeStep without a group.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import numpy as np
from msgspec import Meta

from .errors import ContextOverflow
from .kv_cache import MAX_SLOTS, POSITION_STEP, round_capacity
from .model import ShardModel, Span
from .sampling import MAX_CANDIDATES, MAX_TEMPERATURE, REPEAT_PENALTY_RANGE, LogitSummary, SamplingParams, summarize
from .wire import InvalidMessage, WireStruct, finite

PREFILL_CHUNK = 256  # tokens per step while reading a prompt (bounds activation memory)
MAX_CTX = 1 << 22  # tokens of context a message may name (the memory check bounds it far lower)
MAX_STEP_TOKENS = PREFILL_CHUNK  # a step's working set grows with its tokens (attention: n^2)

TokenId = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]


class StepSampling(WireStruct):
    """SamplingParams as the nodes use them (the seed stays with the root's sampler)."""

    temperature: Annotated[float, Meta(ge=0, le=MAX_TEMPERATURE)]
    top_k: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
    top_p: Annotated[float, Meta(ge=0, le=1)]
    repeat_penalty: Annotated[float, Meta(ge=REPEAT_PENALTY_RANGE[0], le=REPEAT_PENALTY_RANGE[1])]
    repeat_last_n: Annotated[int, Meta(ge=0, le=MAX_CTX)]

    def __post_init__(self):
        finite("temperature", self.temperature)
        finite("repeat_penalty", self.repeat_penalty)

    @classmethod
    def of(cls, params: SamplingParams) -> "StepSampling":
        # a node keeps at most MAX_CANDIDATES per position whatever top_k says: send what it uses, so
        # any top_k a user may ask for stays within the schema
        return cls(float(params.temperature), min(int(params.top_k), MAX_CANDIDATES), float(params.top_p),
                   float(params.repeat_penalty), int(params.repeat_last_n))

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n)


class Seq(WireStruct):
    """One sequence's part of a step: n tokens at positions start.. of the sequence in `slot`, whose
    KV cache must hold `capacity` positions (resized first if it holds another number); the
    logits of no position, the last one or all of them ("none" | "last" | "all") summarized with
    `params` (and `recent` for the repetition penalty; `targets`, for perplexity, the token that
    follows each position)."""

    slot: Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
    start: Annotated[int, Meta(ge=0, lt=MAX_CTX)]
    n: Annotated[int, Meta(ge=1, le=MAX_STEP_TOKENS)]
    capacity: Annotated[int, Meta(ge=POSITION_STEP, le=MAX_CTX, multiple_of=POSITION_STEP)]
    logits: Literal["none", "last", "all"]
    params: StepSampling
    recent: Annotated[list[TokenId], Meta(max_length=MAX_CTX)] = []
    targets: Optional[Annotated[list[TokenId], Meta(max_length=MAX_CTX)]] = None

    @classmethod
    def of(cls, slot: int, start: int, n: int, capacity: int, params: SamplingParams, recent=(), targets=None,
           want_logits: bool = True, all_logits: bool = False) -> "Seq":
        logits = "none" if not want_logits else ("all" if targets is not None or all_logits else "last")
        return cls(slot=slot, start=start, n=n, capacity=capacity, logits=logits, params=StepSampling.of(params),
                   recent=list(recent), targets=None if targets is None else list(targets))

    @property
    def span(self) -> Span:
        return Span(self.slot, self.start, self.n)

    @property
    def n_summaries(self) -> int:
        return {"none": 0, "last": 1, "all": self.n}[self.logits]


class Copy(WireStruct):
    """Slot dst, sized to `capacity`, takes the first n positions of slot src's cache: a prompt
    that starts as another sequence does takes that start's keys and values instead of
    computing them (the same tokens give the same bits). Made layer by layer, once the step's new
    keys and values are written: src may be computing them in the same step (requests that
    arrive together share their system prompt in their first step)."""

    src: Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
    dst: Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
    n: Annotated[int, Meta(ge=1, le=MAX_CTX)]
    capacity: Annotated[int, Meta(ge=POSITION_STEP, le=MAX_CTX, multiple_of=POSITION_STEP)]


class Step(WireStruct):
    """One forward pass over the tokens of one or more sequences (their embeddings follow, one
    sequence after another), after the caches of the slots in `free` are dropped, with the
    `copies` made in each layer before its attention (none reads a slot freed or copied into by
    the same step, nor writes positions a sequence of the step computes)."""

    seqs: Annotated[list[Seq], Meta(min_length=1, max_length=MAX_SLOTS)]
    free: Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]], Meta(max_length=MAX_SLOTS)] = []
    copies: Annotated[list[Copy], Meta(max_length=MAX_SLOTS)] = []

    @classmethod
    def of(cls, start: int, n: int, params: SamplingParams, recent=(), targets=None, want_logits: bool = True,
           slot: int = 0, capacity: int | None = None) -> "Step":
        """A step of one sequence (by default in slot 0, with room for its tokens)."""
        capacity = round_capacity(start + n) if capacity is None else capacity
        return cls([Seq.of(slot, start, n, capacity, params, recent, targets, want_logits)])

    @property
    def n(self) -> int:
        return sum(s.n for s in self.seqs)

    def check(self, ctx_size: int, n_slots: int, dim: int, vocab_size: int, max_activation_bytes: int,
              kind: str) -> "Step":
        """The checks that need the session: the slots, the context, the vocabulary, the activations' frame."""
        if self.n > MAX_STEP_TOKENS:
            raise InvalidMessage(f"invalid {kind}: {self.n} tokens in one step, more than {MAX_STEP_TOKENS}")
        if self.n * dim * 4 > max_activation_bytes:
            raise InvalidMessage(f"invalid {kind}: n {self.n} tokens of dim {dim} exceed an activations frame")
        slots = [s.slot for s in self.seqs]
        if len(set(slots)) != len(slots):
            raise InvalidMessage(f"invalid {kind}: a slot appears twice in seqs {slots}")
        for i, seq in enumerate(self.seqs):
            where = f"invalid {kind}: seqs[{i}]"
            if seq.slot >= n_slots:
                raise InvalidMessage(f"{where}: slot {seq.slot} is outside the session's {n_slots} slots")
            if seq.capacity > round_capacity(ctx_size):
                raise InvalidMessage(f"{where}: a capacity of {seq.capacity} exceeds the context of {ctx_size}")
            if seq.start + seq.n > seq.capacity:
                raise InvalidMessage(f"{where}: positions {seq.start}..{seq.start + seq.n - 1} are outside its "
                                     f"capacity of {seq.capacity}")
            for name, ids in (("recent", seq.recent), ("targets", seq.targets or ())):
                if ids and max(ids) >= vocab_size:
                    raise InvalidMessage(f"{where}: {name} holds token id {max(ids)}, outside the vocabulary of "
                                         f"{vocab_size}")
            if seq.targets is not None and (seq.logits != "all" or len(seq.targets) != seq.n):
                raise InvalidMessage(f"{where}: targets must come with logits 'all', one per token (got "
                                     f"{len(seq.targets)} for n {seq.n}, logits {seq.logits!r})")
        if any(slot >= n_slots for slot in self.free):
            raise InvalidMessage(f"invalid {kind}: free names a slot outside the session's {n_slots} slots")
        for i, c in enumerate(self.copies):
            where = f"invalid {kind}: copies[{i}]"
            if c.src >= n_slots or c.dst >= n_slots or c.src == c.dst:
                raise InvalidMessage(f"{where}: slots {c.src} -> {c.dst} are not two of the session's {n_slots}")
            if not c.n <= c.capacity <= round_capacity(ctx_size):
                raise InvalidMessage(f"{where}: {c.n} positions into a capacity of {c.capacity} (context {ctx_size})")
            if c.src in self.free or c.src in {d.dst for d in self.copies}:
                raise InvalidMessage(f"{where}: slot {c.src} is freed or copied into by the same step")
            if any(q.slot == c.dst and q.capacity != c.capacity for q in self.seqs):
                raise InvalidMessage(f"{where}: slot {c.dst} is sized {c.capacity} here and otherwise in seqs")
            if any(q.slot == c.dst and q.start < c.n for q in self.seqs):
                raise InvalidMessage(f"{where}: slot {c.dst} computes positions below the {c.n} copied into it")
        if len({c.dst for c in self.copies}) != len(self.copies):
            raise InvalidMessage(f"invalid {kind}: a slot is copied into twice")
        return self


class NodeStep:
    """Runs steps on one node's shard. Also the model's `Collectives`: its sync points go through
    the node's process group, or nowhere when it runs alone (group None)."""

    def __init__(self, model: ShardModel, group, codec: str | None, preemption=None):
        """preemption (compute_thread.Preemption, a node alone): its sync points wait for preempting steps."""
        self.model = model
        self.group = group
        self.codec = codec
        self.preemption = preemption

    async def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        if self.group is None:
            if self.preemption is not None:
                await self.preemption.wait()
            return partial
        # in rank order: a token's sums do not depend on the step's other tokens (batch invariance)
        return await self.group.all_reduce(partial, op="sum", codec=self.codec, in_rank_order=True)

    async def all_gather(self, part: np.ndarray, counts: list[int]) -> np.ndarray:
        if self.group is None:
            if self.preemption is not None:
                await self.preemption.wait()
            return part.reshape(-1)
        return await self.group.all_gather(part, counts=counts)

    async def run(self, x: np.ndarray, step: Step) -> list[LogitSummary]:
        """Forward the tokens whose embeddings are x (n, dim), after sizing the slots' caches as the
        step says; this shard's summaries of the logits, sequence after sequence."""
        kv = self.model.kv
        kv.check({**{c.dst: c.capacity for c in step.copies}, **{s.slot: s.capacity for s in step.seqs}},
                 step.free)  # before anything changes
        capacities = {s.slot: s.capacity for s in step.seqs}
        for c in step.copies:  # (no copy reads a slot this step frees or copies into: Step.check)
            if c.n > capacities.get(c.src, kv.capacity(c.src)):
                raise ContextOverflow(f"slot {c.src} holds {kv.capacity(c.src)} positions, not the {c.n} to copy")
        for slot in step.free:
            kv.free(slot)
        for c in step.copies:
            kv.resize(c.dst, c.capacity)
        for s in step.seqs:
            kv.resize(s.slot, s.capacity)
        rows, at = [], 0
        for s in step.seqs:  # the rows whose logits the step asks for, and how to summarize each
            at += s.n
            picked = range(at - s.n, at) if s.logits == "all" else [at - 1] if s.logits == "last" else []
            rows += [(i, s, None if s.targets is None else s.targets[j]) for j, i in enumerate(picked)]
        # the last layer's feed-forward for those rows alone (for one row when none is asked: a prompt's
        # chunk, whose last layer still fills its keys and values)
        out_rows = np.array([i for i, _s, _t in rows] or [at - 1], np.int64) if at else None
        h = await self.model.forward(x, [s.span for s in step.seqs], self, [(c.src, c.dst, c.n) for c in step.copies],
                                     out_rows)
        if not rows:
            return []
        vocab_start = self.model.shard.vocab[0]
        logits = self.model.logits(h)
        return [summarize(row, vocab_start, s.params.params(), s.recent, target)
                for row, (_i, s, target) in zip(logits, rows)]
