"""Sampling over a vocabulary split across nodes: the summaries of 2-5 slices must give what one
whole slice gives (same pick, same probabilities, same log-probabilities), with llama.cpp's
semantics for greedy, temperature, top-k, top-p and the repetition penalty."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.kernels.ops import log_sum_exp, log_sum_exp_ref, top_k, top_k_ref
from dllama.sampling import (MAX_CANDIDATES, LogitSummary, Sampler, SamplingParams, apply_repeat_penalty, global_lse,
                             summarize, target_logprob)

VOCAB = 3000


def logits_row(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def cuts(vocab: int, n: int, seed: int) -> list[tuple[int, int]]:
    """n uneven contiguous slices of [0, vocab)."""
    inner = np.sort(np.random.default_rng(seed).choice(np.arange(1, vocab), n - 1, replace=False))
    bounds = [0, *inner.tolist(), vocab]
    return list(zip(bounds, bounds[1:]))


def split_summaries(logits, params, n, seed=0, recent=(), target=None):
    """Node summaries in an arbitrary order (the root receives them as they come)."""
    out = [summarize(logits[a:b], a, params, recent, target) for a, b in cuts(len(logits), n, seed)]
    return [out[i] for i in np.random.default_rng(seed + 1).permutation(n)]


def softmax64(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ------------------------------------------------------------------ a slice's candidates


@pytest.mark.parametrize("kind", ["spread", "ties", "equal"])
@pytest.mark.parametrize("n", [1, 2, 5, 37, 300, 49152])
def test_top_k_is_the_k_best_ties_to_the_lowest_id(kind, n):
    rng = np.random.default_rng(n)
    x = {"spread": lambda: rng.standard_normal(n), "ties": lambda: rng.integers(-3, 3, n),
         "equal": lambda: np.zeros(n)}[kind]().astype(np.float32)
    for k in sorted({0, 1, 2, 3, 40, MAX_CANDIDATES, n, n + 3}):
        np.testing.assert_array_equal(top_k(x, k), top_k_ref(x, k))


@pytest.mark.parametrize("n", [1, 7, 8, 1023, 1025, 49152])
def test_log_sum_exp_is_numpy_s_in_float64(n):
    """Summed over chunks and lanes, whatever the length (tails of both), with a temperature or
    without; -inf logits add nothing; far from zero nothing overflows."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 6).astype(np.float32)
    for temperature in (1.0, 0.7, 2.5):
        assert log_sum_exp(x, temperature) == pytest.approx(log_sum_exp_ref(x, temperature), rel=1e-14, abs=1e-14)
    x[1:] = -np.inf
    assert log_sum_exp(x) == x[0]
    x[-1] = np.nan  # broken logits say so
    assert np.isnan(log_sum_exp(x)) and np.isnan(log_sum_exp_ref(x))
    assert log_sum_exp(np.float32([1000.0, 999.0])) == pytest.approx(1000 + np.log1p(np.exp(-1.0)), rel=1e-15)


# ------------------------------------------------------------------ greedy


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_greedy_is_argmax(n):
    params = SamplingParams(temperature=0.0)
    sampler = Sampler(params)
    for seed in range(20):
        logits = logits_row(seed)
        assert sampler.pick(split_summaries(logits, params, n, seed)) == int(np.argmax(logits))


def test_greedy_ties_go_to_the_lowest_id_across_slices():
    logits = np.zeros(100, np.float32)
    logits[[17, 42, 88]] = 5.0
    params = SamplingParams(temperature=0.0)
    for n in (1, 2, 4):
        parts = [summarize(logits[a:b], a, params) for a, b in cuts(100, n, 3)]
        assert Sampler(params).pick(parts[::-1]) == 17
    logits[[30, 60]] = np.inf  # (not finite: the general merge) the best are infinite: the lowest of them
    for n in (1, 2, 4):
        parts = [summarize(logits[a:b], a, params) for a, b in cuts(100, n, 3)]
        assert Sampler(params).pick(parts[::-1]) == 30


# ------------------------------------------------------------------ split == whole


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("top_k, top_p, temperature", [(40, 0.9, 0.8), (5, 1.0, 1.0), (1, 1.0, 1.5), (100, 0.5, 0.7),
                                                       (MAX_CANDIDATES, 0.95, 1.2), (0, 1.0, 1.0), (1000, 0.98, 1.0)],
                         ids=["k40-p0.9", "k5", "k1", "k100-p0.5", "kMAX-p0.95", "no-cut", "k1000-p0.98"])
