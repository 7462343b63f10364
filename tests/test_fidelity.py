"""Fidelity against llama.cpp (llama-cpp-python): greedy decoding and teacher-forced logits on the
default model, and synthetic models in every weight format, including one with a 1B-class
model's shapes.

Judged against llama.cpp's own spread, measured in the same run: its batched evaluation against
its one-token-at-a-time evaluation (its decode path, whose summation order our kernels follow for
every token). Where llama.cpp itself takes that path with our kernels' order (an AVX2 build
without AVX-512), the logits must be bit-identical; elsewhere those tests are skipped with the
reason, and the figures hold to factors of llama.cpp's own disagreement."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.engine import LocalEngine
from dllama.generate import Generator
from dllama.gguf_model import GGUFModel
from dllama.sampling import SamplingParams

from .engine_helpers import (BIT_EXACT_REASON, bit_exact_expected, compare, greedy_divergence, llama_greedy_run,
                             our_logits, ref_logits, ref_logits_one_by_one, text)

pytestmark = pytest.mark.usefixtures("one_compute_thread")

GREEDY = SamplingParams(temperature=0.0)
# Ours against llama.cpp's decode path may disagree at most this many times as often (top-1) or
# as much (mean KL) as llama.cpp's batched path disagrees with its decode path. Measured on an
# AVX-512 EPYC: KL 3.06e-3 vs its own 2.98e-3, top-1 disagreement 3.3% vs its own 3.5%.
SPREAD_FACTOR = 2.0
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "The three primary colors are",
    "<|im_start|>user\nGive me three tips for a good night's sleep.<|im_end|>\n<|im_start|>assistant\n",
]


# ------------------------------------------------------------------ default model


def _prompt_ids(tokenizer, prompt):
    return tokenizer.encode(prompt, special="<|im_start|>" in prompt)


@pytest.fixture(scope="module")
def our_greedy(gguf_model, tokenizer):
    """Our greedy continuation (32 tokens, one at a time through Generator) of each prompt."""
    import asyncio

    async def run(prompt):
        gen = await Generator(LocalEngine(gguf_model, 256), tokenizer).generate(
            _prompt_ids(tokenizer, prompt), GREEDY, 32)
        assert len(gen.tokens) == 32 or gen.finish_reason == "stop"
        return gen.tokens

    return {p: asyncio.run(run(p)) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p[:24])
def test_greedy_decode_equals_llama_cpp(tokenizer, model_path, llama_ref, our_greedy, prompt):
    """32 tokens token by token: ours against llama.cpp's decode loop (every token evaluated
    alone); a divergence only at a near-tie of llama.cpp's own logits (engine_helpers.NEAR_TIE)."""
    ids = _prompt_ids(tokenizer, prompt)
    ref = llama_greedy_run(llama_ref(model_path, 1024), ids, 32, tokenizer.is_eog)
    ours = our_greedy[prompt]
    print(f"\ngreedy {prompt[:24]!r}: llama.cpp's smallest top-2 margin {min(ref.margins):.4f}")
    why = greedy_divergence(ours, ref)
    assert why is None, f"{why}\nours: {tokenizer.decode(ours)!r}\nllama.cpp: {tokenizer.decode(ref.tokens)!r}"


@pytest.fixture(scope="module")
def teacher_forced(gguf_model, tokenizer, model_path, llama_ref):
    """llama.cpp's logits over the whole test text (batched and one token at a time) and ours
    (in 256-token prefill chunks, as the engine runs)."""
    import asyncio

    tokens = tokenizer.encode(text())
    llama = llama_ref(model_path, 1024)
    batched = ref_logits(llama, tokens)
    one_by_one = ref_logits_one_by_one(llama, tokens)
    ours = asyncio.run(our_logits(gguf_model, tokens, chunk=256))
    return tokens, batched, one_by_one, ours


def test_teacher_forced_logits_within_llama_cpp_s_own_spread(teacher_forced):
    tokens, batched, one_by_one, ours = teacher_forced
    own, figures = compare(one_by_one, batched), compare(one_by_one, ours)
    print(f"\nteacher-forced, default model, {figures['positions']} positions, against llama.cpp one token at a time:"
          f"\n  llama.cpp batched: top-1 {own['top1']:.2%}, mean KL {own['kl']:.3g} (max {own['kl_max']:.3g})"
          f"\n  ours:              top-1 {figures['top1']:.2%}, mean KL {figures['kl']:.3g} "
          f"(max {figures['kl_max']:.3g}), bit-equal logits {figures['bit_equal']:.2%}")
    assert figures["positions"] >= 500
    assert own["kl"] > 0, "llama.cpp's two paths gave identical logits: no spread to judge against"
    assert figures["kl"] <= SPREAD_FACTOR * own["kl"]
    assert 1 - figures["top1"] <= SPREAD_FACTOR * (1 - own["top1"]) + 1 / figures["positions"]


