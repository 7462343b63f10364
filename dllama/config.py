"""The model's shape: what every node needs to know to run its slice (sent to workers as a dict)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE angles are scaled, in the terms of GGML's rope_yarn: angles times freq_scale
    (linear scaling: 1/factor); with YaRN (ext_factor 1) the dims between corr_dims blend the
    scaled and unscaled angles; cos and sin are multiplied by mscale. The defaults: plain RoPE."""

    freq_scale: float = 1.0
    ext_factor: float = 0.0
    corr_dims: tuple[float, float] = (0.0, 0.0)
    mscale: float = 1.0

    @classmethod
    def from_gguf(cls, kind: str, factor: float, attn_factor: float, n_dims: int, base: float,
                  orig_ctx: int) -> "RopeScaling":
        """As llama.cpp derives them from GGUF metadata (llama_model::load_hparams, llama_context's
        cparams, with its default YaRN betas 32 and 1), in float32 where it computes in float."""
        f32 = np.float32
        if kind == "none" or factor == 0.0:
            return cls(mscale=float(f32(attn_factor)))
        freq_scale = f32(1.0) / f32(factor)
        if kind == "linear":
            return cls(freq_scale=float(freq_scale), mscale=float(f32(attn_factor)))
        assert kind == "yarn", kind
        scale = f32(1.0) / freq_scale
        # get_mscale(factor, 1) / (1 + 0.1 ln factor): 1 up to rounding, as llama.cpp leaves it
        growth = _fma32(f32(0.1), f32(math.log(scale)), f32(1.0))  # 1 + 0.1 ln factor, contracted as in C
        mscale = (f32(1.0) if scale <= 1 else growth) * (f32(1.0) / growth) * f32(attn_factor)

        def corr_dim(beta: float) -> float:
            return float(f32(n_dims) * f32(math.log(f32(orig_ctx) / (f32(beta) * f32(2) * f32(math.pi))))
                         / (f32(2) * f32(math.log(f32(base)))))

        lo, hi = max(0.0, float(math.floor(corr_dim(32.0)))), min(n_dims - 1.0, float(math.ceil(corr_dim(1.0))))
        return cls(freq_scale=float(freq_scale), ext_factor=1.0, corr_dims=(lo, hi), mscale=float(mscale))


def _fma32(a, b, c) -> np.float32:
    """a*b + c rounded once to float32 (the product is exact in float64)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    dim: int  # embedding length
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # hidden dimension of the gated FFN (of each expert, in a mixture of experts)
    vocab_size: int
    context_length: int  # what the model was trained for
    rope_base: float
    rope_dims: int  # leading dims of each head that are rotated
    rope_neox: bool  # pair dim i with i + rope_dims/2 (NeoX) instead of 2i with 2i+1
    norm_eps: float
    tied_embeddings: bool  # LM head reuses token_embd
    # what a layer has beyond a Llama layer (see architectures.py); the same in every layer
    attn_bias: bool = False  # Q/K/V biases
    attn_out_bias: bool = False  # attention output bias
    ffn_bias: bool = False  # FFN gate and up biases
    ffn_down_bias: bool = False  # FFN down bias
    qk_norm: bool = False  # per-head RMS norm of Q and K
    post_norms: bool = False  # RMS norms of the attention and FFN outputs before the residual adds (Gemma)
    activation: str = "silu"  # the FFN gate's: silu (SwiGLU) or gelu (GELU-tanh, GeGLU)
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(dim))
    attn_q_scale: float = 0.0  # Q is multiplied by it before attention (Gemma); 0: scores by 1/sqrt(head_dim)
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) if > 0
    # sliding-window attention (Gemma 3): a local layer's token sees the last `sliding_window`
    # positions, itself included, and rotates with base rope_base_local and no scaling; layer i is
    # local unless i % swa_pattern == swa_pattern - 1 (0: every layer is local)
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_base_local: float = 10000.0
    # mixture of experts (Qwen3-MoE): a replicated router picks n_experts_used of n_experts SwiGLU
    # FFNs per token (softmax, top-k, weights renormalized to sum 1)
    n_experts: int = 0
    n_experts_used: int = 0
    # the unit the plan splits FFN hidden units in: a quant block (32), or a K-quant super-block
    # (256) where the FFN down projection is one (its columns are cut at those units)
    ffn_block: int = 32
    # RoPE scaling (RopeScaling's fields, flat so the config travels as plain numbers)
    rope_freq_scale: float = 1.0
    rope_ext_factor: float = 0.0
    rope_corr_lo: float = 0.0
    rope_corr_hi: float = 0.0
    rope_mscale: float = 1.0
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def rope_scaling(self) -> RopeScaling:
        return RopeScaling(self.rope_freq_scale, self.rope_ext_factor, (self.rope_corr_lo, self.rope_corr_hi),
                           self.rope_mscale)

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends over a sliding window (with its own RoPE base)."""
        p = self.swa_pattern
        return self.sliding_window > 0 and (p == 0 or layer % p < p - 1)

    def rope_of_layer(self, layer: int) -> tuple[float, RopeScaling]:
        """(RoPE base, scaling) of a layer: local layers rotate unscaled with their own base."""
        if self.is_local(layer):
            return self.rope_base_local, RopeScaling(mscale=self.rope_mscale)
        return self.rope_base, self.rope_scaling

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
