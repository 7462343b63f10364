"""Every numba kernel against its numpy reference, with tolerances a real bug would break (wrong
block layout, scale, pairing, head mapping or mask), and the references against plain float64
formulas so that a reference cannot drift along with its kernel."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from dllama.config import RopeScaling
from dllama.kernels import PARALLEL, ops
from dllama.kernels.activations import (PAIR_LANE_QUADS, PAIR_LANES_ALTERNATE, PAIRED_BLOCK_BYTES, STARTS_BLOCK_BYTES,
                                        Activations, Q8Activations, Q8KActivations, pair_q8_ref, q8_starts_ref,
                                        round_f16)
from dllama.kernels.attention import attention, attention_ref
from dllama.kernels.matmul import SPANNED_TOKENS, matmul, matmul_in_lanes_ref, matmul_ref
from dllama.kernels.packing import PACKABLE, span_blocks
from dllama.kernels.ops import (exp_nonpositive_f64, expf, gelu_mul, gelu_mul_ref, gelu_table, rmsnorm, rmsnorm_ref,
                                rope, rope_ref, silu_mul, silu_mul_ref, softcap)
from dllama.kernels.simd_float import f32_bits, f32_from_bits, fma
from dllama.quant import FORMATS, K_QUANTS, QK, QType, dequantize, quantize
from dllama.weights import Matrix

ROOT = Path(__file__).resolve().parent.parent
QTYPES = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.Q4_K, QType.Q5_K,
          QType.Q6_K, QType.F16, QType.F32]
QUANTIZED = [q for q in QTYPES if q not in (QType.F16, QType.F32)]  # the formats with integer block dots


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    return float(np.abs(ours.astype(np.float64) - ref.astype(np.float64)).max() / np.abs(ref).max())


def k_quant_blocks(qtype: QType, rows: int, cols: int, rng) -> np.ndarray:
    """Valid K-quant rows from random bytes (every bit pattern of quants, scales and mins), with
    super-block scales that keep the values near 0.5/sqrt(cols): no reference quantizer needed."""
    fmt = FORMATS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // 256, fmt.block_bytes), dtype=np.uint8)
    magnitude = 0.5 / np.sqrt(cols) / {QType.Q4_K: 15 * 63, QType.Q5_K: 31 * 63, QType.Q6_K: 32 * 127}[qtype]
    scale = (magnitude * rng.uniform(0.5, 2.0, size=raw.shape[:2] + (2,))).astype(np.float16).view(np.uint8)
    if qtype in (QType.Q4_K, QType.Q5_K):
        raw[..., 0:4] = scale.reshape(raw.shape[:2] + (4,))  # d, dmin
    else:
        raw[..., 208:210] = scale.reshape(raw.shape[:2] + (4,))[..., :2]  # d
    return raw.reshape(rows, -1)


def weight_matrix(qtype: QType, rows: int, cols: int, seed: int) -> Matrix:
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return Matrix(qtype, rows, cols, k_quant_blocks(qtype, rows, cols, rng))
    values = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.5 / np.sqrt(cols))
    values[:, :QK] += np.float32(0.02)  # an offset, so Q4_1's minimum term matters
    return Matrix(qtype, rows, cols, quantize(values, qtype))


def activations(T: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[:, 3] *= 40.0  # an outlier dimension, as real activations have
    return x


# ------------------------------------------------------------------ matmul


@pytest.mark.parametrize("rows, T", [(1, 1), (37, 3), (129, 17), (1, 17)])  # a row alone, a token alone, both many
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_matches_reference(qtype, rows, T):
    cols = 512 if qtype in K_QUANTS else 320
    w = weight_matrix(qtype, rows, cols, seed=rows)
    x = activations(T, cols, seed=T)
    ours = matmul(w.data, qtype, x)
    ref = matmul_ref(w.data, qtype, x)
    assert ours.shape == ref.shape == (T, rows) and ours.dtype == np.float32
    assert rel_err(ours, ref) <= 1e-5


_SERIAL_PRODUCTS = """
import sys
import numpy as np
from dllama.kernels import PARALLEL
from dllama.kernels.activations import Activations
from dllama.kernels.matmul import _mm_quant, matmul
assert not PARALLEL and not _mm_quant.targetoptions["parallel"]
w = np.load(sys.argv[1])
for T in (1, 9):  # one pair at a time, and tiles
    x = np.random.default_rng(T).standard_normal((T, w.shape[1] // 18 * 32), dtype=np.float32)
    sys.stdout.buffer.write(matmul(w, {qtype}, Activations(x)).tobytes())
"""


@pytest.mark.skipif(not PARALLEL, reason="this process's kernels are serial too (DLLAMA_SERIAL_KERNELS): none to compare")
def test_serial_kernels_give_the_parallel_kernels_bits(tmp_path):
    """DLLAMA_SERIAL_KERNELS (the emulated aarch64 runs' kernels, tests/aarch64/runs.py): numba's parallel
    loops compiled as plain loops give the bits of the parallel kernels, which run here on 2 threads."""
    from dllama.kernels.activations import Activations
    from dllama.kernels.matmul import _mm_quant

    assert _mm_quant.targetoptions["parallel"]
    w = weight_matrix(QType.Q4_0, 67, 320, seed=5).data
    np.save(tmp_path / "w.npy", w)
    expected = b"".join(matmul(w, QType.Q4_0, Activations(np.random.default_rng(T).standard_normal(
        (T, 320), dtype=np.float32))).tobytes() for T in (1, 9))
    env = {**os.environ, "DLLAMA_SERIAL_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", _SERIAL_PRODUCTS.format(qtype=int(QType.Q4_0)), str(tmp_path / "w.npy")],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout == expected


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_on_column_slices(qtype):
    """A column slice is a strided view: rows are not adjacent in memory."""
    rows, cols = 45, 512
    w = weight_matrix(qtype, rows, cols, seed=11)
    # f16/f32: any column, odd tail; K-quants: whole super-blocks of 256
    start, stop = {QType.F16: (5, 102), QType.F32: (5, 102), **{k: (256, 512) for k in K_QUANTS}}.get(qtype, (128, 384))
    part = w.col_slice(start, stop)
    assert part.cols == stop - start and not part.data.flags.c_contiguous
    for T in (1, 3, 17):
        x = activations(T, cols, seed=20 + T)[:, start:stop]
        ours = part.matmul(x)
        ref = matmul_ref(np.ascontiguousarray(part.data), qtype, x)
        assert rel_err(ours, ref) <= 1e-5
        # the slice of the full product's inputs: same as cutting the dequantized matrix
        full = dequantize(np.ascontiguousarray(w.data), qtype)[:, start:stop].astype(np.float64)
        assert rel_err(ours, x.astype(np.float64) @ full.T) <= 0.02  # activation quantization error only
    rows_part = w.row_slice(7, 30)
    x = activations(3, cols, seed=40)
    np.testing.assert_array_equal(rows_part.matmul(x), w.matmul(x)[:, 7:30])


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_reference_is_the_dequantized_product(qtype):
    """matmul_ref against dequantize(W) @ dequantize(Q8(x)) in float64 (Q4_1, Q5_1 read the f16-rounded
    d*sum(q) of each activation block, as GGML's block_q8_1 does; that rounding is the slack)."""
    rows, cols = 33, 256
    w = weight_matrix(qtype, rows, cols, seed=3)
    x = activations(4, cols, seed=4)
    ref = matmul_ref(w.data, qtype, x)
    wf = dequantize(w.data, qtype).astype(np.float64)
    if qtype == QType.F32:
        xf = x.astype(np.float64)
    elif qtype == QType.F16:
        xf = round_f16(x).astype(np.float64)
    elif qtype in K_QUANTS:
        k = Q8KActivations.quantize_ref(x)
        xf = (k.q.reshape(4, -1, 256) * k.d[..., None].astype(np.float64)).reshape(4, cols)
    else:
        a = Q8Activations.quantize_ref(x)
        xf = (a.q.reshape(4, -1, QK) * a.d[..., None].astype(np.float64)).reshape(4, cols)
    tol = 2e-3 if qtype in (QType.Q4_1, QType.Q5_1) else 1e-6
    assert rel_err(ref, xf @ wf.T) <= tol
    # and the float product, unquantized activations: quantizing x costs ~1% at most (Q8_K: one
    # scale per 256 values, set by the outlier dimension, so ~3%)
    assert rel_err(ref, x.astype(np.float64) @ wf.T) <= (0.05 if qtype in K_QUANTS else 0.02)


def test_matmul_vector_out_and_shared_activations():
    w = weight_matrix(QType.Q4_1, 40, 256, seed=5)
    g = weight_matrix(QType.Q8_0, 24, 256, seed=6)
    x = activations(1, 256, seed=7)
    expected = matmul_ref(w.data, QType.Q4_1, x)
    y = w.matmul(x[0])
    assert y.shape == (40,)
    assert rel_err(y, expected[0]) <= 1e-5
    out = np.full((1, 40), np.nan, np.float32)
    assert matmul(w.data, QType.Q4_1, x, out) is out
    np.testing.assert_array_equal(out[0], y)
    shared = Activations(x)
    np.testing.assert_array_equal(w.matmul(shared), out)
    np.testing.assert_array_equal(g.matmul(shared), g.matmul(x))
    assert shared.q8 is shared.q8  # quantized once for all the matrices that read it
    with pytest.raises(ValueError, match="contiguous rows"):  # a prefill tile writes whole rows
        matmul(w.data, QType.Q4_1, activations(5, 256, seed=8), np.zeros((40, 5), np.float32).T)


# ------------------------------------------------------------------ activation quantization


def _q8_inputs():
    rng = np.random.default_rng(8)
    yield "gaussian", rng.standard_normal((17, 576)).astype(np.float32)
    wide = rng.standard_normal((3, 256)).astype(np.float32) * np.geomspace(1e-6, 1e3, 256).astype(np.float32)
    yield "wide range", wide
    ties = np.zeros((2, 64), np.float32)
    ties[:, 0] = 127.0  # scale exactly 1: every .5 below is a rounding tie
    ties[0, 1:32] = np.arange(31, dtype=np.float32) - 15.5
    ties[1, 1:32] = -(np.arange(31, dtype=np.float32) + 0.5)
    ties[:, 32:] = 0.0  # an all-zero block
    yield "ties and zeros", ties
    yield "one value", np.array([[0.0] * 31 + [-5.0]], np.float32)
    # the maximum |x| taken from the magnitudes' bits: negative extremes, -0.0, subnormals beside normals
    signs = np.full((2, 64), -0.0, np.float32)
    signs[0, :32] = -np.geomspace(1e-3, 7.0, 32, dtype=np.float32)
    signs[1, :32] = np.float32(1e-41) * np.arange(32, dtype=np.float32)
    signs[1, 5] = np.float32(1e-30)
    signs[:, 40] = np.float32(-6.0e4)  # (d and d * sum(q) still within f16)
    yield "signs, subnormals, extremes", signs


@pytest.mark.parametrize("name, x", list(_q8_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_q8_activation_quantization_equals_reference_exactly(name, x):
    ours, ref = Q8Activations.quantize(x), Q8Activations.quantize_ref(x)
    np.testing.assert_array_equal(ours.q, ref.q)
    np.testing.assert_array_equal(ours.d, ref.d)
    np.testing.assert_array_equal(ours.ds, ref.ds)
    assert ours.q.dtype == np.int8 and np.isfinite(ours.d).all()


def test_q8_activation_quantization_semantics():
    """q = rint(x * 127 / amax) (halves to even, as GGML's AVX2 path), d = amax/127 rounded to f16,
    ds = d * sum(q) rounded to f16; an all-zero block has d = 0 and q = 0."""
    x = dict(_q8_inputs())["ties and zeros"]
    a = Q8Activations.quantize(x)
    np.testing.assert_array_equal(a.q[:, :32], np.rint(x[:, :32]).astype(np.int8))
    np.testing.assert_array_equal(a.q[:, 32:], 0)
    assert a.d[0, 0] == np.float32(np.float16(1.0)) and a.d[0, 1] == 0.0
    np.testing.assert_array_equal(a.ds[:, 0], round_f16(np.rint(x[:, :32]).sum(-1).astype(np.float32)))
    g = dict(_q8_inputs())["gaussian"]
    a = Q8Activations.quantize(g)
    amax = np.abs(g.reshape(17, -1, QK)).max(-1)
    np.testing.assert_array_equal(a.d, round_f16(amax / np.float32(127.0)))
    assert np.abs(a.q).max() == 127


def test_q8_paired_layout_equals_reference_exactly():
    """The paired layout (the prefill tiles' activations for rows packed in pairs): per block each
    lane's four values (the halves twice each, or with PAIR_LANES_ALTERNATE each four values twice in a
    row), then -bias times each lane's four-value sums as int16, the extremes included."""
    x = dict(_q8_inputs())["gaussian"]
    a = Q8Activations.quantize(x)
    a.q[0, :32] = 127  # the largest sums the int16 must hold, both signs
    a.q[1, :32] = -127
    for bias in (0, 8, 16):
        ours = a.paired(bias)
        np.testing.assert_array_equal(ours, pair_q8_ref(a.q, bias))
        blocks = ours.reshape(17, -1, PAIRED_BLOCK_BYTES)
        values = a.q.reshape(17, -1, 32)
        if PAIR_LANES_ALTERNATE:  # lanes 2i and 2i+1 (rows 2p and 2p+1) meet values 4i .. 4i+3, i = 0-3, then 16 on
            np.testing.assert_array_equal(blocks[..., 4:8], values[..., 0:4])
            np.testing.assert_array_equal(blocks[..., 40:44], values[..., 20:24])
        else:  # lanes 0-3 and 4-7 meet values 0-15, lanes 8-15 values 16-31
            np.testing.assert_array_equal(blocks[..., 16:32], values[..., :16])
        sums = blocks[..., 64:].copy().view(np.int16)
        assert sums[0, 0, 0] == -bias * 4 * 127 and sums[1, 0, 7] == bias * 4 * 127
        lanes_of_quad = [PAIR_LANE_QUADS.index(quad) for quad in range(8)]
        np.testing.assert_array_equal(sums[2, 3, lanes_of_quad],
                                      -bias * values[2, 3].reshape(8, 4).astype(np.int32).sum(-1))
    with pytest.raises(ValueError, match="bias"):
        a.paired(128)


@pytest.mark.parametrize("rows", [17, 300])  # a few rows, and past SERIAL_VALUES (the threads' loop)
def test_q8_starts_layout_equals_reference_exactly(rows):
    """The starts layout (Q8_0's 512-bit tiles): per block the values, then -128 times each four
    values' sum as int32, the extremes included; kept when rows are taken."""
    a = Q8Activations.quantize(np.random.default_rng(rows).standard_normal((rows, 64), dtype=np.float32))
    a.q[0, :32] = 127
    a.q[1, :32] = -127
    ours = a.with_starts()
    np.testing.assert_array_equal(ours, q8_starts_ref(a.q))
    blocks = ours.reshape(rows, -1, STARTS_BLOCK_BYTES)
    np.testing.assert_array_equal(blocks[..., :32], a.q.reshape(rows, -1, 32))
    starts = blocks[..., 32:].copy().view(np.int32)
    assert starts[0, 0, 0] == -128 * 4 * 127 and starts[1, 0, 7] == 128 * 4 * 127
    np.testing.assert_array_equal(starts[2, 1, :], -128 * a.q[2, 32:].reshape(8, 4).astype(np.int32).sum(-1))
    acts, index = Activations.from_q8(a), np.array([3, 0, 1])
    np.testing.assert_array_equal(acts.take(index).q8_starts(), ours[index])  # made from the rows taken
    np.testing.assert_array_equal(acts.q8_starts(), ours)
    np.testing.assert_array_equal(acts.take(index).q8_starts(), ours[index])  # taken with them


@pytest.mark.parametrize("tokens", [1, 8])
def test_q8_quantized_and_paired_in_one_pass_equal_the_two_passes(tokens):
    """Activations.q8_paired makes both forms in one kernel when it comes first, the layout alone
    from the Q8 form when that came first: the same bits either way, for every bias."""
    x = dict(_q8_inputs())["gaussian"][:tokens]
    for bias in (0, 8, 16):
        fused = Activations(x)
        layout = fused.q8_paired(bias)
        alone = Q8Activations.quantize(x)
        np.testing.assert_array_equal(layout, pair_q8_ref(alone.q, bias))
        for name in ("q", "d", "ds"):
            np.testing.assert_array_equal(getattr(fused.q8, name), getattr(alone, name))
        later = Activations(x)
        later.q8  # the Q8 form first: the layout then comes from it
        np.testing.assert_array_equal(later.q8_paired(bias), layout)
    with pytest.raises(ValueError, match="bias"):
        Activations(x).q8_paired(17)


# ------------------------------------------------------------------ rmsnorm


@pytest.mark.parametrize("T, n", [(1, 576), (5, 2048), (3, 64)])
def test_rmsnorm(T, n):
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, n)).astype(np.float32) * np.float32(3.0)
    x[0, 1] = 200.0
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    ours = rmsnorm(x, w, 1e-5)
    np.testing.assert_array_max_ulp(ours, rmsnorm_ref(x, w, 1e-5), maxulp=1)
    x64 = x.astype(np.float64)
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ours, exact, rtol=1e-6, atol=0)
    # eps matters for a near-zero row
    tiny = np.full((1, n), 1e-4, np.float32)
    np.testing.assert_allclose(rmsnorm(tiny, w, 1e-5), tiny / np.sqrt(1e-8 + 1e-5) * w, rtol=1e-6)


# ------------------------------------------------------------------ rope


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("n_dims, base, factors", [(64, 100000.0, False), (32, 10000.0, True)],
                         ids=["full", "partial+freq_factors"])
def test_rope_matches_reference(neox, n_dims, base, factors):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 5, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 31, 500, 4095, 8191])
    ff = np.linspace(1.0, 8.0, n_dims // 2).astype(np.float32) if factors else None
    y = x.copy()
    assert rope(y, pos, n_dims, base, neox, ff) is None  # in place
    ref = rope_ref(x, pos, n_dims, base, neox, ff)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-6 * np.abs(x).max())
    np.testing.assert_array_equal(y[..., n_dims:], x[..., n_dims:])  # dims past n_dims untouched
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("scaling", [RopeScaling(freq_scale=0.25, mscale=0.5),
                                     RopeScaling(freq_scale=0.125, ext_factor=1.0, corr_dims=(5.0, 22.0), mscale=1.0)],
                         ids=["linear", "yarn"])
def test_scaled_rope_matches_reference(scaling):
    """Linear and YaRN scaling against the reference written as the YaRN paper does (float64
    angles: the kernel's float32 angles of up to ~500 rad differ by their rounding)."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 31, 500, 4095])
    y = x.copy()
    rope(y, pos, 64, 10000.0, True, None, scaling)
    ref = rope_ref(x, pos, 64, 10000.0, True, None, scaling)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-3 * np.abs(x).max())
    plain = x.copy()
    rope(plain, pos, 64, 10000.0, True)
    assert np.abs(plain[3:] - y[3:]).max() > 0.1  # the scaling changes the result


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_rope_reference_is_a_rotation_of_the_right_pairs(neox):
    """Against the textbook formula in float64 (exact angles pos * base^(-2i/n)), at small positions
    where GGML's f32 angle recurrence is still accurate."""
    rng = np.random.default_rng(10)
    n_dims, base = 64, 10000.0
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 5, 17])
    half = n_dims // 2
    theta = pos[:, None] * base ** (-2.0 * np.arange(half) / n_dims)  # (T, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a_idx, b_idx = (np.arange(half), np.arange(half) + half) if neox else (np.arange(0, n_dims, 2),
                                                                            np.arange(1, n_dims, 2))
    x64 = x.astype(np.float64)
    exact = x64.copy()
    exact[..., a_idx] = x64[..., a_idx] * cos - x64[..., b_idx] * sin
    exact[..., b_idx] = x64[..., a_idx] * sin + x64[..., b_idx] * cos
    np.testing.assert_allclose(rope_ref(x, pos, n_dims, base, neox), exact, rtol=0, atol=1e-5)
    y = x.copy()
    rope(y, pos, n_dims, base, neox)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ exp and SiLU


