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
from gguf import GGUFValueType, GGUFWriter, RopeScalingType
from gguf import quants as gguf_quants

from .errors import DllamaError
from .gguf_file import ArrayInfo, GGUFFile


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
    ffn_bias: bool = False  # ffn_gate/up/down.bias (Llama GGUFs may have them)
    qk_norm: bool = False  # attn_q_norm / attn_k_norm (Qwen3, Gemma 3)
    post_norms: bool = False  # post_attention_norm / post_ffw_norm (Gemma 3)
    n_experts: int = 0  # a mixture of experts (qwen3moe): ffn_dim is each expert's hidden size
    n_experts_used: int = 0
    sliding_window: int = 0  # Gemma 3: local layers' window, and the layer pattern (None: llama.cpp's 6)
    swa_pattern: int | None = None
    logit_softcap: float = 0.0  # final_logit_softcapping

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
    # Qwen3-30B-A3B's layer (head_dim 128, 8 query heads per KV head, 768-wide experts, top-8),
    # with fewer layers and experts: ~1.6 B parameters, 0.5 B active per token
    "qwen3moe": SyntheticSpec(arch="qwen3moe", dim=2048, n_layers=12, n_heads=32, n_kv_heads=4, head_dim=128,
                              ffn_dim=768, n_experts=32, n_experts_used=8, qtype="Q8_0", rope_base=1e6,
                              qk_norm=True),
    "gemma3": SyntheticSpec(arch="gemma3", dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                            qtype="Q8_0", rope_base=1e6, tied_embeddings=True, qk_norm=True, post_norms=True,
                            sliding_window=512, context_length=32768),  # Gemma 3 1B
}

_TOKENIZER_KEYS_SKIPPED = {"tokenizer.ggml.add_space_prefix"}

# Each family's chat template as its GGUFs carry it (the plain-conversation part: tools and images
# left out), so the synthetic files are chatted with as the real ones are. A llama file keeps the
# source's (the default model's ChatML).
_CHATML = ("{%- for message in messages %}"
           "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_TEMPLATES = {
    # Qwen2.5: a default system prompt when the conversation has none
    "qwen2": "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba "
             "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}" + _CHATML,
    # Qwen3: an earlier answer's reasoning (<think>...</think>) is dropped from the history;
    # enable_thinking=false asks for an empty thought
    "qwen3": "{%- for message in messages %}{%- set content = message.content %}"
             "{%- if message.role == 'assistant' and '</think>' in content %}"
             "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
             "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
             "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
             "{%- endif %}{%- endif %}",
    # Gemma 3: no system role (the system prompt opens the first user turn), the assistant is
    # "model", turns must alternate
    "gemma3": "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
              "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
              "{%- set loop_messages = messages[1:] -%}"
              "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
              "{%- for message in loop_messages -%}"
              "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{%- endif -%}"
              "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
              "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
              "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
              "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}",
}
CHAT_TEMPLATES["qwen3moe"] = CHAT_TEMPLATES["qwen3"]


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str, mtime: float) -> tuple[int, list[tuple[str, object, GGUFValueType, object]]]:
    """(vocabulary size, the tokenizer's metadata as (key, value, type, item type)) of a GGUF,
    kept for the next model written from the same source. (gguf-py's GGUFReader took 5 CPU-s
    over a real vocabulary's strings; the lean reader a tenth of a second.)"""
    source = GGUFFile(path)
    fields = []
    for key, value in source.metadata.items():
        if key.startswith("tokenizer.") and key not in _TOKENIZER_KEYS_SKIPPED:
            vtype = GGUFValueType(source.value_types[key])
            if isinstance(value, ArrayInfo):
                fields.append((key, source.array_values(key), vtype, GGUFValueType(value.elem_type)))
            else:
                fields.append((key, value, vtype, None))
    return source.metadata["tokenizer.ggml.tokens"].length, fields


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
        if spec.post_norms:
            yield f"blk.{i}.post_attention_norm.weight", (spec.dim,), False
        yield f"blk.{i}.ffn_norm.weight", (spec.dim,), False
        if spec.n_experts:
            n = spec.n_experts
            yield f"blk.{i}.ffn_gate_inp.weight", (n, spec.dim), True
            yield f"blk.{i}.ffn_gate_exps.weight", (n, spec.ffn_dim, spec.dim), True
            yield f"blk.{i}.ffn_up_exps.weight", (n, spec.ffn_dim, spec.dim), True
            yield f"blk.{i}.ffn_down_exps.weight", (n, spec.dim, spec.ffn_dim), True
        else:
            yield f"blk.{i}.ffn_gate.weight", (spec.ffn_dim, spec.dim), True
            yield f"blk.{i}.ffn_up.weight", (spec.ffn_dim, spec.dim), True
            yield f"blk.{i}.ffn_down.weight", (spec.dim, spec.ffn_dim), True
            if spec.ffn_bias:
                yield f"blk.{i}.ffn_gate.bias", (spec.ffn_dim,), False
                yield f"blk.{i}.ffn_up.bias", (spec.ffn_dim,), False
                yield f"blk.{i}.ffn_down.bias", (spec.dim,), False
        if spec.post_norms:
            yield f"blk.{i}.post_ffw_norm.weight", (spec.dim,), False
    yield "output_norm.weight", (spec.dim,), False
    if not spec.tied_embeddings:
        yield "output.weight", (vocab, spec.dim), True


