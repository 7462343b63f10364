"""Text generation on an `Engine`: prompt reuse through the KV cache, sampling, stop conditions,
streaming. Each request is a `stream.Stream`; the engine's `batching.Batcher` runs them together."""

from __future__ import annotations

from typing import Callable

from .batching import Batcher
from .engine import Engine
from .errors import ContextOverflow, DllamaError
from .sampling import SamplingParams
from .stream import Generation, Stream
from .tokenizer import Tokenizer


class Generator:
    """Generates on one engine, many requests at once: they share its steps (continuous
    batching, batching.Batcher), each in its own KV cache slot. A request that extends what a
    slot holds (the previous turn of a conversation) only computes the new tokens."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, drafter=None):
        """drafter: the draft_model.DraftModel of requests that speculate with "draft"."""
        if engine.batcher is None:  # one scheduler per engine, whoever generates on it
            engine.batcher = Batcher(engine)
        if drafter is not None:
            engine.batcher.drafter = drafter
        self.engine = engine
        self.tokenizer = tokenizer
        self.batcher = engine.batcher

    async def generate(self, prompt: list[int], params: SamplingParams, max_tokens: int,
                       stop: list[str] = (), on_text: Callable[[str], None] | None = None,
                       on_start: Callable[[], None] | None = None, speculate: str = "off") -> Generation:
        """Generate after `prompt`, alongside whatever else runs on the engine. Cancelling the
        caller (a client that went away) frees its slot at the next step: a step in flight always
        completes, so every node stays in step. on_text gets the text as it streams; on_start is
        called once the request has a slot (until then it waits its turn). speculate: "ngram" drafts
        tokens from the sequence itself, "draft" with the draft model, and verifies them in its steps
        (speculate.py: the same tokens)."""
        if not prompt:
            raise DllamaError("the prompt is empty")
        if speculate == "draft" and self.batcher.drafter is None:
            raise DllamaError("speculate 'draft' needs a draft model (--speculate draft:MODEL)")
        if len(prompt) > self.engine.ctx_size:
            raise ContextOverflow(f"the prompt has {len(prompt)} tokens; the context holds {self.engine.ctx_size}")
        return await self.batcher.submit(Stream(prompt, params, max_tokens, stop, on_text, self.tokenizer,
                                                 on_start, speculate))
