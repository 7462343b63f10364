"""One forward step, the unit every node runs, and how a node runs it.

The root's engine cuts a prompt or an answer into steps; a step says which positions run, which
logits come back and how to summarize them. The root sends it to each worker as the FORWARD message
(`to_wire` / `from_wire`, its embeddings following as raw activations) and runs its own shard of it
with the same `NodeStep`; a node alone (LocalEngine) is a NodeStep without a group.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import numpy as np
from msgspec import Meta

from .model import ShardModel
from .sampling import MAX_CANDIDATES, LogitSummary, SamplingParams, summarize
from .wire import InvalidMessage, WireStruct, finite

PREFILL_CHUNK = 256  # tokens per step while reading a prompt (bounds activation memory)
MAX_CTX = 1 << 22  # tokens of context a message may name (the memory check bounds it far lower)
MAX_STEP_TOKENS = PREFILL_CHUNK  # a step's working set grows with its tokens (attention: n^2)

TokenId = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]


class StepSampling(WireStruct):
    """SamplingParams as the nodes use them (the seed stays with the root's sampler)."""

    temperature: Annotated[float, Meta(ge=0)]
    top_k: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
    top_p: Annotated[float, Meta(ge=0, le=1)]
    repeat_penalty: Annotated[float, Meta(gt=0)]
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


class Step(WireStruct):
    """n tokens at positions start..; the logits of no position, the last one or all of them
    ("none" | "last" | "all") summarized with `params` (and `recent` for the repetition penalty;
    `targets`, for perplexity, the token that follows each position)."""

    start: Annotated[int, Meta(ge=0, lt=MAX_CTX)]
    n: Annotated[int, Meta(ge=1, le=MAX_STEP_TOKENS)]
    logits: Literal["none", "last", "all"]
    params: StepSampling
    recent: Annotated[list[TokenId], Meta(max_length=MAX_CTX)] = []
    targets: Optional[Annotated[list[TokenId], Meta(max_length=MAX_CTX)]] = None

    @classmethod
    def of(cls, start: int, n: int, params: SamplingParams, recent=(), targets=None,
           want_logits: bool = True) -> "Step":
        logits = "none" if not want_logits else ("all" if targets is not None else "last")
        return cls(start=start, n=n, logits=logits, params=StepSampling.of(params), recent=list(recent),
                   targets=None if targets is None else list(targets))

    def check(self, ctx_size: int, dim: int, vocab_size: int, max_activation_bytes: int, kind: str) -> "Step":
        """The checks that need the session: the context, the vocabulary, the activations' frame."""
        if self.start + self.n > ctx_size:
            raise InvalidMessage(f"invalid {kind}: positions {self.start}..{self.start + self.n - 1} are outside the "
                                 f"context of {ctx_size}")
        if self.n * dim * 4 > max_activation_bytes:
            raise InvalidMessage(f"invalid {kind}: n {self.n} tokens of dim {dim} exceed an activations frame")
        for name, ids in (("recent", self.recent), ("targets", self.targets or ())):
            if ids and max(ids) >= vocab_size:
                raise InvalidMessage(f"invalid {kind}: {name} holds token id {max(ids)}, outside the vocabulary of "
                                     f"{vocab_size}")
        if self.targets is not None and (self.logits != "all" or len(self.targets) != self.n):
            raise InvalidMessage(f"invalid {kind}: targets must come with logits 'all', one per token (got "
                                 f"{len(self.targets)} for n {self.n}, logits {self.logits!r})")
        return self


class NodeStep:
    """Runs steps on one node's shard. Also the model's `Collectives`: its sync points go through
    the node's process group, or nowhere when it runs alone (group None)."""

    def __init__(self, model: ShardModel, group, codec: str | None):
        self.model = model
        self.group = group
        self.codec = codec

    async def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        if self.group is None:
            return partial
        return await self.group.all_reduce(partial, op="sum", codec=self.codec)

    async def all_gather(self, part: np.ndarray, counts: list[int]) -> np.ndarray:
        if self.group is None:
            return part.reshape(-1)
        return await self.group.all_gather(part, counts=counts)

    async def run(self, x: np.ndarray, step: Step) -> list[LogitSummary]:
        """Forward the tokens whose embeddings are x (n, dim); this shard's summaries of the logits."""
        h = await self.model.forward(x, step.start, self)
        if step.logits == "none":
            return []
        rows = h if step.logits == "all" else h[-1:]
        vocab_start, params = self.model.shard.vocab[0], step.params.params()
        return [summarize(row, vocab_start, params, step.recent, None if step.targets is None else step.targets[i])
                for i, row in enumerate(self.model.logits(rows))]
