"""Open a GGUF model: its config (llama architecture metadata) and its weight matrices.

Native-format tensors are returned as views into the file map, so loading costs no copy; other
GGUF types are dequantized by gguf-py and re-quantized to the nearest native format a few rows
at a time, so a tensor is never expanded to f32 as a whole.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import quants as gguf_quants

from .architectures import (architecture_of, check_metadata, check_tensors, expert_ffn_length, family_config,
                            layer_features, rope_scaling)
from .config import ModelConfig
from .errors import ModelError
from .gguf_file import ArrayInfo, GGUFFile
from .plan import Plan, shard_tensor_shapes
from .quant import FORMATS, QType, quantize, requant_target
from .weights import Experts, Matrix

_REQUANT_ROWS = 256  # rows converted at a time for non-native types


class GGUFModel:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ModelError(f"model file not found: {self.path}")
        self.file = GGUFFile(self.path)
        self.metadata = self.file.metadata
        self.config = self._read_config()
        self.chat_template: str | None = self.field("tokenizer.chat_template")
        self._converted: dict[str, Matrix] = {}  # non-native tensors, converted once

    # ------------------------------------------------------------------ metadata

    def field(self, key: str, default=None):
        value = self.metadata.get(key, default)
        return default if isinstance(value, ArrayInfo) else value

    def _read_config(self) -> ModelConfig:
        description = architecture_of(self.field, self.path)
        arch = description.name

        def need(key):
            value = self.field(f"{arch}.{key}")
            if value is None:
                raise ModelError(f"{self.path}: missing metadata {arch}.{key}")
            return value

        dim = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        n_kv_heads = int(self.field(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = int(self.field(f"{arch}.attention.key_length", dim // n_heads))
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = self.field(f"{arch}.vocab_size", tokens.length if isinstance(tokens, ArrayInfo) else None)
        if vocab is None:
            raise ModelError(f"{self.path}: no vocabulary size in the metadata")
        if n_heads % n_kv_heads:
            raise ModelError(f"{self.path}: {n_heads} heads do not divide into {n_kv_heads} KV heads")
        config = ModelConfig(
            arch=arch,
            dim=dim,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn_dim=int(need("feed_forward_length")),
            vocab_size=int(vocab),
            context_length=int(self.field(f"{arch}.context_length", 2048)),
            rope_base=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            rope_dims=int(self.field(f"{arch}.rope.dimension_count", head_dim)),
            rope_neox=description.rope_neox,
            norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tied_embeddings="output.weight" not in self.file.tensors,
            bos_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_id=self.field("tokenizer.ggml.eos_token_id"),
        )
        check_metadata(description, self.metadata, self.field, head_dim, self.path)
        check_tensors(description, self.file.tensors, config.n_layers, self.path)
        if description.moe:
            config = replace(config, ffn_dim=expert_ffn_length(description, self.field, config.ffn_dim))
        config = replace(config, **family_config(description, self.field, dim, config.n_layers, n_heads, head_dim))
        down = "ffn_down_exps" if config.n_experts else "ffn_down"
        blocks = [FORMATS[QType(t.ggml_type)].block_size for name, t in self.file.tensors.items()
                  if name.endswith(f".{down}.weight") and t.ggml_type in QType._value2member_map_]
        config = replace(config, ffn_block=max([32, *blocks]))  # W2's columns are cut in whole (super-)blocks
        scaling = rope_scaling(description, self.field, config.rope_dims, config.rope_base, config.context_length)
        config = replace(config, **layer_features(description, self.file.tensors, config.n_layers, self.path),
                         rope_freq_scale=scaling.freq_scale, rope_ext_factor=scaling.ext_factor,
                         rope_corr_lo=scaling.corr_dims[0], rope_corr_hi=scaling.corr_dims[1],
                         rope_mscale=scaling.mscale)
        self._check_shapes(config)
        return config

    def _check_shapes(self, config: ModelConfig) -> None:
        """Every tensor has the shape the config implies (llama.cpp refuses any other; the kernels
        would read past a short one)."""
        expected = {f"{name}.weight" if not name.endswith(".bias") else name: shape
                    for name, shape in shard_tensor_shapes(config, Plan.single(config).shards[0]).items()}
        expected["token_embd.weight"] = (config.vocab_size, config.dim)
        if config.tied_embeddings:
            del expected["output.weight"]
        if self.has("rope_freqs.weight"):
            expected["rope_freqs.weight"] = config.rope_dims // 2
        for name, shape in expected.items():
            dims = tuple(self.file.tensors[name].shape)
            want = (shape,) if isinstance(shape, int) else tuple(reversed(shape))  # GGUF lists the inner dim first
            if dims != want:
                raise ModelError(f"{self.path}: tensor {name} has shape {list(dims)[::-1]}, the model's metadata "
                                 f"gives {list(want)[::-1]}")

    # ------------------------------------------------------------------ tensors

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def matrix(self, name: str) -> Matrix:
        """A 2-D weight in a native format (a view into the file where the format is native)."""
        t = self._get(name)
        if len(t.shape) != 2:
            raise ModelError(f"{self.path}: tensor {name} is not a matrix (shape {list(t.shape)})")
        return self._rows_of(name)

    def experts(self, name: str) -> Experts:
        """A 3-D weight (a mixture-of-experts layer's matrices, expert by expert) in a native format."""
        t = self._get(name)
        if len(t.shape) != 3:
            raise ModelError(f"{self.path}: tensor {name} is not a stack of expert matrices (shape {list(t.shape)})")
        return Experts.of(self._rows_of(name), int(t.shape[2]))

    def _rows_of(self, name: str) -> Matrix:
        """Every row of the tensor (of every expert, one after the other) as one native matrix."""
        t = self._get(name)
        cols, rows = t.shape[0], int(np.prod(t.shape[1:]))  # GGUF lists the innermost dimension first
        ggml_type = t.ggml_type
        data = self.file.data(name).reshape(rows, -1)
        if ggml_type in QType._value2member_map_:
            return Matrix(QType(ggml_type), rows, cols, data)
        if name not in self._converted:
            target = self._requant_target(name, ggml_type)
            chunks = [quantize(self._dequantize(name, data[r:r + _REQUANT_ROWS], ggml_type), target)
                      for r in range(0, rows, _REQUANT_ROWS)]
            self._converted[name] = Matrix(target, rows, cols, np.concatenate(chunks))
        return self._converted[name]

    def qtype_of(self, name: str) -> QType:
        """The native format the tensor is used in (its own, or the one it is converted to on load)."""
        ggml_type = self._get(name).ggml_type
        return QType(ggml_type) if ggml_type in QType._value2member_map_ else self._requant_target(name, ggml_type)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D weight (a norm's scale, RoPE frequency factors) as float32."""
        t = self._get(name)
        data = self.file.data(name)
        if t.ggml_type == GGML.F32:
            return data.reshape(-1)
        if t.ggml_type == GGML.F16:
            return data.astype(np.float32).reshape(-1)
        return self._dequantize(name, data, t.ggml_type).astype(np.float32).reshape(-1)

    def _get(self, name: str):
        t = self.file.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: tensor {name} is missing")
        return t

    def _requant_target(self, name: str, ggml_type: int) -> QType:
        try:
            return requant_target(ggml_type)
        except (KeyError, ValueError):
            raise ModelError(f"{self.path}: tensor {name} has unsupported type {_type_name(ggml_type)}") from None

    def _dequantize(self, name: str, data: np.ndarray, ggml_type: int) -> np.ndarray:
        if ggml_type == GGML.F64:  # gguf-py has no dequantizer for plain float64
            return np.asarray(data, np.float32)
        try:
            return gguf_quants.dequantize(data, GGML(ggml_type))
        except Exception:
            raise ModelError(f"{self.path}: tensor {name} has unsupported type {_type_name(ggml_type)}") from None

    def rope_freq_factors(self) -> np.ndarray | None:
        return self.vector("rope_freqs.weight") if self.has("rope_freqs.weight") else None

    def layer_name(self, layer: int, part: str) -> str:
        return f"blk.{layer}.{part}.weight"

    @property
    def lm_head_name(self) -> str:
        return "token_embd.weight" if self.config.tied_embeddings else "output.weight"

    @property
    def file_size(self) -> int:
        return os.path.getsize(self.path)


def _type_name(ggml_type: int) -> str:
    try:
        return GGML(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"
