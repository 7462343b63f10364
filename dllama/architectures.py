"""Model architectures as small declarative descriptions: which GGUF tensors a model of the family
has, which metadata keys it reads, and the choices the forward pass makes (RoPE style, ...).

`check_tensors` and `check_metadata` refuse, with one line naming it, a GGUF tensor the
description does not consume and a metadata key that changes the math and is not implemented (or
a value of it that is not). Why, the families and how to add one: docs/architectures.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .config import RopeScaling
from .errors import ModelError
from .gguf_file import ArrayInfo


_ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_DENSE_FFN = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE_FFN = ("ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
            "ffn_down_exps.weight")
_DENSE_LAYER = _ATTENTION + _DENSE_FFN
_ATTN_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
_FFN_BIASES = ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")
_QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
_POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")


@dataclass(frozen=True)
class Architecture:
    """A family of models: its tensors per layer (required, and optional ones that the forward
    pass applies when the file has them), the metadata keys it reads beyond every family's, and
    the choices the forward pass (model.py, one function for all of them) makes."""

    name: str
    rope_neox: bool  # NeoX RoPE pairs dim i with i + n/2 (GPT-NeoX, Qwen, Gemma); else 2i with 2i+1 (Llama)
    layer_tensors: tuple[str, ...] = _DENSE_LAYER
    optional_layer_tensors: tuple[str, ...] = ()
    global_tensors: tuple[str, ...] = ("token_embd.weight", "output_norm.weight")
    optional_global_tensors: tuple[str, ...] = ("output.weight",)
    keys: frozenset[str] = frozenset()  # metadata it reads beyond _KNOWN_KEYS
    activation: str = "silu"  # the FFN gate: silu (SwiGLU) or gelu (GELU-tanh)
    gemma_scales: bool = False  # embeddings times sqrt(dim); Q times the attention scale before attention

    @property
    def moe(self) -> bool:
        return "ffn_gate_inp.weight" in self.layer_tensors


_LLAMA3_GLOBAL = ("output.weight", "rope_freqs.weight")
_MOE_KEYS = frozenset({"expert_feed_forward_length"})
_GEMMA3_KEYS = frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                          "final_logit_softcapping"})

ARCHITECTURES = {a.name: a for a in (
    # Llama 2/3, SmolLM, Mistral: optional attention and FFN biases (llama.cpp reads them for llama)
    # and Llama 3.1's RoPE frequency factors (the other families' graphs in llama.cpp have none)
    Architecture("llama", rope_neox=False, optional_layer_tensors=_ATTN_BIASES + _FFN_BIASES,
                 optional_global_tensors=_LLAMA3_GLOBAL),
    Architecture("mistral", rope_neox=False, optional_global_tensors=_LLAMA3_GLOBAL),
    # Qwen2 / Qwen2.5: Q/K/V biases, NeoX RoPE
    Architecture("qwen2", rope_neox=True, optional_layer_tensors=_ATTN_BIASES[:3]),
    # Qwen3 (dense): per-head RMS norm of Q and K before RoPE, heads wider than dim / n_heads
    Architecture("qwen3", rope_neox=True, layer_tensors=_DENSE_LAYER + _QK_NORMS),
    # Qwen3-MoE: Qwen3's attention, a router and top-k of n SwiGLU experts instead of one FFN
    Architecture("qwen3moe", rope_neox=True, layer_tensors=_ATTENTION + _QK_NORMS + _MOE_FFN, keys=_MOE_KEYS),
    # Gemma 3: QK-norm, norms after attention and FFN too, GELU, scaled embeddings and queries,
    # sliding-window layers with their own RoPE base, optional final logit soft-capping
    Architecture("gemma3", rope_neox=True, layer_tensors=_DENSE_LAYER + _QK_NORMS + _POST_NORMS, keys=_GEMMA3_KEYS,
                 activation="gelu", gemma_scales=True),
)}

# Metadata keys under "{arch}." that every family's engine reads, or knows to leave the math unchanged.
_KNOWN_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",
}


def architecture_of(metadata_get, path: str) -> Architecture:
    name = metadata_get("general.architecture")
    if name not in ARCHITECTURES:
        raise ModelError(f"unsupported model architecture {name!r} in {path} "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]


def check_metadata(arch: Architecture, metadata: dict, metadata_get, head_dim: int, path: str) -> None:
    """Refuse a math-relevant key this engine does not implement, or a value it does not."""
    prefix = arch.name + "."
    for key, value in metadata.items():
        if key.startswith(prefix) and key[len(prefix):] not in _KNOWN_KEYS | arch.keys:
            raise ModelError(f"{path}: metadata {key} is not implemented by this engine (it may change "
                             f"the model's output); refusing to run it rather than ignoring it")
        if key.startswith(prefix) and isinstance(value, ArrayInfo):  # e.g. a head count per layer
            raise ModelError(f"{path}: metadata {key} is an array (a value per layer); that is not implemented")

    def get(suffix, default=None):
        return metadata_get(prefix + suffix, default)

    def refuse(key, value, why):
        raise ModelError(f"{path}: metadata {prefix}{key} = {value!r}: {why}")

    value_length = get("attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        refuse("attention.value_length", value_length, f"value heads of another size than key heads ({head_dim}) "
               "are not implemented")
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        refuse("rope.dimension_count", rope_dims, f"partial RoPE (head size {head_dim}) is not implemented")
    for key in ("expert_count", "expert_used_count"):
        if arch.moe and not 0 < int(get(key, 0) or 0) <= 256:
            refuse(key, get(key), "a mixture of experts needs 1 to 256 experts, and at least one used per token")
        if not arch.moe and int(get(key, 0) or 0) != 0:
            refuse(key, get(key), "mixture-of-experts layers are not implemented for this architecture")
    if arch.moe and int(get("expert_used_count")) > int(get("expert_count")):
        refuse("expert_used_count", get("expert_used_count"), f"more than the {get('expert_count')} experts")
    for key in ("attention.sliding_window", "attention.sliding_window_pattern"):
        if not (isinstance(get(key, 0), int) and get(key, 0) >= 0):
            refuse(key, get(key), "must be a whole number >= 0")
    if get("attention.sliding_window", 0) and get("rope.scaling.type", "linear") == "yarn":
        refuse("rope.scaling.type", "yarn", "YaRN with sliding-window layers is not implemented")
    value = get("final_logit_softcapping")
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        refuse("final_logit_softcapping", value, "must be a finite number >= 0")
    scaling = get("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", "yarn"):
        refuse("rope.scaling.type", scaling, "this RoPE scaling is not implemented (none, linear and yarn are)")
    for key in ("rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor"):
        value = get(key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            refuse(key, value, "must be a finite number >= 0")


def rope_scaling(arch: Architecture, metadata_get, n_dims: int, base: float, context_length: int) -> RopeScaling:
    """RoPE scaling as llama.cpp reads it: an absent type is linear, applied when a factor is given."""
    def get(suffix, default=None):
        return metadata_get(f"{arch.name}.{suffix}", default)

    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 0.0)) or 0.0)
    original_context = int(get("rope.scaling.original_context_length", 0) or 0)  # 0: llama.cpp takes the trained one
    return RopeScaling.from_gguf(get("rope.scaling.type", "linear"), factor, float(get("rope.scaling.attn_factor", 1.0)),
                                 n_dims, base, original_context if original_context > 0 else context_length)


def family_config(arch: Architecture, metadata_get, dim: int, n_layers: int, n_heads: int, head_dim: int) -> dict:
    """ModelConfig's fields that come from the family rather than the common metadata: the FFN
    gate, Gemma's scales, sliding-window layers, soft-capping, experts."""
    def get(suffix, default=None):
        return metadata_get(f"{arch.name}.{suffix}", default)

    fields = {"activation": arch.activation, "logit_softcap": float(get("final_logit_softcapping", 0.0) or 0.0)}
    if arch.gemma_scales:  # as llama.cpp: 1/sqrt(head_dim), but 1/sqrt(dim/heads) for the 62-layer 27B
        fields["embedding_scale"] = float(np.float32(math.sqrt(dim)))
        fields["attn_q_scale"] = float(np.float32(1.0) / np.sqrt(np.float32(dim // n_heads if n_layers == 62
                                                                              else head_dim)))
    window = int(get("attention.sliding_window", 0) or 0)
    if window:  # llama.cpp's default for Gemma 3: every 6th layer global, local ones at base 10000
        fields.update(sliding_window=window, swa_pattern=int(get("attention.sliding_window_pattern", 6)),
                      rope_base_local=float(get("rope.freq_base_swa", 10000.0)))
    if arch.moe:
        fields.update(n_experts=int(get("expert_count")), n_experts_used=int(get("expert_used_count")))
    return fields