def _elementwise(f):
    """f (a jitted function of one value) over a 1-D array, as the kernels call it."""
    @njit(cache=False)
    def each(x):
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = f(x[i])
        return out

    return each


_expf_all = _elementwise(expf)


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in units of the last place between non-negative float32 arrays."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_expf_is_within_two_ulp_of_exp():
    x = np.concatenate([np.linspace(-104.0, 89.0, 1_000_001, dtype=np.float32),
                        np.random.default_rng(11).uniform(-1, 1, 100_000).astype(np.float32),
                        np.float32([-87.33654, -87.3, -88.0, 88.72, 88.7228, -126 * 0.6931, 126 * 0.6931])])
    ours = _expf_all(x)
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64)).astype(np.float32)  # correctly rounded
    finite = np.isfinite(exact)
    assert (ours[~finite] == np.inf).all()  # overflow to inf as exp does (x > 88.72)
    normal = finite & (exact >= np.finfo(np.float32).tiny)
    assert _ulps(ours[normal], exact[normal]).max() <= 2
    sub = finite & ~normal  # subnormal results: within one step of the subnormal grid
    assert sub.sum() > 1000 and _ulps(ours[sub], exact[sub]).max() <= 1


def test_expf_special_values():
    x = np.float32([-np.inf, np.inf, np.nan, 0.0, -0.0, -1000.0, 1000.0, -150.0, 89.0,
                    np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-30])
    y = _expf_all(x)
    assert y[0] == 0.0 and y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 1.0 and y[4] == 1.0
    assert y[5] == 0.0 and y[6] == np.inf and y[7] == 0.0 and y[8] == np.inf
    assert y[9] == np.inf and y[10] == 0.0 and y[11] == 1.0



