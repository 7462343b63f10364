"""`--speculate draft:MODEL`: a smaller model of the same vocabulary drafts each sequence's next
tokens on the root alone, greedily, one token a step for every drafting sequence at once.

Its KV cache follows the sequences: each drafts in the slot of its own number (the main engine's
slot), and before drafting, the slot is rewound to what it shares with the sequence's tokens (the
drafts the main model refused fall away) and fed the rest (the prompt the first time, then the
tokens verified since). What it proposes only decides how many tokens a step keeps, never which:
the main model's sampler does (speculate.py).
"""

from __future__ import annotations

from .engine import LocalEngine, SeqInput
from .errors import DllamaError
from .gguf_model import GGUFModel
from .sampling import Sampler, SamplingParams
from .step import MAX_STEP_TOKENS, PREFILL_CHUNK
from .stream import _common_prefix

GREEDY = SamplingParams(temperature=0.0)
VOCABULARY = "tokenizer.ggml.tokens"


class DraftModel:
    def __init__(self, engine: LocalEngine, name: str):
        self.engine = engine
        self.name = name
        self.greedy = Sampler(GREEDY)

    @classmethod
    def open(cls, name: str, main: GGUFModel, ctx_size: int) -> GGUFModel:
        """The draft model `name` (a registry name or a .gguf path) for `main`: refused (one line)
        unless its token ids are main's, and its context holds main's `ctx_size`."""
        from .registry import resolve_model

        model = GGUFModel(resolve_model(name))
        what = f"--speculate draft:{name}"
        ours, theirs = main.file.array_bytes(VOCABULARY), model.file.array_bytes(VOCABULARY)
        if ours is None or theirs is None or ours != theirs:
            raise DllamaError(f"{what}: its vocabulary ({model.config.vocab_size} tokens) is not the model's "
                              f"({main.config.vocab_size} tokens): a draft must give every token id the same text")
        if model.config.context_length < ctx_size:
            raise DllamaError(f"{what}: its context of {model.config.context_length} tokens cannot follow the "
                              f"model's {ctx_size} (--ctx-size)")
        return model

    @classmethod
    async def start(cls, model: GGUFModel, name: str, ctx_size: int, slots: int) -> "DraftModel":
        """A draft model (`open`ed) on this process, with a slot per main slot, each a whole context."""
        engine = LocalEngine(model, ctx_size, slots=slots)
        try:
            await engine.warm_up()
        except BaseException:
            await engine.close()
            raise
        return cls(engine, name)

    async def draft(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (slot, the sequence's tokens, k): the k tokens the draft model would follow them
        with, greedily. The sequences' last tokens are fed in the first step that reaches them; the
        drafts (but the last one, which only the next call feeds if it was kept) one a step after."""
        engine = self.engine
        to_feed, drafts, want = {}, {}, {}
        for slot, tokens, k in wants:
            k = min(k, engine.ctx_size - len(tokens))  # (the last draft is not fed: the context holds the rest)
            if k <= 0 or not tokens:
                continue
            keep = min(_common_prefix(engine.contexts[slot], tokens), len(tokens) - 1)
            engine.rewind(keep, slot)
            engine.reserve(slot, len(tokens) + k - 1)
            to_feed[slot], drafts[slot], want[slot] = tokens[keep:], [], k
        while to_feed:
            seqs, room = [], MAX_STEP_TOKENS
            for slot, tokens in to_feed.items():
                n = min(len(tokens), PREFILL_CHUNK, room)
                if n <= 0:
                    break
                seqs.append(SeqInput(slot, tokens[:n], GREEDY, want_logits=n == len(tokens)))
                room -= n
            results = await engine.step(seqs)
            for seq, summaries in zip(seqs, results):
                slot = seq.slot
                del to_feed[slot][:len(seq.tokens)]
                if to_feed[slot]:
                    continue  # (its tokens go on in the next step)
                token = self.greedy.pick(summaries[-1])
                drafts[slot].append(token)
                if len(drafts[slot]) < want[slot]:
                    to_feed[slot] = [token]
                else:
                    del to_feed[slot]
        return [drafts.get(slot, []) for slot, _, _ in wants]

    async def close(self) -> None:
        await self.engine.close()