def test_split_picks_equal_whole_picks(n, top_k, top_p, temperature):
    """Also without a top-k cut (top_k 0) or above the per-node cap: the candidates must then be
    the global best MAX_CANDIDATES, not up to MAX_CANDIDATES per node, or the distribution would
    depend on how many nodes hold the vocabulary."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(30):
        logits = logits_row(seed, scale=2.0)
        whole = [summarize(logits, 0, params)]
        parts = split_summaries(logits, params, n, seed)
        assert global_lse(parts) == pytest.approx(whole[0].lse, abs=1e-9)
        a = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        b = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        assert [a.pick(whole) for _ in range(20)] == [b.pick(parts) for _ in range(20)]


@pytest.mark.parametrize("n", [2, 5])
def test_split_candidates_and_probabilities_equal_whole(n):
    """The merged candidates are the whole slice's top-k, best first, and their probabilities
    (normalized by the global log-sum-exp) are the full softmax's."""
    params = SamplingParams(temperature=0.7, top_k=50, top_p=1.0)
    logits = logits_row(7)
    parts = split_summaries(logits, params, n, 7)
    ids = np.concatenate([s.ids for s in parts])
    vals = np.concatenate([s.logits for s in parts])
    order = np.lexsort((ids, -vals))[:50]
    expected = np.argsort(-logits, kind="stable")[:50]
    np.testing.assert_array_equal(ids[order], expected)
    probs = np.exp(vals[order].astype(np.float64) / 0.7 - global_lse(parts))
    np.testing.assert_allclose(probs, softmax64(logits.astype(np.float64) / 0.7)[expected], rtol=1e-9)


# ------------------------------------------------------------------ distributions


def test_sampling_follows_the_softmax():
    """With no cut, picks are distributed as softmax(logits / T) (small vocabulary, 20k draws)."""
    logits = logits_row(1, vocab=50, scale=1.0)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=123)
    sampler = Sampler(params)
    parts = split_summaries(logits, params, 3, 1)
    draws = np.array([sampler.pick(parts) for _ in range(20000)])
    freq = np.bincount(draws, minlength=50) / len(draws)
    np.testing.assert_allclose(freq, softmax64(logits / 0.8), atol=0.012)


def test_top_k_restricts_the_candidates():
    logits = logits_row(2, scale=0.3)  # flat: without the cut, picks would spread far
    params = SamplingParams(temperature=1.0, top_k=7, top_p=1.0, seed=5)
    sampler = Sampler(params)
    parts = split_summaries(logits, params, 4, 2)
    picks = {sampler.pick(parts) for _ in range(2000)}
    assert picks == set(np.argsort(-logits)[:7].tolist())


@pytest.mark.parametrize("top_p, allowed", [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, allowed):
    """Probabilities 0.5, 0.3, 0.15, 0.05 (rest ~0): llama.cpp keeps tokens until their sum reaches p."""
    probs = np.array([0.5, 0.3, 0.15, 0.05 - 1e-9 * 96] + [1e-9] * 96)
    logits = np.log(probs).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=top_p, seed=9)
    sampler = Sampler(params)
    parts = split_summaries(logits, params, 3, 4)
    picks = {sampler.pick(parts) for _ in range(3000)}
    assert picks == allowed


def test_seeds_reproduce():
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=42)
    logits = logits_row(3, scale=0.5)
    parts = split_summaries(logits, params, 2, 3)
    runs = [[Sampler(params).pick(parts) for _ in range(1)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    a, b = Sampler(params), Sampler(params)
    seq_a, seq_b = [a.pick(parts) for _ in range(50)], [b.pick(parts) for _ in range(50)]
    assert seq_a == seq_b
    other = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=43))
    assert [other.pick(parts) for _ in range(50)] != seq_a


# ------------------------------------------------------------------ log-probabilities (perplexity)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_target_logprob_is_log_softmax(n):
    params = SamplingParams(temperature=0.0)
    for seed in range(10):
        logits = logits_row(seed, scale=4.0)
        lsm = np.log(softmax64(logits))
        for target in (0, 1, int(np.argmax(logits)), VOCAB - 1, 1234):
            parts = split_summaries(logits, params, n, seed, target=target)
            assert sum(s.target_logit is not None for s in parts) == 1
            assert target_logprob(parts) == pytest.approx(lsm[target], abs=1e-6)


def test_target_logprob_needs_exactly_one_owner():
    params = SamplingParams(temperature=0.0)
    logits = logits_row(0)
    with pytest.raises(ValueError):
        target_logprob([summarize(logits, 0, params)])  # no target given
    twice = [summarize(logits, 0, params, target=5), summarize(logits, 0, params, target=5)]
    with pytest.raises(ValueError):
        target_logprob(twice)


# ------------------------------------------------------------------ repetition penalty


def test_repeat_penalty_is_llama_cpp_s():
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.5, 3.0], np.float32)
    out = logits.copy()
    apply_repeat_penalty(out, 0, [0, 1, 1, 4, 99], 1.5)  # repeats count once; ids outside are ignored
    np.testing.assert_allclose(out, [2.0 / 1.5, -3.0, 1.0, -1.0, 0.5 / 1.5, 3.0])
    # on a slice, with global ids
    part = logits[3:].copy()
    apply_repeat_penalty(part, 3, [0, 4, 5], 2.0)
    np.testing.assert_allclose(part, [-1.0, 0.25, 1.5])
    same = logits.copy()
    apply_repeat_penalty(same, 0, [0, 1], 1.0)
    np.testing.assert_array_equal(same, logits)