@njit(cache=False)
def _ggml_expf_lane(x):
    """One lane of GGML's ggml_v_expf as its C reads: the two-factor scaling only where |n| > 126
    (GGML skips it when no lane needs it). The kernel's expf computes every case branch-free."""
    z = fma(x, ops._LOG2E, ops._EXP_SHIFT)
    n = z - ops._EXP_SHIFT
    b = fma(-n, ops._LN2_LO, fma(-n, ops._LN2_HI, x))
    e = np.int32(f32_bits(z) << 23)
    k = f32_from_bits(np.int32(e + ops._ONE_BITS))
    u = b * b
    j = fma(fma(fma(ops._P0, b, ops._P1), u, fma(ops._P2, b, ops._P3)), u, ops._P4 * b)
    if not abs(n) > 126:
        return fma(j, k, k)
    g = ops._NEG_BITS if n <= 0 else np.int32(0)
    s1 = f32_from_bits(np.int32(g + ops._SCALE_BITS))
    s2 = f32_from_bits(np.int32(e - g))
    if abs(n) > 192:
        return s1 * s1
    return fma(s2, j, s2) * s1


def test_expf_is_ggml_s_exp_bit_for_bit():
    """Every 251st float32 bit pattern (all exponents, signs and NaNs among them)."""
    x = (np.arange(0, 1 << 32, 251, dtype=np.uint64).astype(np.uint32)).view(np.float32)
    ours, ggml = _expf_all(x), _elementwise(_ggml_expf_lane)(x)
    same = (ours.view(np.uint32) == ggml.view(np.uint32)) | (np.isnan(ours) & np.isnan(ggml))
    assert same.all(), x[~same][:5]

_exp_nonpositive_f64_all = _elementwise(exp_nonpositive_f64)


