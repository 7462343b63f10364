"""The lean GGUF reader against gguf-py's GGUFReader, damaged and hostile files, and what
GGUFModel makes of a file (config, tensors, non-native types, unsupported content)."""

from __future__ import annotations

import struct

import re

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from dllama.errors import ModelError
from dllama.gguf_file import ArrayInfo, GGUFFile
from dllama.gguf_model import GGUFModel
from dllama.quant import QType, dequantize

from .engine_helpers import SYNTHETIC_SPECS


@pytest.fixture(scope="module")
def reader(model_path):
    from gguf import GGUFReader

    return GGUFReader(model_path)


@pytest.fixture(scope="module")
def ours(model_path):
    return GGUFFile(model_path)


# ------------------------------------------------------------------ against gguf-py


def test_metadata_equals_gguf_py(reader, ours):
    expected_keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == expected_keys  # same keys, same order
    assert ours.version == reader.fields["GGUF.version"].contents()
    for key in expected_keys:
        field, value = reader.fields[key], ours.metadata[key]
        assert ours.value_types[key] == int(field.types[0]), key
        if field.types[0] == GGUFValueType.ARRAY:
            assert isinstance(value, ArrayInfo), key
            assert value.elem_type == int(field.types[1]), key
            assert value.length == len(field.data), key
            assert ours.array_values(key) == field.contents(), key  # (read on demand: the parse skips them)
        else:
            expected = field.contents()
            assert value == expected and type(value) is type(expected), key


def test_tensor_infos_equal_gguf_py(reader, ours):
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in t.shape), t.name
        assert info.ggml_type == int(t.tensor_type), t.name
        assert info.offset == t.data_offset, t.name


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
                                  "output_norm.weight", "blk.3.attn_norm.weight"])
def test_tensor_data_equals_gguf_py(reader, ours, name):
    t = next(t for t in reader.tensors if t.name == name)
    data = ours.data(name)
    assert data.shape == t.data.shape and data.dtype == t.data.dtype
    np.testing.assert_array_equal(data, t.data)
    assert not data.flags.owndata  # a view of the map, not a copy


