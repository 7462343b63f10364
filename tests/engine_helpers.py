"""Helpers for the single-node engine tests: our logits and llama.cpp's on the same tokens, the
figures that compare them, and llama.cpp's greedy decoding (the reference for ours)."""

from __future__ import annotations

import functools
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
    # Q4_0: llama.cpp repacks it (another summation order); Q5_0 and BF16 are converted on load
    "Q4_0": dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, qtype="Q4_0", tied_embeddings=False, seed=4),
    "Q5_0": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q5_0", tied_embeddings=False, seed=5),
    "BF16": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="BF16", tied_embeddings=True, seed=6),
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


async def our_logits(model, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """Teacher-forced logits (len(tokens), vocab), computed `chunk` tokens per forward pass
    (all at once by default), so later chunks read the KV cache of earlier ones."""
    m = shard_model(model, len(tokens))
    embedding = model.matrix("token_embd.weight")
    chunk = chunk or len(tokens)
    out = []
    for start in range(0, len(tokens), chunk):
        ids = np.array(tokens[start:start + chunk])
        h = await m.forward(embedding.row_values(ids), start)
        out.append(m.logits(h))
    return np.concatenate(out)


# ------------------------------------------------------------------ llama.cpp's side


def ref_logits(llama, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position (the Llama must have logits_all=True)."""
    llama.reset()
    llama.eval(tokens)
    return np.array(llama.scores[:len(tokens)], dtype=np.float32)


def llama_greedy(llama, prompt: list[int], n: int, is_eog=None) -> list[int]:
    """llama.cpp's greedy continuation: eval, argmax, eval the pick, ...; stops before an
    end-of-generation token (not included) or after n tokens."""
    llama.reset()
    llama.eval(prompt)
    out: list[int] = []
    while len(out) < n:
        token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
        if is_eog is not None and is_eog(token):
            break
        out.append(token)
        if len(out) < n:
            llama.eval([token])
    return out


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
