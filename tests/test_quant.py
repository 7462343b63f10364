"""Weight formats: our reference quantizer/dequantizer against gguf-py's (the formats' reference
implementation in Python) and llama.cpp's own quantizer, and the choice of native format for
non-native GGUF types."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf import quants as gguf_quants

from dllama.quant import FORMATS, QK, QType, dequantize, nbytes, quantize, requant_target

BLOCK = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.IQ4_NL]
NATIVE = BLOCK + [QType.F16, QType.F32]
UNIFORM = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1]  # evenly spaced levels


def weights(rows=48, cols=256, seed=0) -> np.ndarray:
    """Gaussian rows at very different scales, plus blocks that are all zero, constant, one-hot,
    all negative, and a block whose extreme is negative (Q4_0 maps the signed extreme to -8)."""
    rng = np.random.default_rng(seed)
    # scales from 1e-2 up: far smaller blocks get f16-subnormal scales, which are coarser
    x = rng.standard_normal((rows, cols)).astype(np.float32) * np.geomspace(1e-2, 1e3, rows, dtype=np.float32)[:, None]
    x[0, :QK] = 0.0
    x[1, :QK] = 0.75
    x[2, :QK] = 0.0
    x[2, 5] = -3.0
    x[3, :QK] = -np.abs(x[3, :QK])
    x[4, :QK] = np.linspace(-2.0, 1.0, QK)
    return x


@pytest.mark.parametrize("qtype", UNIFORM + [QType.F16, QType.F32], ids=lambda q: q.name)
def test_quantize_is_byte_identical_to_gguf_py(qtype):  # (gguf-py has no IQ4_NL quantizer)
    x = weights()
    ours = quantize(x, qtype)
    theirs = gguf_quants.quantize(x, GGML(int(qtype)))
    assert ours.shape == theirs.shape
    assert ours.dtype == theirs.dtype
    assert ours.tobytes() == theirs.tobytes()
    assert ours.nbytes == nbytes(qtype, *x.shape)


@pytest.mark.parametrize("qtype", BLOCK, ids=lambda q: q.name)
def test_quantize_is_byte_identical_to_llama_cpp(qtype):
    """Against GGML's own quantizer (ggml_quantize_chunk in the llama-cpp-python build, as
    llama-quantize calls it, without an importance matrix)."""
    import ctypes
    import glob
    import os

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the aarch64 chroot)")
    libs = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so*"))
    if not libs:
        pytest.skip("no libggml-base in this llama-cpp-python build")
    quantize_chunk = ctypes.CDLL(libs[0]).ggml_quantize_chunk
    quantize_chunk.restype = ctypes.c_size_t
    quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p]
    x = np.ascontiguousarray(weights())
    ours = quantize(x, qtype)
    theirs = np.zeros_like(ours)
    assert quantize_chunk(int(qtype), x.ctypes.data, theirs.ctypes.data, 0, x.shape[0], x.shape[1], None) == ours.nbytes
    if qtype == QType.Q8_0:  # GGML's scalar Q8_0 rounds half away from zero, ours half to even (its SIMD)
        assert (ours != theirs).mean() < 1e-3
    else:
        assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda q: q.name)
def test_dequantize_equals_gguf_py(qtype):
    rng = np.random.default_rng(1)
    x = weights(seed=2)
    data = quantize(x, qtype)
    if qtype in BLOCK:  # also arbitrary bytes: every bit pattern of the quants and (finite) scales
        raw = rng.integers(0, 256, size=data.shape, dtype=np.uint8)
        blocks = raw.reshape(raw.shape[0], -1, FORMATS[qtype].block_bytes)
        scales = rng.standard_normal(blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
        blocks[..., 0:2] = scales[..., 0:2]
        if qtype in (QType.Q4_1, QType.Q5_1):
            blocks[..., 2:4] = rng.standard_normal(blocks.shape[:2]).astype(np.float16).view(np.uint8).reshape(
                blocks.shape[:2] + (2,))
        data = np.concatenate([data, raw])
    ours = dequantize(data, qtype)
    theirs = gguf_quants.dequantize(data, GGML(int(qtype)))
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", UNIFORM, ids=lambda q: q.name)
def test_round_trip_error_is_within_half_a_step(qtype):
    x = weights(seed=3)
    y = dequantize(quantize(x, qtype), qtype)
    blocks = x.reshape(x.shape[0], -1, QK)
    if qtype in (QType.Q4_1, QType.Q5_1):
        step = (blocks.max(-1) - blocks.min(-1)) / (15 if qtype == QType.Q4_1 else 31)
    elif qtype in (QType.Q4_0, QType.Q5_0):
        step = np.abs(blocks).max(-1) / (8 if qtype == QType.Q4_0 else 16)
    else:
        step = np.abs(blocks).max(-1) / 127
    err = np.abs(y - x).reshape(blocks.shape).max(-1)
    # half a step, plus the f16 rounding of the scale (and of Q4_1's minimum), which moves every level.
    # Q4_0's levels run from -8d to 7d with the signed extreme at -8d: values beyond 7d on the other
    # side are clamped, up to one whole step.
    bound = step if qtype in (QType.Q4_0, QType.Q5_0) else step / 2
    slack = 15 * 2.0 ** -11 * np.abs(blocks).max(-1) + 1e-30
    assert (err <= bound + slack).all()
    # an all-zero block stays zero; a one-hot block comes back at its extreme (exactly where the
    # scale is exact in f16: Q4_0's 3/8, Q4_1's minimum; Q8_0's 3/127 is rounded)
    np.testing.assert_array_equal(y[0, :QK], 0.0)
    if qtype not in (QType.Q4_1, QType.Q5_1):  # zero is a level of the symmetric formats
        np.testing.assert_array_equal(np.delete(y[2, :QK], 5), 0.0)
    assert y[2, 5] == -3.0 if qtype != QType.Q8_0 else abs(y[2, 5] + 3.0) <= 3.0 * 2.0 ** -11


def test_q8_0_differs_from_gguf_py_only_at_ties_by_one_step():
    """GGML's reference quantizer rounds halves away from zero (gguf-py follows it); ours rounds
    them to even like GGML's SIMD path. Exact ties are the only place they may differ, by one step."""
    x = np.zeros((2, QK), np.float32)
    x[:, 0] = 127.0  # scale 1: x * (1/d) is x itself
    x[0, 1:] = np.arange(31, dtype=np.float32) - 15.5  # -15.5 ... 14.5: all ties
    x[1, 1:] = np.random.default_rng(6).uniform(-100, 100, 31).astype(np.float32)
    assert not (np.abs(x[1] - np.floor(x[1])) == 0.5).any()  # no ties
    ours = quantize(x, QType.Q8_0)
    theirs = gguf_quants.quantize(x, GGML.Q8_0)
    assert ours[1].tobytes() == theirs[1].tobytes()
    q_ours = ours[0, 2:].view(np.int8).astype(int)
    q_theirs = theirs[0, 2:].view(np.int8).astype(int)
    np.testing.assert_array_equal(q_ours, np.rint(x[0]).astype(int))  # half to even
    np.testing.assert_array_equal(q_theirs, (np.sign(x[0]) * np.floor(np.abs(x[0]) + 0.5)).astype(int))
    assert np.abs(q_ours - q_theirs).max() == 1