@pytest.mark.skipif(not bit_exact_expected(), reason=BIT_EXACT_REASON)
def test_teacher_forced_logits_are_bit_identical(teacher_forced):
    """Our prefill (256-token chunks) gives llama.cpp's one-token-at-a-time logits, bit for bit."""
    _, _, one_by_one, ours = teacher_forced
    np.testing.assert_array_equal(ours, one_by_one)


# ------------------------------------------------------------------ synthetic models


def _synthetic_figures(path, llama_ref, tokenizer, n_tokens):
    """Ours, and llama.cpp's decode path, on the first n_tokens of the text; the figures compare
    ours to it and llama.cpp's batched path to it (its own spread)."""
    import asyncio

    model = GGUFModel(path)
    tokens = tokenizer.encode(text())[:n_tokens]
    llama = llama_ref(path, 256)
    ref, batched = ref_logits_one_by_one(llama, tokens), ref_logits(llama, tokens)
    ours = asyncio.run(our_logits(model, tokens))
    figures, own = compare(ref, ours), compare(ref, batched)
    figures["llama_cpp_own_kl"], figures["llama_cpp_own_top1"] = own["kl"], own["top1"]
    return ref, ours, figures


# The floor of the KL bound: on 96 tokens of a 2-layer model llama.cpp's two paths may agree exactly;
# a missing feature shows at ~1e-3 and more (ignored YaRN: KL 2.4e-3, top-1 0.66).
@pytest.mark.parametrize("name", [
    "Q8_0", "Q4_1", "F16", "Q5_0", "Q5_1",  # native formats
    "llama-bias", "qwen2", "qwen3",  # Llama with attention and FFN biases, Qwen2 (Q/K/V biases, NeoX RoPE), Qwen3
    "qwen3moe-top2", "qwen3moe-top8",  # Qwen3-MoE: router, top-k experts
    "gemma3", "gemma3-softcap",  # Gemma 3: post-norms, GELU, scaled embeddings, sliding window, soft-capping
    "rope-linear", "rope-yarn",  # RoPE scaling as llama.cpp reads it (ignored, they gave KL 60-80x its spread)
])
def test_synthetic_models(synthetic_model, llama_ref, tokenizer, name):
    """Bit-identical where llama.cpp takes our kernels' path, else within its own spread."""
    # a mixture of experts: a near-tie in the router flips a token's expert (in llama.cpp's two
    # paths too), a rare event: more positions for a stable figure
    n = 240 if name.startswith("qwen3moe") else 96
    ref, ours, figures = _synthetic_figures(synthetic_model(name), llama_ref, tokenizer, n)
    print(f"\nsynthetic {name}: {figures}")
    own_misses = round((1 - figures["llama_cpp_own_top1"]) * n)
    assert round((1 - figures["top1"]) * n) <= SPREAD_FACTOR * own_misses + 1, figures
    assert figures["kl"] <= max(SPREAD_FACTOR * figures["llama_cpp_own_kl"], 1e-4), figures
    if bit_exact_expected():
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name", ["llama-bias", "qwen2", "qwen3", "qwen3moe-top2", "qwen3moe-top8", "gemma3"])
def test_synthetic_architectures_greedy(synthetic_model, llama_ref, tokenizer, name):
    """24 tokens greedy, one at a time through the Generator: llama.cpp's token-by-token decode,
    a divergence only at a near-tie of its own logits (exactly where it takes our kernels' path)."""
    import asyncio

    path = synthetic_model(name)
    prompt = tokenizer.encode(PROMPTS[1])
    ref = llama_greedy_run(llama_ref(path, 256), prompt, 24)
    gen = asyncio.run(Generator(LocalEngine(GGUFModel(path), 256), tokenizer).generate(prompt, GREEDY, 24))
    why = greedy_divergence(gen.tokens, ref)
    assert why is None, f"{why}\nours: {gen.tokens}\nllama.cpp: {ref.tokens}"


# Each family feature, left out, moves the answer far outside llama.cpp's spread: the test above
# would catch an engine that ignored it. (field, value as if the feature were ignored)
FEATURES_IGNORED = {
    "llama-bias": [("attn_bias", False), ("attn_out_bias", False), ("ffn_bias", False), ("ffn_down_bias", False)],
    "qwen3moe-top2": [("n_experts_used", 1)],  # top-1 instead of the file's top-2
    "qwen3moe-top8": [("n_experts_used", 2)],
    "gemma3": [("sliding_window", 0), ("swa_pattern", 0), ("rope_base_local", 1e6), ("embedding_scale", 1.0),
               ("activation", "silu"), ("post_norms", False)],
    "gemma3-softcap": [("logit_softcap", 0.0)],
}


