"""The model's shape: what every node needs to know to run its slice (sent to workers as a dict)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    dim: int  # embedding length
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # hidden dimension of the SwiGLU FFN
    vocab_size: int
    context_length: int  # what the model was trained for
    rope_base: float
    rope_dims: int  # leading dims of each head that are rotated
    rope_neox: bool  # pair dim i with i + rope_dims/2 (NeoX) instead of 2i with 2i+1
    norm_eps: float
    tied_embeddings: bool  # LM head reuses token_embd
    bos_id: int | None = None
    eos_id: int | None = None

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
