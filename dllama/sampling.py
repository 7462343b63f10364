"""Sampling over a vocabulary that is split across nodes.

No node ever sends its full logits. Each node reduces its vocabulary slice to a small
`LogitSummary` (its best candidates, the log-sum-exp of its slice, and the logit of a given
target token when it owns it); the root merges the summaries:
- greedy: the best candidate of all nodes (ties to the lowest token id, like argmax);
- temperature / top-k / top-p: the union of the nodes' top candidates, with probabilities
  normalized by the global log-sum-exp, so they are exact for every candidate kept
  (top-k is capped at MAX_CANDIDATES per node);
- perplexity: log p(target) = target logit - global log-sum-exp.
A 1-node run goes through exactly the same path with one summary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .kernels.ops import log_sum_exp, top_k

MAX_CANDIDATES = 256  # per node, per position

# The ranges where the math stays finite for any finite float32 logit (up to 3.4e38): logit / T within
# float64's range needs T >= ~1e-270; below MIN_TEMPERATURE (subnormals included) a softmax is one-hot
# on the best logit but for exact ties, so sampling is greedy there, the limit it tends to. A penalized
# logit is clipped to float32's range; the penalty's bounds keep realistic logits far inside it.
MIN_TEMPERATURE = 1e-10
MAX_TEMPERATURE = 1e6  # (beyond: a uniform choice among the candidates, to float64's precision)
REPEAT_PENALTY_RANGE = (1e-3, 1e3)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 (or below MIN_TEMPERATURE): greedy
    top_k: int = 40  # 0: no limit (up to MAX_CANDIDATES per node)
    top_p: float = 0.9  # 1.0: no nucleus cut
    repeat_penalty: float = 1.0  # llama.cpp style: 1.0 is off
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def problem(self) -> tuple[str, str] | None:
        """(field, why) of the first value outside the ranges where sampling is defined, else None."""
        def bad_number(value, lo, hi):
            return isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi

        if bad_number(self.temperature, 0.0, MAX_TEMPERATURE):
            return "temperature", f"must be a number from 0 to {MAX_TEMPERATURE:g} (0 is greedy)"
        if bad_number(self.top_p, 0.0, 1.0):
            return "top_p", "must be a number from 0 to 1"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return "top_k", "must be a whole number >= 0 (0: no cut)"
        if bad_number(self.repeat_penalty, *REPEAT_PENALTY_RANGE):
            lo, hi = REPEAT_PENALTY_RANGE
            return "repeat_penalty", f"must be a number from {lo:g} to {hi:g} (1 is off)"
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < 0:
            return "repeat_last_n", "must be a whole number >= 0"
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            return "seed", "must be a whole number"
        return None

    @property
    def n_candidates(self) -> int:
        if self.greedy:
            return 1
        return min(self.top_k, MAX_CANDIDATES) if self.top_k > 0 else MAX_CANDIDATES

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n}


@dataclass
class LogitSummary:
    """One node's view of one position's logits over its vocabulary slice."""

    ids: np.ndarray  # int64 candidate token ids (global ids), best first
    logits: np.ndarray  # float32 their logits (after repetition penalty)
    # log-sum-exp of logits/temperature over the whole slice (temperature 1 if greedy); None where
    # nothing needs it (greedy, no target): 49k exps cost as much as a small matmul per sequence
    lse: float | None
    target_logit: float | None = None  # logit of the target token, if this slice owns it

    def to_wire(self) -> dict:
        return {"ids": self.ids.astype(np.int64).tobytes(), "logits": self.logits.astype(np.float32).tobytes(),
                "lse": None if self.lse is None else float(self.lse), "target": self.target_logit}

    @classmethod
    def from_wire(cls, d: dict) -> "LogitSummary":
        return cls(np.frombuffer(d["ids"], np.int64), np.frombuffer(d["logits"], np.float32),
                   None if d["lse"] is None else float(d["lse"]), d["target"])


def apply_repeat_penalty(logits: np.ndarray, vocab_start: int, recent: list[int], penalty: float) -> None:
    """llama.cpp's repetition penalty on the slice [vocab_start, vocab_start + len) in place."""
    if penalty == 1.0 or not recent:
        return
    ids = np.unique(np.asarray(recent, np.int64)) - vocab_start
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    values = logits[ids]
    penalty = np.float32(penalty)  # float32 arithmetic, as llama.cpp's
    with np.errstate(over="ignore"):  # clipped: a finite logit stays finite (an infinite one makes the sums NaN)
        logits[ids] = np.clip(np.where(values > 0, values / penalty, values * penalty), -_FLOAT32_MAX, _FLOAT32_MAX)


def summarize(logits: np.ndarray, vocab_start: int, params: SamplingParams, recent: list[int] = (),
              target: int | None = None) -> LogitSummary:
    """Reduce one position's logit slice (float32, 1-D) to a summary."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if params.repeat_penalty != 1.0 and recent:  # on a copy: the caller's logits stay as they are
        logits = logits.copy()
        apply_repeat_penalty(logits, vocab_start, list(recent), params.repeat_penalty)
    k = min(params.n_candidates, logits.shape[0])
    top = np.array([int(np.argmax(logits))]) if k == 1 else top_k(logits, k)  # best first, ties by id
    needs_lse = not params.greedy or target is not None
    lse = log_sum_exp(logits, 1.0 if params.greedy else params.temperature) if needs_lse else None
    target_logit = None
    if target is not None and vocab_start <= target < vocab_start + logits.shape[0]:
        target_logit = float(logits[target - vocab_start])
    return LogitSummary(top.astype(np.int64) + vocab_start, logits[top], lse, target_logit)


def global_lse(summaries: list[LogitSummary]) -> float:
    if any(s.lse is None for s in summaries):
        raise ValueError("a greedy summary without a target carries no log-sum-exp")
    lses = np.array([s.lse for s in summaries])
    peak = lses.max()
    return float(peak + np.log(np.exp(lses - peak).sum()))


@dataclass
class Sampler:
    params: SamplingParams
    rng: np.random.Generator = field(init=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.seed)

    def pick(self, summaries: list[LogitSummary]) -> int:
        if self.params.greedy:
            # each summary's best comes first (ties by lowest id): the best of those, in Python (a
            # server picks for every stream at every step; numpy's calls cost more than the choice)
            firsts = [(-float(s.logits[0]), int(s.ids[0])) for s in summaries if len(s.ids)]
            if firsts and all(math.isfinite(logit) for logit, _ in firsts):
                return min(firsts)[1]
        ids = np.concatenate([s.ids for s in summaries])
        logits = np.concatenate([s.logits for s in summaries])
        order = np.lexsort((ids, -logits))  # best first, ties by lowest id
        ids, logits = ids[order], logits[order]
        if self.params.greedy:
            return int(ids[0])
        # the same candidate budget however many nodes offered candidates
        ids, logits = ids[: self.params.n_candidates], logits[: self.params.n_candidates]
        probs = np.exp(logits.astype(np.float64) / self.params.temperature - global_lse(summaries))
        if self.params.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), self.params.top_p * probs.sum()) + 1)
            ids, probs = ids[:keep], probs[:keep]
        return int(self.rng.choice(ids, p=probs / probs.sum()))


def target_logprob(summaries: list[LogitSummary]) -> float:
    """log p(target) from the summaries of one position (computed at temperature 1)."""
    owned = [s.target_logit for s in summaries if s.target_logit is not None]
    if len(owned) != 1:
        raise ValueError("exactly one node must own the target token")
    return owned[0] - global_lse(summaries)