@pytest.mark.parametrize("name", list(FEATURES_IGNORED))
def test_each_family_feature_changes_the_answer(synthetic_model, llama_ref, tokenizer, name):
    import asyncio
    import dataclasses

    path = synthetic_model(name)
    tokens = tokenizer.encode(text())[:96]
    llama = llama_ref(path, 256)
    ref = ref_logits_one_by_one(llama, tokens)
    own_kl = compare(ref, ref_logits(llama, tokens))["kl"]
    for field, value in FEATURES_IGNORED[name]:
        model = GGUFModel(path)
        model.config = dataclasses.replace(model.config, **{field: value})
        figures = compare(ref, asyncio.run(our_logits(model, tokens)))
        print(f"\n{name} with {field}={value!r}: {figures}")
        assert figures["kl"] > 10 * max(SPREAD_FACTOR * own_kl, 1e-4), (field, figures)


# (ftype, source): SmolLM2 (dim 576: llama.cpp's K-quant mixes fall back to Q5_0/Q8_0 where a row
# is not whole super-blocks), or a synthetic model of dims multiple of 256 (K-quants everywhere)
# SmolLM2 in IQ4_NL (llama.cpp's quantizer takes ~40 s for it) repeats the synthetic model's check at
# the real size: marked slow (make test-all)
REQUANTIZED = [("Q5_0", None), ("Q5_1", None), ("IQ4_NL", "F16-256"), ("Q4_K_M", None), ("Q4_K_M", "F16-256"),
               ("Q5_K_M", "F16-256"), ("Q6_K", "F16-256"), ("IQ4_NL", None)]


@pytest.mark.parametrize("ftype, source", [
    pytest.param(f, s, id=f"{f}-{s or 'smollm2'}", marks=[pytest.mark.slow] if (f, s) == ("IQ4_NL", None) else [])
    for f, s in REQUANTIZED])
def test_requantized_by_llama_cpp_runs_native(requantized_model, llama_ref, tokenizer, ftype, source):
    """A model re-quantized by llama.cpp's quantizer: every weight used in its own format (no
    conversion: the weights in RAM are the file's bytes), the logits within llama.cpp's spread
    (bit for bit where it takes our path). llama.cpp's mixes give some tensors more bits: its
    IQ4_NL puts a few FFN down projections in Q5_K, Q4_K_M some in Q6_K."""
    path = requantized_model(ftype, source=source)
    model = GGUFModel(path)
    engine = LocalEngine(model, 256)
    assert not model._converted, f"converted on load: {sorted(model._converted)}"
    assert engine.model.weights.nbytes <= 1.05 * model.file_size
    del engine
    n = 128
    ref, ours, figures = _synthetic_figures(path, llama_ref, tokenizer, n)
    print(f"\n{source or 'SmolLM2'} {ftype}: {figures}")
    own_misses = round((1 - figures["llama_cpp_own_top1"]) * n)
    assert round((1 - figures["top1"]) * n) <= SPREAD_FACTOR * own_misses + 1, figures
    assert figures["kl"] <= max(SPREAD_FACTOR * figures["llama_cpp_own_kl"], 1e-4), figures
    if bit_exact_expected():  # (Q4_0, IQ4_NL, Q4_K: in the order of the kernels llama.cpp repacks them for)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name", ["Q4_0", "BF16"])
def test_synthetic_other_formats_close(synthetic_model, llama_ref, tokenizer, name):
    """Q4_0: llama.cpp repacks it and sums in the order of its repacked kernels, which ours follow
    (bit for bit where llama.cpp takes our path elsewhere); BF16 -> F16 on load."""
    ref, ours, figures = _synthetic_figures(synthetic_model(name), llama_ref, tokenizer, 96)
    print(f"\nsynthetic {name}: {figures}")
    assert figures["kl"] <= 0.02 and figures["top1"] >= 0.90, figures
    assert figures["kl"] <= 2e-3, figures  # observed ~1e-4 at most: a 10x margin under the bound
    if name == "Q4_0" and bit_exact_expected():
        np.testing.assert_array_equal(ours, ref)


def test_synthetic_big_shapes(synthetic_model, llama_ref, tokenizer):
    """dim 2048, 32 heads / 8 KV heads, FFN 8192, Q4_0, untied LM head (2 layers)."""
    path = synthetic_model("big")
    cfg = GGUFModel(path).config
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.tied_embeddings) == (2048, 32, 8, 8192, False)
    ref, ours, figures = _synthetic_figures(path, llama_ref, tokenizer, 48)
    print(f"\nsynthetic big: {figures}")
    assert ours.shape == (48, cfg.vocab_size)
    assert figures["kl"] <= 0.02 and figures["top1"] >= 0.90, figures
    assert figures["kl"] <= 2e-3, figures
    if bit_exact_expected():
        np.testing.assert_array_equal(ours, ref)