def _values(rng: np.random.Generator, name: str, shape, is_matrix: bool) -> np.ndarray:
    if name.endswith(".bias"):  # large enough that leaving one out changes the answers
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)
    if not is_matrix:  # norm scales near 1
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    # scaled like a trained model's init so activations stay in a realistic range; a router
    # sharp enough that tokens prefer some experts clearly
    std = 0.05 if name == "token_embd.weight" else (4.0 if "ffn_gate_inp" in name else 0.5) / np.sqrt(shape[-1])
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)  # (in place: a big tensor is not copied)
    return values


def _encode(values: np.ndarray, qtype: GGML) -> np.ndarray:
    """Rows of the last axis encoded: (..., row bytes) for block formats."""
    if qtype == GGML.F32:
        return values
    if qtype == GGML.F16:
        return values.astype(np.float16)
    rows = 1024  # bound the float working set
    flat = values.reshape(-1, values.shape[-1])
    encoded = np.concatenate([gguf_quants.quantize(flat[r:r + rows], qtype) for r in range(0, len(flat), rows)])
    return encoded.reshape(values.shape[:-1] + encoded.shape[-1:])


def _type_of(name: str, is_matrix: bool, qtype: GGML) -> GGML:
    """Norms and biases in F32; a MoE router too (llama.cpp's quantize leaves it F32)."""
    return qtype if is_matrix and "ffn_gate_inp" not in name else GGML.F32


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
    writer.add_feed_forward_length(spec.ffn_dim * max(spec.n_experts_used, 1))
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
    if spec.n_experts:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
        writer.add_expert_feed_forward_length(spec.ffn_dim)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
        if spec.swa_pattern is not None:
            writer.add_sliding_window_pattern(spec.swa_pattern)
    if spec.logit_softcap:
        writer.add_final_logit_softcapping(spec.logit_softcap)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(int(qtype) if qtype != GGML.F32 else 0)
    for key, value, vtype, sub_type in tokenizer_fields:
        if key == "tokenizer.chat_template" and spec.arch in CHAT_TEMPLATES:
            value = CHAT_TEMPLATES[spec.arch]
        writer.add_key_value(key, value, vtype, sub_type)

    plan = list(_tensor_plan(spec, vocab))
    for name, shape, is_matrix in plan:
        tqtype = _type_of(name, is_matrix, qtype)
        if is_matrix:  # the stored shape of one encoded row tells the layout of the whole tensor
            row = _encode(np.zeros((1, shape[-1]), np.float32), tqtype)
            n_rows = int(np.prod(shape[:-1]))
            writer.add_tensor_info(name, shape[:-1] + row.shape[1:], row.dtype, row.nbytes * n_rows, raw_dtype=tqtype)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0], raw_dtype=tqtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    for name, shape, is_matrix in plan:
        values = _values(rng, name, shape, is_matrix)
        writer.write_tensor_data(_encode(values, _type_of(name, is_matrix, qtype)))
    writer.close()