def test_float64_exp_of_non_positive_values_is_within_an_ulp_of_numpy_s():
    """The log-sum-exp's exp (a 49k vocabulary per sequence and token): within an ulp or two of
    numpy's where exp's result is normal, 0 below that (nothing a sum that holds exp(0) can see)."""
    x = np.concatenate([-np.linspace(0.0, 708.0, 2_000_001), -np.random.default_rng(12).uniform(0, 1, 100_000),
                        [-0.0, -1e-300, -0.5 * np.log(2), -np.log(2), -707.9]])
    ours = _exp_nonpositive_f64_all(x)
    exact = np.exp(x)
    assert (np.abs(ours - exact) / exact).max() <= 2 * np.finfo(np.float64).eps
    assert (_exp_nonpositive_f64_all(np.array([-708.5, -745.2, -1e6, -np.inf])) == 0).all()
    assert _exp_nonpositive_f64_all(np.array([0.0]))[0] == 1.0


def test_silu_mul():
    rng = np.random.default_rng(12)
    gate = np.concatenate([rng.standard_normal((3, 1000)) * 10,
                           np.linspace(-120, 120, 1000)[None]]).astype(np.float32)
    up = rng.standard_normal((4, 1000)).astype(np.float32)
    ours = silu_mul(gate, up)
    ref = silu_mul_ref(gate, up)
    # silu(g) for g < -88 is a subnormal in float64 and 0 in f32 math (exp(-g) overflows), as in GGML
    np.testing.assert_allclose(ours, ref, rtol=5e-7, atol=1e-30)
    g64 = gate.astype(np.float64)
    np.testing.assert_allclose(ref, g64 / (1 + np.exp(-g64)) * up, rtol=1e-6, atol=1e-37)
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("gate_kernel", [silu_mul, gelu_mul], ids=["silu", "gelu"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_gate_reads_a_stacked_product_in_place(gate_kernel, tokens):
    """gate(both) of a (T, 2n) stacked gate-and-up product: the bits of gate(its two halves), and
    the halves are not mixed up (up's half read for up, at the right offset)."""
    rng = np.random.default_rng(16)
    n = 997  # up's half starts off any vector alignment
    both = (rng.standard_normal((tokens, 2 * n)) * 3).astype(np.float32)
    kept = both.copy()
    gated = gate_kernel(both)
    assert gated.shape == (tokens, n)
    np.testing.assert_array_equal(both, kept)  # read, not written
    gate, up = np.ascontiguousarray(both[:, :n]), np.ascontiguousarray(both[:, n:])
    np.testing.assert_array_equal(gated, gate_kernel(gate, up))
    assert not np.array_equal(gated, gate_kernel(up, gate))
    with pytest.raises(ValueError, match="do not halve"):
        gate_kernel(both[:, 1:])


def test_gelu_mul():
    """GGML's GELU: f16 table lookups of the gate (0 below -10, identity above 10), within the
    table's f16 rounding of the exact tanh-GELU."""
    rng = np.random.default_rng(15)
    gate = np.concatenate([rng.standard_normal((3, 1000)) * 3, np.linspace(-12, 12, 1000)[None]]).astype(np.float32)
    up = rng.standard_normal((4, 1000)).astype(np.float32)
    ours, ref = gelu_mul(gate, up), gelu_mul_ref(gate, up)
    # the gate rounded to f16 (2^-11 relative), the table's value too: ~1e-3 of the gate's size
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3 * np.abs(gate * up).max())
    assert np.array_equal(ours[gate <= -10], np.zeros((gate <= -10).sum(), np.float32))
    np.testing.assert_array_equal(ours[gate >= 10], (gate * up)[gate >= 10])
    # the lookup: the table's entry of the gate's f16 rounding, exactly
    bits = gate[0].astype(np.float16).view(np.uint16)
    inside = np.abs(gate[0]) < 10
    np.testing.assert_array_equal(ours[0][inside], (gelu_table()[bits] * up[0])[inside])


def test_softcap_bends_logits_into_the_cap():
    x = np.linspace(-50, 50, 1001, dtype=np.float32)[None]
    ours = softcap(x, 30.0)
    np.testing.assert_allclose(ours, 30 * np.tanh(x.astype(np.float64) / 30), rtol=1e-6, atol=1e-6)
    assert np.abs(ours).max() < 30 and ours.dtype == np.float32


# ------------------------------------------------------------------ attention


def _kv(rng, Hkv, ctx, D, filled):
    """f16 caches with `filled` cells written and the rest zero, as the engine leaves them."""
    k = np.zeros((Hkv, ctx, D), np.float16)
    v = np.zeros((Hkv, D, ctx), np.float16)
    k[:, :filled] = rng.standard_normal((Hkv, filled, D)).astype(np.float16)
    v[:, :, :filled] = rng.standard_normal((Hkv, D, filled)).astype(np.float16)
    return k, v


@pytest.mark.parametrize("T, start, Hq, Hkv, kv_map", [
    (1, 0, 4, 4, None),  # first token, one query head per KV head
    (1, 37, 8, 2, None),  # decode step, GQA
    (5, 20, 8, 2, None),  # a prefill chunk after cached tokens
    (17, 0, 9, 3, None),  # SmolLM2's layout
    (3, 11, 4, 2, [1, 1, 0, 1]),  # an arbitrary head -> cache mapping (replicated KV heads on a node)
], ids=["T1-start0", "decode-gqa", "chunk-gqa", "prefill-9x3", "custom-map"])
def test_attention_matches_reference(T, start, Hq, Hkv, kv_map):
    rng = np.random.default_rng(T * 100 + start)
    D, ctx = 64, 64
    k, v = _kv(rng, Hkv, ctx, D, start + T)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32) * np.float32(2.0)
    kv_of_head = np.array(kv_map if kv_map else np.arange(Hq) // (Hq // Hkv), np.int64)
    ours = attention(q, k, v, kv_of_head, start)
    ref = attention_ref(q, k, v, kv_of_head, start)
    assert ours.shape == (T, Hq, D)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=5e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kv_map", [[0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2]], ids=["2-2", "3-7-1"])
@pytest.mark.parametrize("start", [0, 30, 31, 70])  # n_pad: 32 (one step), 32 (full), 64, 96
def test_attention_is_ggml_s_single_token_path_bit_for_bit(start, kv_map):
    """One query against the cache: its scores are dot_f16 (ggml_vec_dot_f16's order) of its f16
    rounding with each key, scaled; the softmax as `softmax` computes it, rounded to f16; each
    output dimension dot_f16 of those weights, zero-padded to the dot's step of 32, with that
    dimension's values (llama.cpp's transposed V). The cache's values, in tiles of 32 positions,
    the dots of two accumulators per 512-bit register, and the query heads of a KV head computed
    together (in blocks of up to GROUP_QUERIES: here 2, 3, 7 and 1 heads a KV head) must give
    exactly these bits."""
    from dllama.kernels.attention import softmax
    from dllama.kernels.matmul import dot_f16

    rng = np.random.default_rng(start)
    Hq, Hkv, D, ctx = len(kv_map), max(kv_map) + 1, 64, 96
    n = start + 1
    k, v = _kv(rng, Hkv, ctx, D, n)
    q = rng.standard_normal((1, Hq, D)).astype(np.float32)
    kv_of_head = np.array(kv_map, np.int64)
    ours = attention(q, k, v, kv_of_head, start)
    scale = np.float32(1.0) / np.sqrt(np.float32(D))
    n_pad = -(-n // 32) * 32
    for h in range(Hq):
        keys, values = k[kv_of_head[h]].view(np.uint16), v[kv_of_head[h]].view(np.uint16)
        q16 = q[0, h].astype(np.float16).view(np.uint16)
        scores = np.array([dot_f16(keys, p * D, q16, 0, D) for p in range(n)], np.float32) * scale
        weights = np.zeros(n_pad, np.float16)
        weights[:n] = softmax(scores[None])[0]
        expected = [dot_f16(values, d * ctx, weights.view(np.uint16), 0, n_pad) for d in range(D)]
        np.testing.assert_array_equal(ours[0, h], np.array(expected, np.float32), err_msg=f"head {h}")


@pytest.mark.parametrize("window", [1, 5, 8])
def test_sliding_window_attention_matches_reference(window):
    """A query sees the last `window` positions, itself included; an explicit scale replaces 1/sqrt(D)."""
    rng = np.random.default_rng(window)
    T, start, Hq, Hkv, D, ctx = 6, 11, 4, 1, 64, 32
    k, v = _kv(rng, Hkv, ctx, D, start + T)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kv_of_head = np.zeros(Hq, np.int64)
    ours = attention(q, k, v, kv_of_head, start, 0.25, window)
    ref = attention_ref(q, k, v, kv_of_head, start, 0.25, window)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=5e-5 * np.abs(ref).max())
    assert not np.allclose(ours, attention(q, k, v, kv_of_head, start, 0.25), atol=1e-3)
    if window == 1:  # each token sees only itself: its value row exactly (weight 1)
        np.testing.assert_array_equal(ours, v[0][:, start:start + T].T[:, None, :].astype(np.float32)
                                      .repeat(Hq, axis=1))
    # cells before the window do not matter; the first cell inside it does
    first = start - window + 1  # of query 0
    k[:, :first] = 300.0
    v[:, :, :first] = -200.0
    np.testing.assert_array_equal(attention(q, k, v, kv_of_head, start, 0.25, window), ours)
    v[:, :, first] += np.float16(1.0)
    assert not np.array_equal(attention(q, k, v, kv_of_head, start, 0.25, window)[0], ours[0])


def test_attention_is_causal_and_ignores_stale_cells():
    """Cells past each query's position (other tokens' future, or stale ones after a rewind) must
    not change its output."""
    rng = np.random.default_rng(13)
    T, start, Hq, Hkv, D, ctx = 4, 9, 4, 2, 64, 32
    k, v = _kv(rng, Hkv, ctx, D, start + T)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kv_of_head = np.arange(Hq) // 2
    clean = attention(q, k, v, kv_of_head, start)
    k[:, start + T:] = 300.0  # big but finite garbage
    v[:, :, start + T:] = -200.0
    np.testing.assert_array_equal(attention(q, k, v, kv_of_head, start), clean)
    # query t sees cells 0..start+t only: changing cell start+2 changes tokens 2.. but not 0, 1
    k[:, start + 2] += np.float16(1.0)
    changed = attention(q, k, v, kv_of_head, start)
    np.testing.assert_array_equal(changed[:2], clean[:2])
    assert not np.array_equal(changed[2:], clean[2:])


def test_attention_reference_is_softmax_attention():
    """attention_ref against float64 softmax(q.k / sqrt(D)) @ v, the only difference being the
    f16 rounding of q and of the probabilities (as GGML's f16 KV cache path does)."""
    rng = np.random.default_rng(14)
    T, start, Hq, Hkv, D, ctx = 3, 6, 4, 2, 32, 16
    k, v = _kv(rng, Hkv, ctx, D, start + T)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kv_of_head = np.arange(Hq) // 2
    ref = attention_ref(q, k, v, kv_of_head, start)
    exact = np.empty_like(ref, dtype=np.float64)
    for t in range(T):
        for h in range(Hq):
            n = start + t + 1
            s = k[kv_of_head[h], :n].astype(np.float64) @ q[t, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            exact[t, h] = (p / p.sum()) @ v[kv_of_head[h], :, :n].astype(np.float64).T
    np.testing.assert_allclose(ref, exact, rtol=0, atol=3e-3 * np.abs(exact).max())


def test_attention_rejects_unaligned_shapes():
    q = np.zeros((1, 2, 60), np.float32)
    with pytest.raises(ValueError):
        attention(q, np.zeros((1, 16, 60), np.float16), np.zeros((1, 60, 16), np.float16), np.zeros(2, np.int64), 0)
    q = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(ValueError):
        attention(q, np.zeros((1, 12, 64), np.float16), np.zeros((1, 64, 12), np.float16), np.zeros(2, np.int64), 0)


@pytest.mark.parametrize("n", [1, 7, 8, 33, 300])
def test_softmax_equals_reference(n):
    from dllama.kernels.attention import softmax, softmax_ref

    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32) * 5
    got = softmax(x)
    assert np.allclose(got, softmax_ref(x), rtol=1e-5, atol=1e-7)
    assert np.allclose(got.sum(axis=-1), 1.0, atol=1e-5)


# ------------------------------------------------------------------ batch invariance


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_rows_do_not_depend_on_the_batch(qtype):
    """Each token's output row is the same bits computed alone or among 1..16 others (odd width:
    the F16/F32 tails too)."""
    cols = {QType.F16: 301, QType.F32: 301, **{k: 512 for k in K_QUANTS}}.get(qtype, 320)
    w = weight_matrix(qtype, 33, cols, seed=5)
    x = activations(17, cols, seed=6)
    batched = matmul(w.data, qtype, x)
    for t in range(17):
        np.testing.assert_array_equal(matmul(w.data, qtype, x[t]), batched[t])
    np.testing.assert_array_equal(matmul(w.data, qtype, x[4:11]), batched[4:11])


def test_f16_decode_strips_give_each_row_s_one_token_dot():
    """Decode reads F16 rows in strips (F16_STRIP_ROWS rows, each activation vector loaded once for
    them): every row is still dot_f16 of that row alone (GGML's one-token order), in strips and in
    the rows left over, with a tail past the last 32 columns, rows as stored and column-sliced."""
    from dllama.kernels.matmul import dot_f16

    w = weight_matrix(QType.F16, 37, 333, seed=7)
    x = activations(1, 333, seed=8)
    for m in (w, w.col_slice(32, 333)):
        w16 = m.data.view(np.uint16)
        x16 = round_f16(x[:, 333 - m.cols:]).astype(np.float16).view(np.uint16)
        expected = [dot_f16(w16, r * (w16.strides[0] // 2), x16, 0, m.cols) for r in range(m.rows)]
        np.testing.assert_array_equal(m.matmul(x[:, 333 - m.cols:])[0], np.array(expected, np.float32))


@pytest.mark.parametrize("D", [64, 80])  # 80: the f64 tail past the last multiple of 32
def test_attention_rows_do_not_depend_on_the_batch(D):
    """A prefill of T queries gives, per token, the bits of that token computed alone after the
    same cache (the one-token order), and any split of the chunk gives the same."""
    rng = np.random.default_rng(D)
    T, start, Hq, Hkv, ctx = 23, 9, 6, 2, 64
    k, v = _kv(rng, Hkv, ctx, D, start + T)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kv_of_head = np.arange(Hq) // (Hq // Hkv)
    batched = attention(q, k, v, kv_of_head, start)
    for t in range(T):
        np.testing.assert_array_equal(attention(q[t:t + 1], k, v, kv_of_head, start + t)[0], batched[t])
    np.testing.assert_array_equal(attention(q[5:12], k, v, kv_of_head, start + 5), batched[5:12])


# within kernels.SERIAL_VALUES (rows on the calling thread), and past it; RMSNorm's groups of 8 rows
# whole, short (its spare chains repeat the last row) and a last row alone
@pytest.mark.parametrize("T", [3, 9, 13, 40, 41])
def test_row_kernels_give_each_row_s_bits_alone(T):
    """RMSNorm, RoPE, SiLU, GELU and the Q8 / Q8_K quantizers: rows computed together (on the calling
    thread, or split between threads) are the bits of each row computed alone."""
    from dllama.kernels import SERIAL_VALUES

    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, 512)).astype(np.float32)
    assert (x.size <= SERIAL_VALUES) == (T < 16)
    heads = rng.standard_normal((T, 8, 64)).astype(np.float32)
    norm = rng.standard_normal(512).astype(np.float32)

    def rotated(h, positions):
        h = h.copy()
        rope(h, positions, 64, 10000.0, False)
        return h

    def quantized(rows):
        q8, paired = Q8Activations.quantize_paired(rows, 8)
        q8k = Q8KActivations.quantize(rows)
        return (q8.q, q8.d, q8.ds, paired, Q8Activations.quantize(rows).q, q8k.q, q8k.d, q8k.sums)

    together = (rmsnorm(x, norm, 1e-5), silu_mul(x), gelu_mul(x), rotated(heads, np.arange(T)), *quantized(x))
    for t in range(T):
        alone = (rmsnorm(x[t:t + 1], norm, 1e-5), silu_mul(x[t:t + 1]), gelu_mul(x[t:t + 1]),
                 rotated(heads[t:t + 1], np.array([t])), *quantized(x[t:t + 1]))
        for i, (rows, row) in enumerate(zip(together, alone)):
            np.testing.assert_array_equal(rows[t:t + 1], row, err_msg=f"output {i}, row {t}")


def _check_packed_rows(qtype, cols: int, spans: int, row_counts, token_counts) -> None:
    from dllama.kernels.packing import PackedRows

    for rows in row_counts:
        w = weight_matrix(qtype, max(rows, 1), cols, seed=rows).row_slice(0, rows)  # 0: a node's empty share
        packed = PackedRows.pack(w.data, qtype)
        assert packed.groups.shape[:2] == (spans, -(-rows // packed.rows_per_group))
        np.testing.assert_array_equal(packed.unpack(), w.data)
        np.testing.assert_array_equal(packed.unpack([rows - 1, 0][:rows]), w.data[[rows - 1, 0][:rows]])
        for T in token_counts:
            x = activations(T, cols, seed=T)
            for wide in (False, True):
                ours = matmul(packed, qtype, x, wide=wide)
                assert ours.shape == (T, rows)
                np.testing.assert_array_equal(ours, matmul(w.data, qtype, x, wide=wide),
                                              err_msg=f"{cols} columns, {rows} rows, {T} tokens, wide={wide}")


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.IQ4_NL, QType.Q4_K], ids=lambda q: q.name)
def test_formats_llama_cpp_repacks_sum_in_its_repacked_kernels_order(qtype):
    """Q4_0, IQ4_NL and Q4_K (simd_q8.ROWS_IN_LANES, simd_q8k.K_ROWS_IN_LANES) in every path, float32
    and float64: each (row, token) its exact block dots times d_w * d_x, added block after block by
    one fused multiply-add each (Q4_K: less its mins' the same way), as llama.cpp's kernels for the
    rows it repacks on x86 (matmul_in_lanes_ref, worked out exactly). GGML's vec_dot order (8
    lanes, summed at the end) differs in the last bits of many outputs."""
    from dllama.kernels.packing import PackedRows

    cols = 1024 if qtype == QType.Q4_K else 512  # 4 super-blocks, or 16 blocks, a row
    w = weight_matrix(qtype, 19, cols, seed=11)  # 8 (Q4_K: 4) rows a group and 3 left
    x = activations(6, cols, seed=12)
    ref = matmul_in_lanes_ref(w.data, qtype, x)
    packed = PackedRows.pack(w.data, qtype)
    for T in (1, 2, 4, 6):  # a strip, the spanned tiles and strips, whole-row tiles with a strip left
        for weights in (w.data, packed):
            np.testing.assert_array_equal(matmul(weights, qtype, x[:T]), ref[:T], err_msg=f"{T} tokens")
            wide = matmul(weights, qtype, x[:T], wide=True)
            np.testing.assert_allclose(wide, matmul_ref(w.data, qtype, x[:T]), rtol=1e-6, atol=1e-6)


class _NumpyBuilder:
    """The IR operations LaneSums and the float lane sums emit, on numpy vectors (float32's adds
    round as LLVM's fadd)."""

    @staticmethod
    def _values(v):
        if isinstance(v, (np.ndarray, np.generic)):
            return v
        return np.array([getattr(c, "constant", c) for c in v.constant], np.int64)

    def add(self, a, b):
        return self._values(a) + self._values(b)

    fadd = add

    def shuffle_vector(self, a, b, mask):
        return np.concatenate([self._values(a), self._values(b)])[self._values(mask)]

    def extract_element(self, v, index):
        return v[index.constant]


def test_eight_rows_lane_sums_are_each_rows_hsum_float_8_bit_for_bit():
    """simd.hsum_float_8_rows (the Q4_1 and Q8_0 tiles' last sums on AVX-512, not run on an AVX2
    CPU): lane i is hsum_float_8 of vector i, the same additions in the same order, for values of
    mixed magnitudes (where another order rounds otherwise)."""
    from dllama.kernels.simd import hsum_float_8, hsum_float_8_rows

    rng = np.random.default_rng(7)
    builder, other_order = _NumpyBuilder(), 0
    for _ in range(200):
        accs = [(rng.standard_normal(8) * 10.0 ** rng.integers(-4, 5, 8)).astype(np.float32) for _ in range(8)]
        got = hsum_float_8_rows(builder, accs)
        expected = np.array([hsum_float_8(builder, acc) for acc in accs], np.float32)
        np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))
        other_order += sum(np.float32(sum(acc[1:], acc[0])) != e for acc, e in zip(accs, expected))
    assert other_order > 0, "the values never told the orders apart"


