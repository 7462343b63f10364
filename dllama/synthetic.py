"""Synthetic GGUF models: random weights, real llama metadata, the default model's tokenizer.

They stand in for bigger models we cannot download here (e.g. a 1B-class model for the cluster
benchmarks) and for architectures the default model does not exercise (untied LM head, other
head counts, other weight formats). llama.cpp loads them like any other GGUF, so they are
checked against it the same way. Weights are generated and written one tensor at a time, so a
1B model never has to fit in memory as floats.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType
from gguf import quants as gguf_quants

from .errors import DllamaError


@dataclass(frozen=True)
class SyntheticSpec:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    qtype: str = "Q4_0"  # any type gguf-py can quantize: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, F16, BF16, F32
    context_length: int = 4096
    rope_base: float = 10000.0
    tied_embeddings: bool = False
    seed: int = 0
    rope_scaling: tuple[str, float, int] | None = None  # (type, factor, original context length)
    arch: str = "llama"  # the GGUF architecture name (llama, qwen2, qwen3: see architectures.py)
    head_dim: int | None = None  # default dim / n_heads; Qwen3 has larger heads
    attn_bias: bool = False  # attn_q/k/v.bias (Qwen2 has them; Llama GGUFs may)
    attn_out_bias: bool = False  # attn_output.bias
    qk_norm: bool = False  # attn_q_norm / attn_k_norm (Qwen3)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


PRESETS = {
    # fast enough for tests
    "tiny": SyntheticSpec(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768, qtype="Q4_0"),
    # a 1B-class model for the cluster benchmarks (~1.1 B parameters, ~630 MB as Q4_0)
    "1b": SyntheticSpec(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, qtype="Q4_0"),
    # other architectures, in the shapes of their smallest real models
    "qwen2": SyntheticSpec(arch="qwen2", dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, qtype="Q8_0",
                           rope_base=1e6, tied_embeddings=True, attn_bias=True),  # Qwen2.5-0.5B
    "qwen3": SyntheticSpec(arch="qwen3", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                           qtype="Q8_0", rope_base=1e6, tied_embeddings=True, qk_norm=True),  # Qwen3-0.6B
}

_TOKENIZER_KEYS_SKIPPED = {"tokenizer.ggml.add_space_prefix"}


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str, mtime: float) -> tuple[int, list[tuple[str, object, GGUFValueType, object]]]:
    """(vocabulary size, the tokenizer's metadata as (key, value, type, item type)) of a GGUF.
    Read with gguf-py (its values are needed, not only their size): seconds on a real
    vocabulary, so kept for the next model written from the same source."""
    source = GGUFReader(path)
    fields = []
    for key, field in source.fields.items():
        if key.startswith("tokenizer.") and key not in _TOKENIZER_KEYS_SKIPPED:
            vtype = field.types[0]
            fields.append((key, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None))
    return len(source.fields["tokenizer.ggml.tokens"].data), fields


def _tensor_plan(spec: SyntheticSpec, vocab: int):
    """(name, shape as (rows, cols), is_matrix) in GGUF order."""
    hd = spec.head_size
    yield "token_embd.weight", (vocab, spec.dim), True
    for i in range(spec.n_layers):
        yield f"blk.{i}.attn_norm.weight", (spec.dim,), False
        yield f"blk.{i}.attn_q.weight", (spec.n_heads * hd, spec.dim), True
        yield f"blk.{i}.attn_k.weight", (spec.n_kv_heads * hd, spec.dim), True
        yield f"blk.{i}.attn_v.weight", (spec.n_kv_heads * hd, spec.dim), True
        if spec.attn_bias:
            yield f"blk.{i}.attn_q.bias", (spec.n_heads * hd,), False
            yield f"blk.{i}.attn_k.bias", (spec.n_kv_heads * hd,), False
            yield f"blk.{i}.attn_v.bias", (spec.n_kv_heads * hd,), False
        if spec.qk_norm:
            yield f"blk.{i}.attn_q_norm.weight", (hd,), False
            yield f"blk.{i}.attn_k_norm.weight", (hd,), False
        yield f"blk.{i}.attn_output.weight", (spec.dim, spec.n_heads * hd), True
        if spec.attn_out_bias:
            yield f"blk.{i}.attn_output.bias", (spec.dim,), False
        yield f"blk.{i}.ffn_norm.weight", (spec.dim,), False
        yield f"blk.{i}.ffn_gate.weight", (spec.ffn_dim, spec.dim), True
        yield f"blk.{i}.ffn_up.weight", (spec.ffn_dim, spec.dim), True
        yield f"blk.{i}.ffn_down.weight", (spec.dim, spec.ffn_dim), True
    yield "output_norm.weight", (spec.dim,), False
    if not spec.tied_embeddings:
        yield "output.weight", (vocab, spec.dim), True


def _values(rng: np.random.Generator, name: str, shape, is_matrix: bool) -> np.ndarray:
    if name.endswith(".bias"):  # large enough that leaving one out changes the answers
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)
    if not is_matrix:  # norm scales near 1
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    # scaled like a trained model's init so activations stay in a realistic range
    std = 0.5 / np.sqrt(shape[1]) if name != "token_embd.weight" else 0.05
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _encode(values: np.ndarray, qtype: GGML) -> np.ndarray:
    if qtype == GGML.F32:
        return values
    if qtype == GGML.F16:
        return values.astype(np.float16)
    rows = 1024  # bound the float working set
    return np.concatenate([gguf_quants.quantize(values[r:r + rows], qtype) for r in range(0, len(values), rows)])


def write_synthetic(path: str, spec: SyntheticSpec, tokenizer_gguf: str) -> None:
    try:
        qtype = GGML[spec.qtype.upper()]
    except KeyError:
        raise DllamaError(f"unknown weight type {spec.qtype}") from None
    if (spec.head_dim is None and spec.dim % spec.n_heads) or spec.n_heads % spec.n_kv_heads:
        raise DllamaError("dim must divide into heads (or give head_dim), and heads into KV heads")
    vocab, tokenizer_fields = _tokenizer_fields(os.path.abspath(tokenizer_gguf), os.path.getmtime(tokenizer_gguf))

    writer = GGUFWriter(path, spec.arch)
    writer.add_name(f"synthetic-{spec.arch}-{spec.dim}x{spec.n_layers}-{spec.qtype}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.dim)
    writer.add_block_count(spec.n_layers)
    writer.add_feed_forward_length(spec.ffn_dim)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_rope_dimension_count(spec.head_size)
    if spec.head_dim is not None:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.rope_scaling is not None:
        kind, factor, original_context = spec.rope_scaling
        writer.add_rope_scaling_type(RopeScalingType(kind))
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original_context)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(int(qtype) if qtype != GGML.F32 else 0)
    for key, value, vtype, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type)

    plan = list(_tensor_plan(spec, vocab))
    for name, shape, is_matrix in plan:
        tqtype = qtype if is_matrix else GGML.F32
        if is_matrix:  # the stored shape of one encoded row tells the layout of the whole tensor
            row = _encode(np.zeros((1, shape[1]), np.float32), tqtype)
            writer.add_tensor_info(name, (shape[0], row.shape[1]), row.dtype, row.nbytes * shape[0], raw_dtype=tqtype)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0], raw_dtype=tqtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    for name, shape, is_matrix in plan:
        values = _values(rng, name, shape, is_matrix)
        writer.write_tensor_data(_encode(values, qtype) if is_matrix else values)
    writer.close()