def expert_ffn_length(arch: Architecture, metadata_get, ffn_length: int) -> int:
    """The hidden size of each expert: its own key, else (as llama.cpp) the FFN length / experts used."""
    value = metadata_get(f"{arch.name}.expert_feed_forward_length")
    return int(value) if value else ffn_length // int(metadata_get(f"{arch.name}.expert_used_count"))


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def check_tensors(arch: Architecture, names, n_layers: int, path: str) -> None:
    """Every tensor of the file must be one the description consumes, and every required one there."""
    names = set(names)
    allowed = set(arch.global_tensors) | set(arch.optional_global_tensors)
    for name in sorted(names):
        m = _LAYER_TENSOR.fullmatch(name)
        known = (name in allowed if m is None else m.group(1) == str(int(m.group(1))) and int(m.group(1)) < n_layers
                 and (m.group(2) in arch.layer_tensors or m.group(2) in arch.optional_layer_tensors))
        if not known:
            raise ModelError(f"{path}: tensor {name} is not used by the {arch.name} architecture as implemented "
                             f"here (it would change the output); refusing to run it rather than ignoring it")
    required = list(arch.global_tensors) + [f"blk.{i}.{part}" for i in range(n_layers) for part in arch.layer_tensors]
    missing = [name for name in required if name not in names]
    if missing:
        raise ModelError(f"{path}: tensor {missing[0]} is missing")


# optional tensors that come as a group, and the config flag that says a model has them
_FEATURES = {"attn_bias": _ATTN_BIASES[:3], "attn_out_bias": _ATTN_BIASES[3:], "ffn_bias": _FFN_BIASES[:2],
             "ffn_down_bias": _FFN_BIASES[2:], "qk_norm": _QK_NORMS, "post_norms": _POST_NORMS}


def layer_features(arch: Architecture, names, n_layers: int, path: str) -> dict[str, bool]:
    """Which optional parts (ModelConfig's flags of _FEATURES) the layers have: a
    group is in every layer or in none (anything else is refused rather than half applied)."""
    names = set(names)
    features = {}
    for flag, parts in _FEATURES.items():
        wanted = [f"blk.{i}.{part}" for i in range(n_layers) for part in parts]
        missing = [name for name in wanted if name not in names]
        if missing and len(missing) < len(wanted):
            raise ModelError(f"{path}: tensor {missing[0]} is missing (other layers or heads have it)")
        features[flag] = not missing
    return features