def test_default_model_config(gguf_model, reader):
    cfg = gguf_model.config
    f = lambda key: reader.fields[key].contents()  # noqa: E731
    assert cfg.arch == "llama"
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (
        f("llama.embedding_length"), f("llama.block_count"), f("llama.attention.head_count"),
        f("llama.attention.head_count_kv"))
    assert cfg.ffn_dim == f("llama.feed_forward_length")
    assert cfg.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert cfg.head_dim * cfg.n_heads == cfg.dim and cfg.rope_dims == f("llama.rope.dimension_count")
    assert cfg.rope_base == f("llama.rope.freq_base") and not cfg.rope_neox
    assert cfg.norm_eps == pytest.approx(f("llama.attention.layer_norm_rms_epsilon"))
    assert cfg.tied_embeddings and not gguf_model.has("output.weight")
    assert (cfg.bos_id, cfg.eos_id) == (f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id"))
    assert "<|im_start|>" in gguf_model.chat_template
    # native tensors are views of the file
    m = gguf_model.matrix("blk.0.ffn_gate.weight")
    assert (m.qtype, m.rows, m.cols) == (QType.Q4_1, cfg.ffn_dim, cfg.dim)
    assert gguf_model.matrix("token_embd.weight").qtype == QType.Q8_0


# ------------------------------------------------------------------ damaged files


def _truncated(src: str, dst, size: int) -> str:
    with open(src, "rb") as f:
        data = f.read(size)
    dst.write_bytes(data)
    return str(dst)


@pytest.mark.parametrize("where", ["header", "metadata", "tensor infos", "tensor data", "last byte"])
def test_truncated_default_model_is_a_clear_error(model_path, reader, tmp_path, where):
    import os

    size = os.path.getsize(model_path)
    cut = {"header": 20, "metadata": 200_000, "tensor infos": reader.data_offset - 64,
           "tensor data": size // 2, "last byte": size - 1}[where]
    path = _truncated(model_path, tmp_path / "cut.gguf", cut)
    with pytest.raises(ModelError, match=r"cut\.gguf") as e:
        GGUFFile(path)
    message = str(e.value)
    assert "\n" not in message
    if where in ("tensor data", "last byte"):
        assert "truncated" in message
    with pytest.raises(ModelError):
        GGUFModel(path)


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _gguf(kv: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0, version: int = 3,
          magic: bytes = b"GGUF", tail: bytes = b"\0" * 64) -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + tensors + tail


def _tensor_info(name: str, shape, ggml_type: int, offset: int = 0) -> bytes:
    n = name.encode()
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<IQ", ggml_type, offset))


HOSTILE = {
    "empty": (b"", "empty"),
    "garbage": (np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "magic"),
    "wrong magic": (_gguf(magic=b"GGML"), "magic"),
    "text file": (b"This is not a model, just some text that is long enough to be read.\n" * 4, "magic"),
    "version 1": (_gguf(version=1), "version"),
    "version 99": (_gguf(version=99), "version"),
    "2^63 keys": (_gguf(n_kv=2 ** 63), "implausible"),
    "2^40 tensors": (_gguf(n_tensors=2 ** 40), "implausible"),
    "huge string": (_gguf(struct.pack("<Q", 2 ** 62) + b"abc", n_kv=1), "past the end"),
    "huge array": (_gguf(struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 6, 2 ** 61), n_kv=1), "past the end"),
    "huge string array": (_gguf(struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 8, 2 ** 61), n_kv=1), ""),
    "bad value type": (_gguf(struct.pack("<Q", 1) + b"a" + struct.pack("<I", 77), n_kv=1), "value type"),
    "bad array type": (_gguf(struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 77, 1), n_kv=1), "array"),
    "bad utf-8 key": (_gguf(struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1), n_kv=1), ""),
    "too many dims": (_gguf(tensors=_tensor_info("w", (1,) * 9, 0), n_tensors=1), "dims"),
    "unknown tensor type": (_gguf(tensors=_tensor_info("w", (32, 2), 200), n_tensors=1), "unknown type"),
    "tensor past the end": (_gguf(tensors=_tensor_info("w", (32, 2), 0, offset=10 ** 9), n_tensors=1), "past the end"),
    "huge tensor": (_gguf(tensors=_tensor_info("w", (2 ** 31, 2 ** 31), 0), n_tensors=1), "past the end"),
    "missing tensors": (_gguf(n_tensors=3), ""),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_files_are_clear_errors(tmp_path, name):
    content, fragment = HOSTILE[name]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError) as e:
        GGUFFile(str(path))
    message = str(e.value)
    assert str(path) in message and "\n" not in message
    assert fragment in message


def test_hand_written_file_with_custom_alignment(tmp_path):
    """A well-formed minimal file: version 2, alignment 64, an F32 matrix and a Q8_0 one."""
    kv = _kv_string("general.architecture", "test") + struct.pack("<Q", 17) + b"general.alignment" + struct.pack(
        "<II", 4, 64)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    q = gguf_quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), GGML.Q8_0)
    tensors = _tensor_info("a", (3, 2), 0, 0) + _tensor_info("q", (32, 2), 8, 64)
    head = _gguf(kv, 2, tensors, 2, version=2, tail=b"")
    pad = -len(head) % 64
    blob = head + b"\0" * pad + a.tobytes() + b"\0" * (64 - a.nbytes) + q.tobytes()
    path = tmp_path / "ok.gguf"
    path.write_bytes(blob)
    f = GGUFFile(str(path))
    assert f.version == 2 and f.metadata == {"general.architecture": "test", "general.alignment": 64}
    assert f.tensors["a"].offset == len(head) + pad
    np.testing.assert_array_equal(f.data("a"), a)
    np.testing.assert_array_equal(f.data("q"), q)


# ------------------------------------------------------------------ GGUFModel


