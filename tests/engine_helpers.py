"""Helpers for the single-node engine tests: our logits and llama.cpp's on the same tokens, the
figures that compare them, and llama.cpp's greedy decoding (the reference for ours)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"

# Synthetic models, by name. Tiny ones cover each weight format and other head layouts (MQA, no
# GQA, untied LM head); "big" has the shapes of a 1B-class model with only 2 layers.
SYNTHETIC_SPECS = {
    # native formats, checked bit for bit against llama.cpp
    "Q8_0": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, qtype="Q8_0", tied_embeddings=True, seed=1),
    "Q4_1": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q4_1", tied_embeddings=False, seed=2),
    "F16": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=288, qtype="F16", tied_embeddings=False, seed=3),
    "Q5_0": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q5_0", tied_embeddings=False, seed=5),
    "Q5_1": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q5_1", tied_embeddings=True, seed=7),
    # F16, for llama.cpp's quantizer to turn into K-quants (dims multiples of 256: K-quants everywhere)
    "F16-256": dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1024, qtype="F16", tied_embeddings=False,
                    seed=21),
    # Q4_0: llama.cpp repacks it (its repacked kernels' order, which ours follow); BF16 is converted on load
    "Q4_0": dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, qtype="Q4_0", tied_embeddings=False, seed=4),
    "BF16": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="BF16", tied_embeddings=True, seed=6),
    # RoPE scaling as Llama-family GGUFs declare it (llama.cpp applies it; a context of 32 so
    # that YaRN's ramp falls inside the 16 rotated pairs)
    "rope-linear": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q8_0", seed=9,
                        rope_scaling=("linear", 4.0, 32)),
    "rope-yarn": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q8_0", seed=10,
                      rope_scaling=("yarn", 4.0, 32)),
    # other architectures, in the shapes of their real families (2 layers)
    "llama-bias": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q8_0", seed=11,
                       attn_bias=True, attn_out_bias=True, ffn_bias=True),
    "qwen2": dict(arch="qwen2", dim=896, n_layers=2, n_heads=14, n_kv_heads=2, ffn_dim=4864, qtype="Q8_0",
                  rope_base=1e6, tied_embeddings=True, attn_bias=True, seed=12),  # Qwen2.5-0.5B
    "qwen3": dict(arch="qwen3", dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                  qtype="Q8_0", rope_base=1e6, tied_embeddings=True, qk_norm=True, seed=13),  # Qwen3-0.6B
    # Qwen3-MoE: Qwen3-30B-A3B's head_dim 128, 8 query heads per KV head and 768-wide experts; 16
    # experts, routed top-2 and top-8 (its router F32, as llama.cpp's quantize leaves it)
    "qwen3moe-top2": dict(arch="qwen3moe", dim=1024, n_layers=2, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=768,
                          n_experts=16, n_experts_used=2, qtype="Q8_0", rope_base=1e6, qk_norm=True, seed=15),
    "qwen3moe-top8": dict(arch="qwen3moe", dim=1024, n_layers=2, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=768,
                          n_experts=16, n_experts_used=8, qtype="Q8_0", rope_base=1e6, qk_norm=True, seed=16),
    # Gemma 3 1B's layer; a window of 32 and a local/global pattern of 2 so that 96 tokens cross
    # the window and both layer kinds appear; an untied LM head (tied, random embeddings scaled
    # by sqrt(dim) make every token predict itself, whatever the layers compute)
    "gemma3": dict(arch="gemma3", dim=1152, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                   qtype="Q8_0", rope_base=1e6, qk_norm=True, post_norms=True, sliding_window=32, swa_pattern=2,
                   seed=17),
    "gemma3-softcap": dict(arch="gemma3", dim=256, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=64, ffn_dim=512,
                           qtype="Q8_0", qk_norm=True, post_norms=True, sliding_window=32, swa_pattern=2,
                           logit_softcap=1.0, seed=18),  # a cap near these logits' spread, as 30 is to Gemma 2's
    "qwen3moe-tiny": dict(arch="qwen3moe", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=128,
                          n_experts=8, n_experts_used=2, qtype="Q8_0", qk_norm=True, seed=19),
    "qwen3-tiny": dict(arch="qwen3", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                       qtype="Q8_0", qk_norm=True, seed=14),
    # the big shapes, 2 layers: dim 2048, 32 heads / 8 KV heads, FFN 8192, Q4_0, untied LM head
    "big": dict(dim=2048, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=8192, qtype="Q4_0", tied_embeddings=False,
                seed=8),
}

TEXT_FILE = DATA / "lighthouse.txt"  # ~3.3 KB of plain English written for these tests (~730 tokens)


def text() -> str:
    return TEXT_FILE.read_text(encoding="utf-8")


def write_synthetic_model(path: str, spec: dict, tokenizer_gguf: str) -> None:
    import dllama.synthetic as synthetic

    synthetic.write_synthetic(path, synthetic.SyntheticSpec(**spec), tokenizer_gguf)


# ------------------------------------------------------------------ our side


def shard_model(model, ctx: int):
    """The 1-node shard model (holds everything) of a GGUFModel."""
    from dllama.model import ShardModel, ShardWeights
    from dllama.plan import Plan

    shard = Plan.single(model.config).shards[0]
    return ShardModel(model.config, shard, ShardWeights.from_gguf(model, shard), ctx)


async def forward_at(m, x: np.ndarray, start: int, comm=None) -> np.ndarray:
    """ShardModel.forward of one sequence (slot 0, its cache a whole context) at position start."""
    from dllama.kv_cache import round_capacity
    from dllama.model import Span
    from dllama.projection import ALONE

    m.kv.resize(0, round_capacity(m.ctx_size))
    return await m.forward(x, [Span(0, start, x.shape[0])], ALONE if comm is None else comm)


async def our_logits(model, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """Teacher-forced logits (len(tokens), vocab), computed `chunk` tokens per forward pass
    (all at once by default), so later chunks read the KV cache of earlier ones."""
    m = shard_model(model, len(tokens))
    embedding = model.matrix("token_embd.weight")
    chunk = chunk or len(tokens)
    out = []
    for start in range(0, len(tokens), chunk):
        ids = np.array(tokens[start:start + chunk])
        h = await forward_at(m, embedding.row_values(ids), start)
        out.append(m.logits(h))
    return np.concatenate(out)


# ------------------------------------------------------------------ llama.cpp's side


def ref_logits(llama, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position, all tokens in one batch (the Llama must have
    logits_all=True): its batched order (sgemm) for the matmuls and the attention."""
    llama.reset()
    llama.eval(tokens)
    return np.array(llama.scores[:len(tokens)], dtype=np.float32)


