"""Text generation on an `Engine`: prompt reuse through the KV cache, sampling, stop conditions,
streaming, and the figures users ask for (tokens/s, compute vs sync time, bytes per token)."""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

from .engine import Engine, StepStats
from .errors import ContextOverflow, DllamaError
from .sampling import Sampler, SamplingParams
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
    decode_steps: int = 0  # forward passes of one generated token (the first comes from the prefill)
    decode_s: float = 0.0
    decode_stats: StepStats = field(default_factory=StepStats)

    def report(self, engine: Engine) -> dict:
        """The `inference --json` object of design.md."""
        n = max(self.decode_steps, 1)
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
            "tokens_per_s": self.decode_steps / self.decode_s if self.decode_s else 0.0,
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


class Generator:
    """Generates on one engine. A request that extends what the KV cache holds (the previous
    turn of a conversation) only computes the new tokens."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    async def generate(self, prompt: list[int], params: SamplingParams, max_tokens: int,
                       stop: list[str] = (), on_text: Callable[[str], None] | None = None) -> Generation:
        """Generate after `prompt`. Requests are served one at a time (they queue on the engine's
        lock). Cancelling the caller (a client that went away) stops the generation between two
        steps: a step in flight always completes, so every node stays in step."""
        async with self.engine.lock:
            return await self._generate(prompt, params, max_tokens, stop, on_text)

    async def _generate(self, prompt, params, max_tokens, stop, on_text) -> Generation:
        if not prompt:
            raise DllamaError("the prompt is empty")
        if len(prompt) > self.engine.ctx_size:
            raise ContextOverflow(f"the prompt has {len(prompt)} tokens; the context holds {self.engine.ctx_size}")
        try:
            await self.engine.on_request()
        except DllamaError as e:
            return Generation("", [], len(prompt), "error", error=str(e))
        reused = _common_prefix(self.engine.context, prompt)
        reused = min(reused, len(prompt) - 1)  # at least one token must run to produce logits
        self.engine.rewind(reused)

        out = Generation("", [], len(prompt), "length", prefill_tokens=len(prompt) - reused)
        sampler = Sampler(params)
        emitter = _StopEmitter(list(stop), on_text)
        decoder = StreamDecoder(self.tokenizer)
        # the recent tokens only matter (and only travel to the workers) with a repetition penalty
        window = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
        t0 = time.perf_counter()
        decode_t0, stats0 = None, None
        try:
            summaries = await _step(self.engine.feed(prompt[reused:], params, recent=_last(prompt, window)))
            out.prefill_s = time.perf_counter() - t0
            decode_t0, stats0 = time.perf_counter(), self.engine.stats.copy()
            while len(out.tokens) < max_tokens:
                token = sampler.pick(summaries[-1])
                if self.tokenizer.is_eog(token):
                    out.finish_reason = "stop"
                    break
                out.tokens.append(token)
                if emitter.push(decoder.feed(token)):
                    out.finish_reason = "stop"
                    break
                if len(out.tokens) == max_tokens or self.engine.n_cached >= self.engine.ctx_size:
                    break  # done, or the token has no room in the KV cache
                recent = _last(self.engine.context, window - 1) + [token] if window else []
                summaries = await _step(self.engine.feed([token], params, recent=recent))
                out.decode_steps += 1
        except DllamaError as e:
            out.finish_reason, out.error = "error", str(e)
            self.engine.rewind(0)  # the cache state is unknown after a failure
        if decode_t0 is not None:
            out.decode_s = time.perf_counter() - decode_t0
            out.decode_stats = self.engine.stats.copy() - stats0
        if out.finish_reason != "stop":
            emitter.push(decoder.flush())
        emitter.close()
        out.text = emitter.text
        return out


async def _step(feed):
    """Await one engine step so that cancelling the caller cannot cut it in half: the step runs
    to its end (its nodes all finish it), then the cancellation is raised here."""
    task = asyncio.ensure_future(feed)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            try:
                await task
            except Exception:
                pass
        raise


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
