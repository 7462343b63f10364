"""Speculative decoding that never changes the answer: a sequence's next tokens are drafted on the
root, then verified in one step with its last token, and kept only while the request's own sampler
picks them.

A step of k+1 positions of one sequence costs a cluster the same round trips as a step of one (two
per layer), and on a CPU little more compute while the weights' reads dominate. Every kernel sums a
position's values in one order whatever else its step holds (batch invariance), so the logits of a
drafted position are the bits plain decoding would compute there: sampling them position by
position with the request's sampler and random generator, and stopping at the first sample that
differs from the draft, emits exactly the tokens of plain decoding (greedy or seeded alike). The
first differing sample is emitted too: every verification gives at least one token.

Two drafters:
- `ngram`, prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): the longest n-gram that
  ends the sequence and occurs earlier in it proposes the tokens that followed its latest earlier
  occurrence. Text that repeats its context (code edits, quotes, lists, structured output) gets
  long accepted drafts; free text mostly finds no match and is decoded as before.
- `draft:MODEL`, a smaller model of the same vocabulary on the root alone (draft_model.py).

`auto` is prompt lookup that stops drafting for a sequence whose drafts are refused (trying again
after a pause: DraftLength), and drafts only while a step's positions cost less than its fixed part
(StepCost, measured on the steps as they run): one node's step is soon bound by its compute (each
refused draft then costs a position's), a cluster's by its round trips, which drafts share.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .errors import DllamaError
from .sampling import SamplingParams

MODES = ("off", "ngram", "draft", "auto")  # a request's; "draft" needs the draft model its command loaded
# why a request with a repetition penalty decodes plainly: the nodes summarize a step's positions with
# one list of recent tokens, and a penalty would need each drafted position's own
NEEDS_NO_PENALTY = "the nodes apply a repetition penalty per step, not per drafted position"
MAX_NGRAM = 4  # the longest suffix looked up (then shorter ones, down to MIN_NGRAM)
MIN_NGRAM = 2  # a single token repeats too often to predict what follows
MAX_DRAFT = 8  # drafted tokens per step at most
FIRST_DRAFT = 4  # ... and at first, before the sequence's acceptance is known
MAX_PAUSE = 32  # auto: steps without drafts, at most, after drafts of one were refused in a row
AUTO_FIRST_POSITIONS = 4  # auto: a step's positions before StepCost has measured any
AUTO_MAX_POSITIONS = 64


def parse_option(text: str) -> tuple[str, str | None]:
    """--speculate's value (off, ngram, auto or draft:MODEL): the mode, and the draft model's name or path."""
    if text in ("off", "ngram", "auto"):
        return text, None
    if text.startswith("draft:") and text[len("draft:"):]:
        return "draft", text[len("draft:"):]
    raise DllamaError(f"--speculate takes off, ngram, auto or draft:MODEL (a registry name or a .gguf path), "
                      f"not {text!r}")


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request sampled with `params` may verify drafts (see NEEDS_NO_PENALTY)."""
    return params.repeat_penalty == 1.0


def verified(sample: int, draft: int) -> bool:
    """Whether a drafted token is kept: only where the request's own sampler picked it (the rule
    that makes the answer plain decoding's; tests turn it off to see them fail)."""
    return sample == draft


def ngram_draft(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram (MAX_NGRAM
    down to MIN_NGRAM tokens) that ends `tokens`; none if it does not occur earlier. (The reference
    of NgramIndex, which answers the same from an index instead of a scan.)"""
    if k <= 0:
        return []
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
        suffix = tokens[end - n:]
        for i in range(end - n - 1, -1, -1):  # the latest earlier start, scanning back
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramIndex:
    """ngram_draft over a sequence that grows, in constant time per token: for every n-gram, where
    its latest occurrence ends and where the one before it did (a scan back over a long context
    would cost a step's time for a batch of sequences)."""

    def __init__(self):
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram: the end of its latest occurrence
        self._before: dict[tuple[int, ...], int] = {}  # ... and of the occurrence before that

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(self.tokens[end - n:])
                if key in self._latest:
                    self._before[key] = self._latest[key]
                self._latest[key] = end

    def draft(self, k: int) -> list[int]:
        """ngram_draft(self.tokens, k)."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            earlier = self._before.get(tuple(self.tokens[end - n:]))
            if earlier is not None:
                return self.tokens[earlier:earlier + k]
        return []


@dataclass
class DraftLength:
    """How many tokens to draft for one sequence: longer while its drafts are kept whole, shorter
    when they are refused (at 1 a refused draft costs a step one more position). With `pause`
    (auto), a refused draft of one stops the drafting: one draft is tried again after a pause that
    doubles with each refusal in a row (free text pays about one position every MAX_PAUSE steps)."""

    k: int = FIRST_DRAFT
    pause: bool = False
    wait: int = 0  # paused: steps until the next try
    last_wait: int = 0

    def update(self, drafted: int, kept: int) -> None:
        if kept == drafted:
            self.k = min(MAX_DRAFT, self.k + 1)
            self.last_wait = 0
        elif kept == 0 and self.k == 1 and self.pause:
            self.k, self.last_wait = 0, min(MAX_PAUSE, 2 * self.last_wait or 1)
            self.wait = self.last_wait
        elif kept == 0:
            self.k = max(1, self.k // 2)
        else:
            self.last_wait = 0

    def plain_step(self) -> None:
        """A step that verified no draft (paused, or nothing to propose)."""
        if self.k == 0:
            self.wait -= 1
            if self.wait <= 0:
                self.k = 1


class StepCost:
    """A decoding step's seconds as fixed + per_position x positions, fitted (least squares) to
    the last steps: `latency_bound_positions` is how many positions a step may carry before they
    cost more than its fixed part (the weights' reads, the round trips), which auto drafts within."""

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, positions: int, seconds: float) -> None:
        self.samples.append((positions, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_position) seconds, or None before steps of two sizes were measured."""
        n = len(self.samples)
        if len({p for p, _ in self.samples}) < 2:
            return None
        mean_p = sum(p for p, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        var = sum((p - mean_p) ** 2 for p, _ in self.samples)
        per_position = sum((p - mean_p) * (s - mean_s) for p, s in self.samples) / var
        return mean_s - per_position * mean_p, per_position

    def latency_bound_positions(self) -> int:
        fitted = self.fit()
        if fitted is None:
            return AUTO_FIRST_POSITIONS
        fixed, per_position = fitted
        if per_position <= 0:  # (noise: positions cost nothing measurable)
            return AUTO_MAX_POSITIONS
        return max(1, min(AUTO_MAX_POSITIONS, round(max(fixed, 0.0) / per_position)))
