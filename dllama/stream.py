"""One request as it generates: its sampler, its stop strings, the text it has streamed, and the
`Generation` it ends with (with the figures users ask for: tokens/s, compute vs sync time, bytes per
token). `batching.Batcher` runs many of them on one engine's steps."""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

from .engine import Engine, StepStats
from .sampling import Sampler, SamplingParams
from .speculate import MODES, DraftLength, NgramIndex, can_speculate, verified
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class Generation:
    text: str
    tokens: list[int]  # generated ids (EOS excluded)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "error"
    error: str | None = None
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the KV cache)
    prefill_s: float = 0.0
    decode_steps: int = 0  # forward passes after the prompt's (whose logits give the first token)
    decode_tokens: int = 0  # tokens those passes sampled: one each, more with speculation (drafts kept)
    drafted: int = 0  # speculation: tokens drafted, and how many of them the sampler kept
    accepted: int = 0
    decode_s: float = 0.0
    decode_stats: StepStats = field(default_factory=StepStats)

    def report(self, engine: Engine) -> dict:
        """The `inference --json` object of design.md."""
        n = max(self.decode_tokens, 1)
        per_token = lambda v: v / n  # noqa: E731
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "nodes": engine.n_nodes,
            "sync": engine.sync.algo,
            "sync_dtype": engine.sync.dtype,
            "sync_mode": engine.sync.mode,
            "sync_choice": engine.sync_choice,
            "tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "decode_steps": self.decode_steps,
            "speculation": {"drafted": self.drafted, "accepted": self.accepted},
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
            "ms_per_token": {
                "total": per_token(self.decode_s) * 1e3,
                "compute": per_token(self.decode_stats.compute_s) * 1e3,
                "sync": per_token(self.decode_stats.sync_s) * 1e3,
            },
            "bytes_per_token": {"sent": per_token(self.decode_stats.bytes_sent),
                                "recv": per_token(self.decode_stats.bytes_recv)},
            "peak_rss_mb": peak_rss_mb(),
            # each worker's last step: bytes sent/received (one token, after the prompt), RSS
            "workers": [{"node": n["node"], "address": n.get("address"), "up": n["up"], **(n.get("stats") or {})}
                        for n in engine.node_status()[1:]],
        }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Stream:
    """One request as it generates: the tokens it still has to feed, its sampler, the text it has
    streamed, and its Generation once done."""

    def __init__(self, prompt: list[int], params: SamplingParams, max_tokens: int, stop, on_text,
                 tokenizer: Tokenizer, on_start: Callable[[], None] | None = None, speculate: str = "off"):
        self.prompt, self.params, self.max_tokens = prompt, params, max_tokens
        self.on_start = on_start
        self.tokenizer = tokenizer
        self.out = Generation("", [], len(prompt), "length")
        self.sampler = Sampler(params)
        self.emitter = _StopEmitter(list(stop), on_text)
        self.decoder = StreamDecoder(tokenizer)
        # the recent tokens only matter (and only travel to the workers) with a repetition penalty
        self.window = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
        if speculate not in MODES:
            raise ValueError(f"speculate must be one of {', '.join(MODES)}, not {speculate!r}")
        self.speculate = speculate if can_speculate(params) else "off"  # (else: the same tokens, plainly)
        self.draft_length = DraftLength(pause=self.speculate == "auto") if self.speculate != "off" else None
        # the prompt and the answer so far
        self.lookup = NgramIndex() if self.speculate in ("ngram", "auto") else None
        # draft:MODEL's drafts, made (by the batcher, before it plans a step) when the answer had this many tokens
        self.model_drafts: list[int] = []
        self.model_drafts_at = -1
        self.slot: int | None = None
        self.pending: list[int] = []  # what the next steps feed: the prompt's rest, then the last token
        self.decoding = False  # past the prompt
        self.cancelled = False  # the caller went away
        self.share_from = None  # (a request ahead, n): it waits for that one's first n prompt tokens to copy them
        self.done = asyncio.get_running_loop().create_future()
        self.t0 = 0.0
        self.decode_t0 = 0.0
        self.stats0: StepStats | None = None

    def start(self, slot: int, reused: int) -> None:
        """Admitted into `slot`, whose cache holds the prompt's first `reused` tokens."""
        self.slot, self.pending = slot, self.prompt[reused:]
        self.out.prefill_tokens = len(self.pending)
        self.t0 = time.perf_counter()
        if self.on_start is not None:
            self.on_start()

    def recent(self, context: list[int], fed: int) -> list[int]:
        """The tokens the repetition penalty looks back on at the last of the next `fed` pending
        tokens, which follow `context`."""
        return _last(context + self.pending[:fed], self.window) if self.window else []

    def drafts_wanted(self, room: int) -> int:
        """How many tokens to verify after the pending one in the next step (none without
        speculation): at most `room` (what its KV cache and the context hold past the pending
        token), nor more than the tokens the request may still produce after it."""
        if self.draft_length is None or not self.decoding:
            return 0
        return max(0, min(self.draft_length.k, room, self.max_tokens - len(self.out.tokens) - 1))

    def draft(self, room: int) -> list[int]:
        """The tokens to verify after the pending one in the next step (see drafts_wanted)."""
        k = self.drafts_wanted(room)
        if not k:
            return []
        if self.lookup is None:  # draft:MODEL's, if they were made for the answer as it is
            return self.model_drafts[:k] if self.model_drafts_at == len(self.out.tokens) else []
        if not self.lookup.tokens:
            self.lookup.extend(self.prompt + self.out.tokens)
        return self.lookup.draft(k)

    def take(self, summaries, context_full: bool, stats: StepStats) -> bool:
        """The summaries (one per node) of the last position fed are in: sample. True when done."""
        if self._count_step(stats):
            self.out.decode_tokens += 1
            if self.draft_length is not None:
                self.draft_length.plain_step()
        return self._emit(self.sampler.pick(summaries), context_full, stats)

    def take_drafted(self, positions, drafts: list[int], context: int, ctx_size: int,
                     stats: StepStats) -> tuple[bool, int]:
        """The summaries of the pending token's position and of each draft after it are in (the
        sequence holds `context` tokens up to the last draft): sample them in order, keeping a draft
        while the sample is that token; the first sample that differs is emitted as plain decoding
        would. (True when done, the drafts kept.)"""
        self._count_step(stats)
        self.out.drafted += len(drafts)
        kept = 0
        for j, summaries in enumerate(positions):
            token = self.sampler.pick(summaries)
            self.out.decode_tokens += 1
            held = context - len(drafts) + j  # the sequence up to this position
            if self._emit(token, held >= ctx_size, stats):
                break
            if j == len(drafts) or not verified(token, drafts[j]):
                break
            kept += 1
        self.out.accepted += kept
        self.draft_length.update(len(drafts), kept)
        return self.done.done(), kept

    def _count_step(self, stats: StepStats) -> bool:
        """A step's logits are in: the prompt's (False), or a decode step's (True)."""
        if not self.decoding:
            self.decoding = True
            self.out.prefill_s = time.perf_counter() - self.t0
            self.decode_t0, self.stats0 = time.perf_counter(), stats.copy()
            return False
        self.out.decode_steps += 1
        return True

    def _emit(self, token: int, context_full: bool, stats: StepStats) -> bool:
        """A sampled token: the answer's next, or its end. True when done."""
        if self.tokenizer.is_eog(token):
            return self.finish(stats, "stop")
        self.out.tokens.append(token)
        if self.lookup is not None and self.lookup.tokens:
            self.lookup.extend([token])
        if self.emitter.push(self.decoder.feed(token)):
            return self.finish(stats, "stop")
        if len(self.out.tokens) == self.max_tokens or context_full:
            return self.finish(stats, "length")  # done, or the token has no room in the KV cache
        self.pending = [token]
        return False

    def finish(self, stats: StepStats, reason: str, error: str | None = None) -> bool:
        """Done (a failure keeps what was produced): the Generation goes to the caller."""
        out = self.out
        out.finish_reason, out.error = reason, error
        if self.stats0 is not None:
            out.decode_s = time.perf_counter() - self.decode_t0
            out.decode_stats = stats.copy() - self.stats0
        if reason != "stop":
            self.emitter.push(self.decoder.flush())
        self.emitter.close()
        out.text = self.emitter.text
        if not self.done.done():
            self.done.set_result(out)
        return True


def _last(tokens: list[int], n: int) -> list[int]:
    return tokens[max(0, len(tokens) - n):] if n > 0 else []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _StopEmitter:
    """Accumulates generated text, cuts it at the first stop string, and streams only text that
    can no longer turn out to be the start of a stop string."""

    def __init__(self, stop: list[str], on_text: Callable[[str], None] | None):
        self.stop = [s for s in stop if s]
        self.on_text = on_text
        self.text = ""
        self.emitted = 0

    def push(self, piece: str) -> bool:
        """Add text; True once a stop string has appeared (the text is cut before it)."""
        self.text += piece
        found = [at for at in (self.text.find(s) for s in self.stop) if at >= 0]
        if found:
            self.text = self.text[:min(found)]
            self._emit(len(self.text))
            return True
        held = max((_partial_suffix(self.text, s) for s in self.stop), default=0)
        self._emit(len(self.text) - held)
        return False

    def close(self) -> None:
        self._emit(len(self.text))

    def _emit(self, upto: int) -> None:
        if upto > self.emitted and self.on_text is not None:
            self.on_text(self.text[self.emitted:upto])
        self.emitted = max(self.emitted, upto)


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