@pytest.mark.parametrize("rows, tokens, two_rows_a_vector", [
    (1, 1, False), (2, 4, False), (4, 4, False), (3, 1, False),  # a dot, AVX2's and AVX-512's tiles, an odd count
    (8, 1, True), (2, 4, True), (8, 2, True), (4, 2, True)])  # strips, then AVX2's and AVX-512's paired tiles
def test_lane_sums_give_each_lane_one_pair_s_whole_sum(rows, tokens, two_rows_a_vector):
    """simd.LaneSums in every tile shape the kernels use, AVX-512's too (not run on an AVX2 CPU):
    each (row, token) ends in exactly one lane, holding the sum of all its lanes."""
    from dllama.kernels.simd import LaneSums

    if two_rows_a_vector:
        labels = [[(2 * p, j)] * 4 + [(2 * p + 1, j)] * 4 for p in range(rows // 2) for j in range(tokens)]
    else:
        labels = [[(i, j)] * 8 for i in range(rows) for j in range(tokens)]
    rng = np.random.default_rng(rows * 10 + tokens)
    vectors = [rng.integers(-2**20, 2**20, 8) for _ in labels]
    expected = {}
    for lanes, v in zip(labels, vectors):
        for pair, value in zip(lanes, v):
            expected[pair] = expected.get(pair, 0) + int(value)
    sums = LaneSums(labels)
    got = {}
    for lanes, v in zip(sums.labels, sums.emit(_NumpyBuilder(), vectors)):
        for pair, value in zip(lanes, v):
            if pair is not None:
                assert pair not in got, f"{pair} in two lanes"
                got[pair] = int(value)
    assert got == expected


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_packed_rows_give_the_stored_rows_bits(qtype):
    """Rows packed 2, 4 or 8 to a group (kernels/packing.py) give every (row, token) the bits of the
    file's layout: decode strips, prefill tiles with tail tiles and strips for the tokens left
    (token counts that leave 2 to 5), float64, and a last group padded (row counts not multiples of
    the group); unpacking gives the rows back."""
    cols = 512 if qtype in K_QUANTS else 320  # K-quants: two super-blocks
    _check_packed_rows(qtype, cols, 1, (0, 1, 5, 8, 13, 35), (1, 2, 3, 4, 5, 7, 10, 17))


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_long_packed_rows_walked_span_by_span_give_the_same_bits(qtype):
    """Rows of 6144 values, packed in three spans of 2048: below matmul.SPANNED_TOKENS tokens walked
    span by span, every strip's and tile's accumulators carried from span to span; from there whole
    rows per tile across the spans. The same bits as the file's layout, padded group or not."""
    _check_packed_rows(qtype, 6144, 3, (0, 16, 35), (1, 2, 3, 4, SPANNED_TOKENS))  # 0: a node's empty share


# Span.loop_pairs serves x86's kernels alone: aarch64's walk one block at a time, as the tests above
# check, and the emulated aarch64 runs (test_aarch64.py) are the suite's longest
_X86_ONLY = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                               reason="the kernels that walk two blocks a trip are x86's")


@_X86_ONLY
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_packed_rows_of_odd_and_even_block_counts_give_the_same_bits(qtype):
    """Rows of 1, 2 and 9 blocks: a kernel that walks its blocks two at a time (simd.Span.loop_pairs)
    ends a row on a pair or on a block alone."""
    for blocks in (1, 2, 9):
        _check_packed_rows(qtype, blocks * FORMATS[qtype].block_size, 1, (8, 13), (1, 2, 4, 8))


@_X86_ONLY
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_spans_of_an_odd_block_count_walked_span_by_span_give_the_same_bits(qtype):
    """Three spans of 63 blocks (7 super-blocks): a span ends on a block alone, and the kernels that
    walk two blocks at a time carry their accumulators across such spans."""
    odd_span = 7 if qtype in K_QUANTS else 63
    assert span_blocks(qtype, 3 * odd_span) == odd_span
    _check_packed_rows(qtype, 3 * odd_span * FORMATS[qtype].block_size, 3, (16,), (1, 2, 4, 8))


def test_q4_1_pairs_of_packed_rows_interleave_their_nibbles_where_the_kernels_read_them_so():
    """Where Q4_1's packed pairs of rows interleave their nibbles (simd_q8.INTERLEAVED_NIBBLES: AVX-512
    with VNNI, not Intel's 512-bit halves), byte k of a pair's 32 quant bytes holds value k of both
    rows, the first's in its low nibble; with Intel's 512-bit halves (simd_q8.PAIR_LANE_ORDER) the
    rows' bytes alternate four by four (lane by lane); elsewhere each row's 16 bytes as stored, side
    by side."""
    from dllama.kernels.packing import PackedRows
    from dllama.kernels.simd_q8 import INTERLEAVED_NIBBLES, PAIR_LANE_ORDER

    w = weight_matrix(QType.Q4_1, 8, 32, seed=3)
    at = FORMATS[QType.Q4_1].field_offsets(8)["qs"]
    quants = PackedRows.pack(w.data, QType.Q4_1).groups[0, 0, at:at + 128].reshape(4, 32)
    stored = w.data[:, 4:20]  # each row's quant bytes (after d and m): value k low, k + 16 high
    values = np.concatenate([stored & 0x0F, stored >> 4], axis=1)  # (8 rows, 32) in value order
    if "q4_1" in INTERLEAVED_NIBBLES:
        expected = values[0::2] | (values[1::2] << 4)
    elif "q4_1" in PAIR_LANE_ORDER:
        expected = np.stack([stored[0::2].reshape(4, 4, 4), stored[1::2].reshape(4, 4, 4)], axis=2).reshape(4, 32)
    else:
        expected = stored.reshape(4, 32)
    np.testing.assert_array_equal(quants, expected)


def test_packed_rows_of_no_columns_give_zeros():
    """A node's column share can be empty (reduce mode, a node without heads): packed, it has no
    spans, and its product is zeros, float32 or float64."""
    from dllama.kernels.packing import PackedRows

    for qtype in PACKABLE:
        packed = PackedRows.pack(np.zeros((5, 0), np.uint8), qtype)
        assert packed.row_bytes == 0 and packed.unpack().shape == (5, 0)
        for T in (1, 3):
            for wide in (False, True):
                np.testing.assert_array_equal(matmul(packed, qtype, np.zeros((T, 0), np.float32), wide=wide),
                                              np.zeros((T, 5)))


def test_a_packed_matrix_is_not_cut():
    """Slices are cut from the file's layout before packing; cutting a packed one is an error, not
    a wrong slice; formats without a packed kernel stay as they are."""
    w = weight_matrix(QType.Q4_0, 16, 256, seed=1)
    packed = w.packed()
    for cut in (lambda: packed.row_slice(0, 8), lambda: packed.col_slice(0, 128), packed.contiguous):
        with pytest.raises(ValueError, match="packed"):
            cut()
    np.testing.assert_array_equal(packed.row_values(np.array([3, 15])), w.row_values(np.array([3, 15])))
    f16 = weight_matrix(QType.F16, 4, 64, seed=2)
    assert f16.packed() is f16 and packed.packed() is packed


def test_q8_activations_assembled_column_major_give_the_same_product():
    """A Q8 gather with empty parts once produced column-major scale arrays, which the kernel read
    as rows (3-10x off): Q8Activations keeps its arrays row-major whatever it is given."""
    w = weight_matrix(QType.Q8_0, 21, 128, seed=3)
    a = Q8Activations.quantize(activations(8, 128, seed=4))
    fortran = Q8Activations(a.q, np.asfortranarray(a.d), np.asfortranarray(a.ds))
    np.testing.assert_array_equal(matmul(w.data, QType.Q8_0, Activations.from_q8(fortran)),
                                  matmul(w.data, QType.Q8_0, Activations.from_q8(a)))


# ------------------------------------------------------------------ the two x86 instruction paths

def attention_case(D: int, start: int) -> np.ndarray:
    """Attention of 5 queries of 10 heads (GQA: 3 KV heads, read by 4, 1 and 5 heads: blocks of 2
    and 2, 1, 2 and 3 with AVX-512, one head at a time with AVX2) at positions start.. over a
    random cache."""
    rng = np.random.default_rng(D + start)
    k = rng.standard_normal((3, 96, D)).astype(np.float16)
    v = rng.standard_normal((3, D, 96)).astype(np.float16)
    q = rng.standard_normal((5, 10, D)).astype(np.float32)
    return attention(q, k, v, np.array([0, 0, 0, 0, 1, 2, 2, 2, 2, 2]), start)


ATTENTION_CASES = [(64, 0), (64, 40), (80, 27), (8, 60)]  # (head_dim, start): a key's tail, rows < a strip

_PRODUCTS_SCRIPT = """
import sys, numpy as np
from tests.test_kernels import ATTENTION_CASES, PACKABLE, QUANTIZED, activations, attention_case, weight_matrix
from dllama.kernels.matmul import matmul
from dllama.quant import QType
from dllama.kernels.simd import X86_32_REGISTERS, X86_VNNI
assert not X86_VNNI and not X86_32_REGISTERS
np.savez(sys.argv[1], **{f"{q.name}-{wide}": matmul(weight_matrix(q, 11, 512, seed=9).data, q,
                                                    activations(9, 512, seed=10), wide=wide)
                         for q in QUANTIZED for wide in (False, True)},
         **{f"{q.name}-packed": matmul(weight_matrix(q, 11, 512, seed=9).packed().data, q, activations(9, 512, seed=10))
            for q in PACKABLE},
         f16=matmul(weight_matrix(QType.F16, 11, 333, seed=9).data, QType.F16, activations(9, 333, seed=10)),
         **{f"attention-{D}-{start}": attention_case(D, start) for D, start in ATTENTION_CASES})
"""


def test_avx2_path_gives_the_avx512_path_s_bits(tmp_path):
    """With AVX-512 the prefill tiles are 4 x 4 (2 x 4 with AVX2's 16 registers) and, with VNNI,
    the quantized dots take vpdpbusd where an AVX2-only CPU runs maddubs + madd (and, for the
    signed formats, no bias); on Intel, two K-quant runs or two halves of a Q4_1/Q5 tile's dot
    share a 512-bit register, and two Q8_0 rows' dots do with VNNI (Intel and AMD); the attention
    takes up to 3 query heads of a KV head at once (one with AVX2). Every output bit must be the
    same: the AVX2 path, forced here with DLLAMA_AVX2_ONLY, in a subprocess (its
    own kernels); the packed rows' tiles give the stored rows' bits
    (test_packed_rows_give_the_stored_rows_bits)."""
    from dllama.kernels.simd import X86_32_REGISTERS

    if not X86_32_REGISTERS:
        pytest.skip("no AVX-512 here: the whole suite runs the AVX2 path already")
    out = tmp_path / "products.npz"
    env = {**os.environ, "DLLAMA_AVX2_ONLY": "1"}
    result = subprocess.run([sys.executable, "-c", _PRODUCTS_SCRIPT, str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    avx2 = np.load(out)
    for q in QUANTIZED:  # tiles and a row alone
        for wide in (False, True):
            ours = matmul(weight_matrix(q, 11, 512, seed=9).data, q, activations(9, 512, seed=10), wide=wide)
            np.testing.assert_array_equal(ours, avx2[f"{q.name}-{wide}"], err_msg=f"{q.name} wide={wide}")
    for q in PACKABLE:  # the packed rows' strips and tiles (2 rows at a time with AVX2)
        np.testing.assert_array_equal(avx2[f"{q.name}-packed"], avx2[f"{q.name}-False"], err_msg=f"{q.name} packed")
    f16 = matmul(weight_matrix(QType.F16, 11, 333, seed=9).data, QType.F16, activations(9, 333, seed=10))
    np.testing.assert_array_equal(f16, avx2["f16"], err_msg="F16 (strips of 2 rows with AVX2)")
    for D, start in ATTENTION_CASES:  # f16 dots of a pair of GGML's accumulators in one 512-bit register,
        # several query heads a KV head at once
        np.testing.assert_array_equal(attention_case(D, start), avx2[f"attention-{D}-{start}"], err_msg=f"{D} {start}")


def test_quantized_dots_use_sdot_on_aarch64():
    """Where numba compiles for a CPU with the ARMv8.2 dot product (a Pi 5), the block dots are sdot
    instructions, not widening multiplies (tests/test_aarch64.py runs this under qemu as a Cortex-A76)."""
    from dllama.kernels.simd import AARCH64_DOTPROD
    from dllama.kernels.simd_q8 import dot_q4_0_q8
    from dllama.kernels.simd_q8k import dot_q4_k_q8k

    if not AARCH64_DOTPROD:
        pytest.skip("not compiling for AArch64 with the dot product")

    @njit
    def dots(w, wk, a_q, a_d, a_ds, k_q, k_d, k_s):
        return dot_q4_0_q8(w, 0, a_q, a_d, a_ds, 0) + dot_q4_k_q8k(wk, 0, k_q, k_d, k_s, 0)

    x = activations(1, 256, seed=1)
    a, k = Q8Activations.quantize(x), Q8KActivations.quantize(x)
    args = (weight_matrix(QType.Q4_0, 1, 256, 1).data, weight_matrix(QType.Q4_K, 1, 256, 1).data,
            a.q, a.d, a.ds, k.q, k.d, k.sums)
    dots(*args)
    asm = next(iter(dots.inspect_asm().values()))
    assert asm.count("sdot") >= 2 and "smull" not in asm, asm[:2000]


def test_q5_fifth_bits_are_spread_by_vector_instructions():
    """Q5_0's and Q5_1's fifth bits become bytes by a byte shuffle and a bit test (simd.bits_to_bytes),
    in the row dots and in the packed strips: LLVM lowered the <32 x i1> mask they were built from
    elsewhere into a scalar extract and insert per bit (x86: vpinsrb, bextr; AArch64: sbfx), which
    made Q5 dots 7x slower than here on AVX2. This looks at the code numba generates for this CPU."""
    from dllama.kernels.matmul import strip_q5_0, strip_q5_1
    from dllama.kernels.packing import PackedRows, rows_per_group
    from dllama.kernels.simd import _AARCH64, _X86_AVX2
    from dllama.kernels.simd_q8 import dot_q5_0_q8, dot_q5_1_q8

    if not (_X86_AVX2 or _AARCH64):
        pytest.skip("neither x86 with AVX2 nor AArch64")

    @njit
    def dots(w0, w1, p0, p1, q, d, ds, out):
        strip_q5_0(p0, 0, 0, q, d, ds, 0, out, 0)
        strip_q5_1(p1, 0, 0, q, d, ds, 0, out, 8)
        return dot_q5_0_q8(w0, 0, q, d, ds, 0), dot_q5_1_q8(w1, 0, q, d, ds, 0)

    x = activations(1, 64, seed=3)
    w0, w1 = weight_matrix(QType.Q5_0, 8, 64, seed=1).data, weight_matrix(QType.Q5_1, 8, 64, seed=2).data
    a = Q8Activations.quantize(x)
    out = np.zeros((1, 16), np.float32)
    row0, row1 = dots(w0, w1, PackedRows.pack(w0, QType.Q5_0).groups, PackedRows.pack(w1, QType.Q5_1).groups,
                      a.q, a.d, a.ds, out)
    n0, n1 = rows_per_group(QType.Q5_0), rows_per_group(QType.Q5_1)
    np.testing.assert_array_equal(out[0, :n0], matmul(w0, QType.Q5_0, x)[0, :n0])
    np.testing.assert_array_equal(out[0, 8:8 + n1], matmul(w1, QType.Q5_1, x)[0, :n1])
    assert (row0, row1) == (out[0, 0], out[0, 8])
    asm = next(iter(dots.inspect_asm().values()))
    per_bit = ("pinsrb", "bextr") if _X86_AVX2 else ("sbfx",)
    per_bit_lines = [line for line in asm.splitlines() if any(op in line for op in per_bit)]
    assert not per_bit_lines, per_bit_lines[:8]


def test_strips_and_tiles_prefetch_what_they_read_next():
    """A decode strip (one token) asks for the bytes it reads next, packed rows PREFETCH_AHEAD past
    each block and f16 rows (a matrix's, the KV cache's) a strip ahead; a tile of packed rows asks
    as its group's first tile (token 0). A step reads each matrix once as a short stream, which the
    hardware prefetcher picks up late. The hints change no result (the same products as matmul's);
    this looks for the instructions in the generated code."""
    from dllama.kernels.matmul import strip_q4_0, tile_q8_0_packed
    from dllama.kernels.packing import PackedRows, rows_per_group
    from dllama.kernels.simd import _AARCH64, _X86_AVX2
    from dllama.kernels.simd_float import F16_STRIP_ROWS, strip_f16_f32
    from dllama.kernels.simd_q8 import PACKED_TILE, STARTS_TILES

    if not (_X86_AVX2 or _AARCH64):
        pytest.skip("neither x86 with AVX2 nor AArch64")

    @njit
    def strip(p, q, d, ds, out):
        strip_q4_0(p, 0, 0, q, d, ds, 0, out, 0)

    @njit
    def strip_f16(w16, x, out16):
        strip_f16_f32(w16, 0, 1, x, 0, 64, out16)

    @njit
    def tile(p, q, d, ds, out):
        tile_q8_0_packed(p, 0, 0, q, d, ds, 0, out, 0)

    rows, tokens = PACKED_TILE["q8_0"]
    x = activations(tokens, 64, seed=3)
    w, w8 = weight_matrix(QType.Q4_0, 8, 64, seed=1).data, weight_matrix(QType.Q8_0, rows, 64, seed=2).data
    w16 = np.random.default_rng(4).standard_normal((F16_STRIP_ROWS, 64)).astype(np.float16)
    x16 = x[:1].astype(np.float16).astype(np.float32)
    a = Q8Activations.quantize(x)
    out, out16 = np.zeros((1, 8), np.float32), np.zeros((1, F16_STRIP_ROWS), np.float32)
    out8 = np.zeros((tokens, rows_per_group(QType.Q8_0)), np.float32)
    strip(PackedRows.pack(w, QType.Q4_0).groups, a.q, a.d, a.ds, out)
    strip_f16(w16.view(np.uint16), x16, out16)
    tile_values = a.with_starts() if "q8_0" in STARTS_TILES else a.q  # the layout the tile reads
    tile(PackedRows.pack(w8, QType.Q8_0).groups, tile_values, a.d, a.ds, out8)
    n = rows_per_group(QType.Q4_0)
    np.testing.assert_array_equal(out[0, :n], matmul(w, QType.Q4_0, x[:1])[0, :n])
    np.testing.assert_array_equal(out16[0], matmul(w16.view(np.uint16), QType.F16, x[:1])[0])
    np.testing.assert_array_equal(out8[:, :rows], matmul(w8, QType.Q8_0, x))
    hint = "prefetcht0" if _X86_AVX2 else "prfm"
    for kernel in (strip, strip_f16, tile):
        asm = next(iter(kernel.inspect_asm().values()))
        assert hint in asm, f"{kernel.__name__}: no {hint}"