def ref_logits_one_by_one(llama, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position, one token per evaluation: its decode path, whose
    summation order our kernels follow for every token."""
    llama.reset()
    for t in tokens:
        llama.eval([t])
    return np.array(llama.scores[:len(tokens)], dtype=np.float32)


@dataclass
class GreedyRun:
    """llama.cpp's greedy continuation and its logits at each step (also at a final
    end-of-generation pick)."""

    tokens: list[int]
    logits: list[np.ndarray]

    @property
    def margins(self) -> list[float]:
        """top-1 minus top-2 logit at each step."""
        return [float(np.diff(np.sort(row)[-2:])[0]) for row in self.logits]


def llama_greedy_run(llama, prompt: list[int], n: int, is_eog=None) -> GreedyRun:
    """llama.cpp's greedy decoding the way a token-by-token decoder runs: every token, prompt
    included, evaluated alone; argmax; eval the pick; ... Stops before an end-of-generation token
    (not included) or after n tokens."""
    llama.reset()
    for t in prompt:
        llama.eval([t])
    run = GreedyRun([], [])
    while len(run.tokens) < n:
        run.logits.append(np.array(llama.scores[llama.n_tokens - 1], dtype=np.float32))
        token = int(np.argmax(run.logits[-1]))
        if is_eog is not None and is_eog(token):
            break
        run.tokens.append(token)
        if len(run.tokens) < n:
            llama.eval([token])
    return run


def llama_greedy(llama, prompt: list[int], n: int, is_eog=None) -> list[int]:
    return llama_greedy_run(llama, prompt, n, is_eog).tokens


# Where llama.cpp's top-2 logits are closer than this, a different greedy pick is a near-tie. On
# the default model its own two paths (batched vs one token at a time, AVX-512 build) pick
# differently at margins up to 0.30 logit (26 of 734 teacher-forced positions), so a summation
# order other than its build's can flip picks there too.
NEAR_TIE = 0.5


def greedy_divergence(ours: list[int], ref: GreedyRun) -> str | None:
    """None if our greedy tokens are llama.cpp's; else why a divergence is not acceptable. A
    divergence is accepted only at a near-tie: our pick's logit (in llama.cpp's logits) within
    NEAR_TIE of llama.cpp's best. After it the two continuations are different texts.
    Bit-exact builds (bit_exact_expected) must not diverge at all."""
    k = next((i for i, (a, b) in enumerate(zip(ours, ref.tokens)) if a != b), min(len(ours), len(ref.tokens)))
    if k == len(ours) == len(ref.tokens):
        return None
    if bit_exact_expected():
        return f"diverges at token {k}, where llama.cpp takes our kernels' path (expected bit-exact)"
    if k >= len(ref.logits):
        return f"ours goes on after llama.cpp's {k} tokens"
    row = ref.logits[k]
    # our pick at k, or (if we stopped there) the best end-of-generation candidate is unknown:
    # then llama.cpp's own top-2 margin must be the near-tie
    gap = float(row.max() - row[ours[k]]) if k < len(ours) else ref.margins[k]
    if gap >= NEAR_TIE:
        return (f"diverges at token {k}: our pick is {gap:.3f} below llama.cpp's best logit "
                f"(not a near-tie < {NEAR_TIE})")
    print(f"greedy: accepted divergence at token {k}, {gap:.4f} below llama.cpp's best logit (< {NEAR_TIE})")
    return None


# ------------------------------------------------------------------ comparing distributions


def log_softmax(logits: np.ndarray) -> np.ndarray:
    a = logits.astype(np.float64)
    a = a - a.max(axis=-1, keepdims=True)
    return a - np.log(np.exp(a).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, ours: np.ndarray) -> dict:
    """Top-1 agreement and mean KL(ref || ours) over positions, and how many logits are bit-equal."""
    assert ref.shape == ours.shape, (ref.shape, ours.shape)
    assert np.isfinite(ours).all(), "our logits contain inf/nan"
    lp_ref, lp_ours = log_softmax(ref), log_softmax(ours)
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1)
    return {
        "positions": ref.shape[0],
        "top1": float((ref.argmax(-1) == ours.argmax(-1)).mean()),
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "bit_equal": float((ref == ours).mean()),
    }


@functools.cache
def bit_exact_expected() -> bool:
    """Our kernels reproduce GGML's x86 AVX2 accumulation order. llama.cpp takes that path when it
    is built with AVX2 and without AVX-512 (which sums in another order)."""
    import llama_cpp

    from dllama.kernels.simd import _X86_AVX2

    info = llama_cpp.llama_print_system_info().decode()
    return bool(_X86_AVX2) and "AVX2 = 1" in info and "AVX512 = 1" not in info


BIT_EXACT_REASON = "llama.cpp sums in another order on this CPU (no AVX2, or AVX-512): logits agree, not bit for bit"