def _writer(path, arch="llama", **overrides):
    w = GGUFWriter(str(path), arch)
    meta = {"context_length": 64, "embedding_length": 64, "block_count": 1, "feed_forward_length": 128,
            "head_count": 4, "head_count_kv": 2, "vocab_size": 32}
    meta.update(overrides)
    adders = {"context_length": w.add_context_length, "embedding_length": w.add_embedding_length,
              "block_count": w.add_block_count, "feed_forward_length": w.add_feed_forward_length,
              "head_count": w.add_head_count, "head_count_kv": w.add_head_count_kv, "vocab_size": w.add_vocab_size}
    for key, value in meta.items():
        if value is not None:
            adders[key](value)
    return w


def _close(w, tensors):
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = _writer(path, arch="gpt2")
    _close(w, [("token_embd.weight", np.zeros((32, 64), np.float32), None)])
    supported = "gemma3, llama, mistral, qwen2, qwen3, qwen3moe"
    with pytest.raises(ModelError, match=rf"unsupported model architecture 'gpt2'.*supported: {supported}\)"):
        GGUFModel(path)


@pytest.mark.parametrize("missing", ["block_count", "embedding_length", "feed_forward_length", "head_count"])
def test_missing_metadata(tmp_path, missing):
    path = tmp_path / "m.gguf"
    _close(_writer(path, **{missing: None}), [])
    key = {"head_count": "attention.head_count"}.get(missing, missing)
    with pytest.raises(ModelError, match=f"missing metadata llama.{key}"):
        GGUFModel(path)


def test_heads_that_do_not_divide(tmp_path):
    path = tmp_path / "m.gguf"
    _close(_writer(path, head_count=6, head_count_kv=4), [])
    with pytest.raises(ModelError, match="KV heads"):
        GGUFModel(path)