def test_quantize_accepts_a_vector_and_rejects_a_partial_block():
    v = np.linspace(-1, 1, 64, dtype=np.float32)
    assert quantize(v, QType.Q8_0).shape == (1, 68)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.ones((2, 48), np.float32), QType.Q4_0)
    with pytest.raises(ValueError):
        FORMATS[QType.Q4_1].row_bytes(33)
    assert FORMATS[QType.F16].row_bytes(33) == 66


def test_native_types_keep_ggml_ids_and_sizes():
    for qtype in NATIVE:
        fmt = FORMATS[qtype]
        assert GGML_QUANT_SIZES[GGML(int(qtype))] == (fmt.block_size, fmt.block_bytes)
        assert GGML(int(qtype)).name == qtype.name


@pytest.mark.parametrize("ggml_type, expected", [
    (GGML.BF16, QType.F16),
    (GGML.F64, QType.F32),
    (GGML.Q2_K, QType.Q4_1),
    (GGML.Q3_K, QType.Q4_1),
    (GGML.Q4_K, QType.Q4_1),
    (GGML.IQ4_NL, QType.Q4_1),
    (GGML.IQ4_XS, QType.Q4_1),
    (GGML.Q5_0, QType.Q8_0),
    (GGML.Q5_1, QType.Q8_0),
    (GGML.Q5_K, QType.Q8_0),
    (GGML.Q6_K, QType.Q8_0),
    (GGML.Q8_1, QType.Q8_0),
], ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_requant_target(ggml_type, expected):
    assert requant_target(int(ggml_type)) == expected


def test_requant_target_never_loses_bits():
    """Whatever the type, the target stores at least as many bits per weight (up to the f16 scales)."""
    for ggml_type in (GGML.Q2_K, GGML.Q3_K, GGML.Q4_K, GGML.Q5_0, GGML.Q5_1, GGML.Q5_K, GGML.Q6_K,
                      GGML.IQ2_XXS, GGML.IQ3_S, GGML.IQ4_XS, GGML.TQ1_0):
        block, size = GGML_QUANT_SIZES[ggml_type]
        target = FORMATS[requant_target(int(ggml_type))]
        bits_in = size * 8 / block
        bits_out = target.block_bytes * 8 / target.block_size
        assert bits_out >= min(bits_in, 5.0), ggml_type.name


@pytest.mark.parametrize("ggml_type", [GGML.Q5_0, GGML.Q5_1, GGML.Q4_K, GGML.Q6_K], ids=lambda t: t.name)
def test_requantized_weights_stay_within_one_target_step(ggml_type):
    """What GGUFModel does with a non-native tensor: gguf-py dequantizes, we quantize to the target."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 512)).astype(np.float32) * 0.05
    source = gguf_quants.dequantize(gguf_quants.quantize(x, ggml_type), ggml_type) if ggml_type in (
        GGML.Q5_0, GGML.Q5_1) else _k_quant_values(x, ggml_type)
    target = requant_target(int(ggml_type))
    y = dequantize(quantize(source, target), target)
    blocks = source.reshape(source.shape[0], -1, QK)
    step = (blocks.max(-1) - blocks.min(-1)) / 15 if target == QType.Q4_1 else np.abs(blocks).max(-1) / 127
    err = np.abs(y - source).reshape(blocks.shape).max(-1)
    assert (err <= step * 0.51 + 2.0 ** -10 * np.abs(blocks).max(-1)).all()


def _k_quant_values(x, ggml_type):
    """gguf-py cannot quantize K-quants: build valid blocks from random bytes and dequantize them."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(x.shape[0], x.shape[1] // block, size), dtype=np.uint8)
    # the super-block scales (f16 d, and dmin for Q4_K) must be finite and small
    if ggml_type == GGML.Q4_K:
        raw[..., 0:4] = (rng.uniform(0.001, 0.01, raw.shape[:2] + (2,))).astype(np.float16).view(np.uint8).reshape(
            raw.shape[:2] + (4,))
    else:  # Q6_K: d is the last 2 bytes
        raw[..., size - 2:] = rng.uniform(0.0001, 0.001, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(
            raw.shape[:2] + (2,))
    return gguf_quants.dequantize(raw.reshape(x.shape[0], -1), ggml_type).astype(np.float32)