@pytest.mark.parametrize("n", [1, 3])
def test_repeat_penalty_changes_greedy_pick_and_normalizer(n):
    logits = logits_row(4)
    best = int(np.argmax(logits))
    params = SamplingParams(temperature=0.0, repeat_penalty=10.0)
    recent = [best, 5, 6]
    parts = split_summaries(logits, params, n, 4, recent=recent, target=best)
    penalized = logits.copy()
    apply_repeat_penalty(penalized, 0, recent, 10.0)
    assert Sampler(params).pick(parts) == int(np.argmax(penalized)) != best
    assert global_lse(parts) == pytest.approx(np.log(np.exp(penalized.astype(np.float64)).sum()), abs=1e-9)
    assert target_logprob(parts) == pytest.approx(np.log(softmax64(penalized))[best], abs=1e-6)


def test_summary_wire_round_trip():
    params = SamplingParams(temperature=0.9, top_k=8)
    s = summarize(logits_row(5), 1000, params, target=1003)
    back = LogitSummary.from_wire(s.to_wire())
    np.testing.assert_array_equal(back.ids, s.ids)
    np.testing.assert_array_equal(back.logits, s.logits)
    assert back.lse == s.lse and back.target_logit == s.target_logit
    assert s.ids.min() >= 1000 and len(s.ids) == 8


def test_greedy_summaries_skip_the_log_sum_exp_unless_a_target_asks():
    """Greedy picks need only the best candidate: no 49k exps per sequence and token, and no
    probability can be made from such summaries (an error, not a wrong number)."""
    greedy = SamplingParams(temperature=0.0)
    s = summarize(logits_row(7), 0, greedy)
    assert s.lse is None and LogitSummary.from_wire(s.to_wire()).lse is None
    with pytest.raises(ValueError, match="log-sum-exp"):
        global_lse([s])
    with_target = summarize(logits_row(7), 0, greedy, target=3)
    assert with_target.lse == pytest.approx(log_sum_exp_ref(logits_row(7)), rel=1e-14)


# ------------------------------------------------------------------ extremes: never NaN


_F32 = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1e-12, 1e-10, 1e-5, 0.7, 2.0, 1e6])
@pytest.mark.parametrize("penalty", [1.0, 1e-3, 1e3])
def test_extreme_logits_and_parameters_give_a_valid_pick(temperature, penalty):
    """Whatever finite logits a model gives (float32's largest, both signs, ties, a lone huge one) and
    whatever temperature and penalty pass the checks, a split summary picks a real candidate with
    no NaN on the way (numpy's warnings are errors here: a NaN probability was a 500 before)."""
    rows = [np.array([_F32, -_F32, 0.0, 1e-45, _F32, -1.0] * 50, np.float32),
            np.full(300, -_F32, np.float32),
            np.full(300, 7.0, np.float32),
            np.where(np.arange(300) == 123, _F32, -_F32).astype(np.float32),
            logits_row(3, 300, scale=1e30)]
    params = SamplingParams(temperature=temperature, top_k=0, top_p=0.95, repeat_penalty=penalty, seed=5)
    assert params.problem() is None
    for row in rows:
        with np.errstate(invalid="raise", divide="raise", over="raise"):
            for n in (1, 3):
                summaries = split_summaries(row, params, n, seed=n, recent=list(range(0, 300, 7)))
                assert all(s.lse is None or np.isfinite(s.lse) for s in summaries)
                assert all(np.isfinite(s.logits).all() for s in summaries)
                token = Sampler(params).pick(summaries)
                assert 0 <= token < len(row)


def test_a_temperature_below_the_minimum_is_greedy():
    """A subnormal temperature (1e-308, 5e-324: logit / T leaves float64) picks as temperature 0 does,
    its ties included; the smallest temperature that samples keeps its math finite."""
    from dllama.sampling import MIN_TEMPERATURE

    row = logits_row(11)
    row[[5, 900]] = row.max() + 1  # a tie for the best: greedy takes the lowest id
    for t in (5e-324, 1e-308, MIN_TEMPERATURE / 2):
        params = SamplingParams(temperature=t, seed=1)
        assert params.greedy
        assert Sampler(params).pick(split_summaries(row, params, 3)) == 5
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e7),
    ("temperature", "1"), ("top_p", -0.1), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -1), ("top_k", 1.5),
    ("repeat_penalty", 0.0), ("repeat_penalty", 1e-308), ("repeat_penalty", -1.0), ("repeat_penalty", 1e4),
    ("repeat_penalty", float("nan")), ("repeat_last_n", -1), ("seed", 1.5), ("top_k", True)])
def test_values_outside_the_ranges_are_named(field, value):
    params = SamplingParams(**{field: value})
    assert params.problem() is not None and params.problem()[0] == field