def test_missing_file_and_missing_tensor(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        GGUFModel(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match="not found"):
        GGUFModel(tmp_path)  # a directory
    path = tmp_path / "m.gguf"
    _close(_writer(path), [t for t in _tiny_tensors() if t[0] != "blk.0.attn_q.weight"])
    with pytest.raises(ModelError, match="blk.0.attn_q.weight is missing"):
        GGUFModel(path)
    path = tmp_path / "v.gguf"
    _close(_writer(path), _tiny_tensors())
    with pytest.raises(ModelError, match="not a matrix"):
        GGUFModel(path).matrix("output_norm.weight")


def _tiny_tensors(extra=(), replace=None):
    """Every tensor of _writer's 1-layer model (dim 64, 4 heads / 2 KV heads, FFN 128, vocab 32),
    with `extra` (name, shape) tensors and `replace` {name: (array, raw type)} ones."""
    f32 = np.float32
    layer = {"attn_norm": (64,), "attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
             "ffn_norm": (64,), "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
    tensors = [("token_embd.weight", np.zeros((32, 64), f32), None), ("output_norm.weight", np.ones(64, f32), None)]
    tensors += [(f"blk.0.{part}.weight", np.zeros(shape, f32), None) for part, shape in layer.items()]
    tensors = [(name, *replace[name]) if replace and name in replace else (name, a, r) for name, a, r in tensors]
    return tensors + [(name, np.zeros(shape, f32), None) for name, shape in extra]


@pytest.mark.parametrize("name, shape", [
    ("blk.0.post_ffw_norm.weight", (64,)), ("blk.0.ffn_norm.bias", (64,)),
    ("blk.0.attn_q_norm.weight", (16,)), ("blk.1.attn_norm.weight", (64,)), ("cls.weight", (2, 64)),
])
def test_a_tensor_the_model_would_not_use_is_refused(tmp_path, name, shape):
    """Never silently wrong: an unused tensor would leave out part of the model's math."""
    path = tmp_path / "m.gguf"
    _close(_writer(path), _tiny_tensors([(name, shape)]))
    with pytest.raises(ModelError, match=f"tensor {re.escape(name)} is not used by the llama architecture"):
        GGUFModel(path)


def test_half_a_bias_group_is_refused(tmp_path):
    """An up bias without its gate bias would be half applied: refused, naming the missing one."""
    path = tmp_path / "m.gguf"
    _close(_writer(path), _tiny_tensors([("blk.0.ffn_up.bias", (128,))]))
    with pytest.raises(ModelError, match="tensor blk.0.ffn_gate.bias is missing"):
        GGUFModel(path)


@pytest.mark.parametrize("key, value, fragment", [
    ("rope.scaling.type", "longrope", "RoPE scaling is not implemented"),
    ("rope.scaling.yarn_log_multiplier", 0.1, "not implemented by this engine"),
    ("attention.sliding_window", 4096, "not implemented by this engine"),
    ("attn_logit_softcapping", 50.0, "not implemented by this engine"),
    ("attention.layer_norm_epsilon", 1e-5, "not implemented by this engine"),
    ("expert_count", 8, "mixture-of-experts"),
    ("rope.dimension_count", 8, "partial RoPE"),
    ("attention.value_length", 8, "value heads"),
])
def test_a_math_key_the_engine_does_not_implement_is_refused(tmp_path, key, value, fragment):
    path = tmp_path / "m.gguf"
    w = _writer(path)
    if isinstance(value, str):
        w.add_string(f"llama.{key}", value)
    elif isinstance(value, float):
        w.add_float32(f"llama.{key}", value)
    else:
        w.add_uint32(f"llama.{key}", value)
    _close(w, _tiny_tensors())
    with pytest.raises(ModelError, match=f"llama.{re.escape(key)}.*{fragment}"):
        GGUFModel(path)


def test_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path):
    """No type but a factor: linear (freq_scale 1/factor); type none: the factor is not applied;
    yarn: extrapolation mixed in over the dims its betas give, with the original context."""
    def config(**keys):
        path = tmp_path / "m.gguf"
        w = _writer(path)
        for key, value in keys.items():
            {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](f"llama.rope.scaling.{key}", value)
        _close(w, _tiny_tensors())
        return GGUFModel(path).config.rope_scaling

    assert config().freq_scale == 1.0 and config().ext_factor == 0.0
    assert config(factor=4.0).freq_scale == 0.25 and config(factor=4.0).ext_factor == 0.0
    assert config(type="none", factor=4.0).freq_scale == 1.0
    assert config(type="linear", factor=2.0, attn_factor=0.5).mscale == 0.5
    yarn = config(type="yarn", factor=4.0, original_context_length=32)
    assert yarn.freq_scale == 0.25 and yarn.ext_factor == 1.0
    assert yarn.mscale == pytest.approx(1.0, abs=1e-6)
    # head size 16, base 10000, 32 positions: corr dims floor(16 ln(32/(64 pi)) / (2 ln 1e4)), ceil(... 2 pi)
    assert yarn.corr_dims == (0.0, 2.0) and all(isinstance(d, float) for d in yarn.corr_dims)


@pytest.mark.parametrize("key, value", [("rope.scaling.type", "none"), ("rope.scaling.factor", 1.0),
                                        ("rope.scaling.original_context_length", 8192), ("expert_count", 0)])
def test_keys_that_leave_the_math_unchanged_are_accepted(tmp_path, key, value):
    path = tmp_path / "m.gguf"
    w = _writer(path)
    {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](f"llama.{key}", value)
    _close(w, _tiny_tensors())
    assert GGUFModel(path).config.n_layers == 1


@pytest.mark.parametrize("ggml_type", [GGML.I32, GGML.I8, GGML.Q8_1], ids=lambda t: t.name)
def test_unsupported_tensor_type(tmp_path, ggml_type):
    """A tensor type we cannot convert: a clear error naming the tensor and the type."""
    path = tmp_path / "m.gguf"
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = np.zeros((64, 64 // block * size), np.uint8)
    _close(_writer(path), _tiny_tensors(replace={"blk.0.attn_q.weight": (raw, ggml_type)}))
    model = GGUFModel(path)
    with pytest.raises(ModelError, match=f"blk.0.attn_q.weight has unsupported type {ggml_type.name}"):
        model.matrix("blk.0.attn_q.weight")


def test_f64_tensors_load_as_f32(tmp_path):
    path = tmp_path / "m.gguf"
    values = np.random.default_rng(0).standard_normal((64, 64))
    _close(_writer(path), _tiny_tensors(replace={"blk.0.attn_q.weight": (values[:64], None),
                                                 "output_norm.weight": (values[0], None)}))
    model = GGUFModel(path)
    m = model.matrix("blk.0.attn_q.weight")
    assert m.qtype == QType.F32 and np.array_equal(m.data, values[:64].astype(np.float32))
    assert np.array_equal(model.vector("output_norm.weight"), values[0].astype(np.float32))


@pytest.mark.parametrize("name", ["Q2_K", "BF16"])
def test_non_native_tensors_are_converted(synthetic_model, requantized_model, name):
    """A format without a kernel here is converted on load: BF16 (a synthetic model) to F16, Q2_K
    (the default model re-quantized by llama.cpp --pure: its FFN down projections) to Q4_1."""
    path = requantized_model(name, pure=True) if name == "Q2_K" else synthetic_model(name)
    model = GGUFModel(path)
    f = model.file
    target = {"Q2_K": QType.Q4_1, "BF16": QType.F16}[name]
    for tensor in ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight"):
        assert f.tensors[tensor].ggml_type == GGML[name]
        m = model.matrix(tensor)
        assert m.qtype == target
        source = gguf_quants.dequantize(f.data(tensor), GGML[name])
        ours = dequantize(m.data, m.qtype)
        assert ours.shape == source.shape == (m.rows, m.cols)
        if target == QType.F16:  # bf16 -> f16 is exact but for values below f16's normal range
            np.testing.assert_allclose(ours, source, rtol=2.0 ** -11, atol=2.0 ** -25)
        else:  # within half a Q4_1 step (+ the f16 rounding of its scale and minimum)
            blocks = source.reshape(m.rows, -1, 32)
            step = blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
            err = np.abs(ours - source).reshape(m.rows, -1, 32)
            assert (err <= step / 15 * 0.51 + np.abs(blocks).max(-1, keepdims=True) * 2.0 ** -9).all()
    if name in SYNTHETIC_SPECS:
        cfg, spec = model.config, SYNTHETIC_SPECS[name]
        assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.tied_embeddings) == (
            spec["dim"], spec["n_layers"], spec["n_heads"], spec["n_kv_heads"], spec["ffn_dim"],
            spec["tied_embeddings"])


def test_synthetic_big_model_config(synthetic_model):
    model = GGUFModel(synthetic_model("big"))
    cfg = model.config
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.n_layers) == (2048, 32, 8, 64, 8192, 2)
    assert not cfg.tied_embeddings and model.lm_head_name == "output.weight"
    assert cfg.vocab_size == 49152
    out = model.matrix("output.weight")
    assert (out.qtype, out.rows, out.cols) == (QType.Q4_0, 49152, 2048)


@pytest.mark.parametrize("name, shape", [("blk.0.attn_norm.weight", (32,)), ("blk.0.attn_k.weight", (64, 64)),
                                         ("token_embd.weight", (31, 64))])
def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path, name, shape):
    """The kernels do not check bounds: a short norm would be read past its end."""
    path = tmp_path / "m.gguf"
    _close(_writer(path), _tiny_tensors(replace={name: (np.zeros(shape, np.float32), None)}))
    with pytest.raises(ModelError, match=f"tensor {re.escape(name)} has shape"):
        GGUFModel(path)


def test_a_layer_number_written_otherwise_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    _close(_writer(path), _tiny_tensors([("blk.00.attn_norm.weight", (64,))]))
    with pytest.raises(ModelError, match="blk.00.attn_norm.weight is not used"):
        GGUFModel(path)


def test_a_per_layer_array_is_refused(tmp_path):
    """llama.cpp reads some counts per layer from an array; taking the default instead would be wrong."""
    path = tmp_path / "m.gguf"
    w = _writer(path, head_count_kv=None)
    w.add_array("llama.attention.head_count_kv", [2])
    _close(w, _tiny_tensors())
    with pytest.raises(ModelError, match="llama.attention.head_count_kv is an array"):
        GGUFModel(path)
