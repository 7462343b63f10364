"""Row dots of the K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 values with sub-block scales)
against Q8_K activations, in the order of GGML's AVX2 ggml_vec_dot_<fmt>_q8_K. Apart from the
32-block formats (simd_q8.py) because their layout, their activations and their summation differ
throughout; the shared IR pieces are in simd.py, the numpy reference is matmul.py's matmul_ref.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .simd import (F16, F32, F64, I8, I32, I64, LANES, block_intrinsics, const_vec, fmuladd,
                   hsum_float_8, lane_scales, load_at, pair_sums, scaled_quad_dot, splat, vec)
from .simd_q8 import TILE


# K-quants: super-blocks of 256 values against Q8_K activations (one f32 scale per 256, int8
# values, int sums of every 16). Byte layout: (bytes per super-block, field offsets)
_K_BLOCK = {
    "q4_k": (144, {"d": 0, "dmin": 2, "scales": 4, "qs": 16}),  # 8 sub-blocks of 32: 6-bit scale, 6-bit min
    "q5_k": (176, {"d": 0, "dmin": 2, "scales": 4, "qh": 16, "qs": 48}),  # Q4_K + a fifth bit per value
    "q6_k": (210, {"ql": 0, "qh": 128, "scales": 192, "d": 208}),  # 16 sub-blocks of 16: int8 scale
}


def _unpack_k(builder, fmt: str, w_ptr, block):
    """One super-block at byte `block` of a weight row: d (f16), dmin (f16, Q4_K/Q5_K), the 8 runs of
    32 values as (unsigned quants <32 x i8>, lane scales, offset of the run's activations), and the
    scales that meet the activations' sums (Q4_K/Q5_K: the 8 mins; Q6_K: the 16 scales; <n x i32>)."""
    at = _K_BLOCK[fmt][1]

    def field(name, extra=0):
        return builder.add(block, ir.Constant(I64, at[name] + extra))

    def const(v):
        return ir.Constant(I32, v)

    def i32_vector(values):
        out = ir.Constant(vec(I32, len(values)), None)
        for k, v in enumerate(values):
            out = builder.insert_element(out, v, ir.Constant(I32, k))
        return out

    runs = []
    if fmt in ("q4_k", "q5_k"):
        q = [builder.zext(load_at(builder, w_ptr, field("scales", i), I8), I32) for i in range(12)]
        scales, mins = [], []
        for j in range(8):  # GGML's get_scale_min_k4: 6-bit scale and min of sub-block j
            if j < 4:
                scales.append(builder.and_(q[j], const(63)))
                mins.append(builder.and_(q[j + 4], const(63)))
            else:
                scales.append(builder.or_(builder.and_(q[j + 4], const(15)),
                                          builder.shl(builder.lshr(q[j - 4], const(6)), const(4))))
                mins.append(builder.or_(builder.lshr(q[j + 4], const(4)),
                                        builder.shl(builder.lshr(q[j], const(6)), const(4))))
        fifth_bits = load_at(builder, w_ptr, field("qh"), I8, 32) if fmt == "q5_k" else None
        for j in range(4):  # 64 values: low nibbles = sub-block 2j, high = 2j+1
            packed = load_at(builder, w_ptr, field("qs", 32 * j), I8, 32)
            for half, nibbles in enumerate((builder.and_(packed, const_vec(I8, [15] * 32)),
                                            builder.lshr(packed, const_vec(I8, [4] * 32)))):
                if fifth_bits is not None:  # bit 2j+half of byte b: value b's fifth bit
                    bit = builder.and_(builder.lshr(fifth_bits, const_vec(I8, [2 * j + half] * 32)),
                                       const_vec(I8, [1] * 32))
                    nibbles = builder.or_(nibbles, builder.shl(bit, const_vec(I8, [4] * 32)))
                runs.append((nibbles, lane_scales(builder, scales[2 * j + half]), 64 * j + 32 * half))
        sum_scales = i32_vector(mins)
    else:  # q6_k: 128 values per chunk, 4 runs of 32 (two 16-value sub-blocks each)
        scales = [builder.sext(load_at(builder, w_ptr, field("scales", i), I8), I32) for i in range(16)]
        for j in range(2):
            low1 = load_at(builder, w_ptr, field("ql", 64 * j), I8, 32)
            low2 = load_at(builder, w_ptr, field("ql", 64 * j + 32), I8, 32)
            high = load_at(builder, w_ptr, field("qh", 32 * j), I8, 32)
            fifteen, three, four = (const_vec(I8, [v] * 32) for v in (15, 3, 4))
            lows = (builder.and_(low1, fifteen), builder.and_(low2, fifteen),
                    builder.lshr(low1, four), builder.lshr(low2, four))
            for k in range(4):
                top = builder.and_(builder.lshr(high, const_vec(I8, [2 * k] * 32)), three)
                q6 = builder.or_(lows[k], builder.shl(top, const_vec(I8, [4] * 32)))
                s = 2 * (4 * j + k)
                runs.append((q6, lane_scales(builder, scales[s], scales[s + 1]), 128 * j + 32 * k))
        sum_scales = builder.sext(load_at(builder, w_ptr, field("scales"), I8, 16), vec(I32, 16))
    dmin = load_at(builder, w_ptr, field("dmin"), F16) if fmt != "q6_k" else None
    return load_at(builder, w_ptr, field("d"), F16), dmin, runs, sum_scales


def _emit_k_dots(builder, fmt: str, acc_t: ir.Type, w_ptrs, x_rows, n_blocks):
    """IR of the dot of every weight row (w_ptrs) with every Q8_K activation row (x_rows: pointers
    to its values, scales, 16-sums) -> totals[row][token], in the order of GGML's AVX2
    ggml_vec_dot_<fmt>_q8_K: per super-block, 8 integer lanes (lane k: values 4k..4k+3 of every 32,
    times their sub-block scales) turned to floats and fused-multiply-added with the super-block
    scale into 8 float lanes; Q4_K's mins meet the activations' 32-sums in 4 more lanes, Q5_K's in
    one float. Each pair has its own accumulators, added to as when it is alone (batch invariance)."""
    block_bytes = _K_BLOCK[fmt][0]
    wide = acc_t is F64
    pairs = [(i, j) for i in range(len(w_ptrs)) for j in range(len(x_rows))]
    slots = {}
    for pair in pairs:
        init = [("acc", ir.Constant(vec(acc_t, LANES), [0.0] * LANES))]
        init += {"q4_k": [("mins", ir.Constant(vec(acc_t, 4), [0.0] * 4))],
                 "q5_k": [("summs", ir.Constant(acc_t, 0.0))]}.get(fmt, [])
        for name, zero in init:
            slots[pair, name] = cgutils.alloca_once_value(builder, zero)
            builder.store(zero, slots[pair, name])

    def accumulate(pair, name, scale, value):
        slot = slots[pair, name]
        builder.store(fmuladd(builder, scale, value, builder.load(slot)), slot)

    with cgutils.for_range(builder, n_blocks) as loop:
        b = loop.index
        block = builder.mul(b, ir.Constant(I64, block_bytes))
        weights = [_unpack_k(builder, fmt, w_ptr, block) for w_ptr in w_ptrs]
        for j, (xq_ptr, xd_ptr, xs_ptr) in enumerate(x_rows):
            x_d = builder.load(builder.gep(xd_ptr, [b]))
            xq_at = builder.mul(b, ir.Constant(I64, 256))
            xq = {offset: load_at(builder, xq_ptr, builder.add(xq_at, ir.Constant(I64, offset)), I8, 32)
                  for _, _, offset in weights[0][2]}
            sums = builder.load(builder.bitcast(builder.gep(xs_ptr, [builder.mul(b, ir.Constant(I64, 16))]),
                                                vec(I32, 16).as_pointer()), align=4)  # the 16-sums
            block_sums = pair_sums(builder, sums)  # the 32-sums, which meet Q4_K's / Q5_K's mins
            for i, (d_w, dmin_w, runs, sum_scales) in enumerate(weights):
                pair = (i, j)
                sumi = ir.Constant(vec(I32, LANES), [0] * LANES)
                for quants, scales, offset in runs:
                    sumi = scaled_quad_dot(builder, quants, xq[offset], scales, sumi)
                if fmt in ("q4_k", "q5_k"):
                    # mins: lane m = min[2m] * S[2m] + min[2m+1] * S[2m+1], S[i] the 32-sum of sub-block i
                    prod = pair_sums(builder, builder.mul(sum_scales, block_sums))
                    if wide:
                        dmin = builder.fmul(builder.fneg(builder.fpext(x_d, F64)), builder.fpext(dmin_w, F64))
                    else:
                        dmin = builder.fmul(builder.fneg(x_d), builder.fpext(dmin_w, F32))
                    if fmt == "q4_k":
                        accumulate(pair, "mins", splat(builder, dmin, 4), builder.sitofp(prod, vec(acc_t, 4)))
                    else:  # Q5_K adds the four lanes as integers, then one float per super-block
                        lanes = [builder.extract_element(prod, ir.Constant(I32, m)) for m in range(4)]
                        whole = builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3]))
                        accumulate(pair, "summs", dmin, builder.sitofp(whole, acc_t))
                else:  # the values are stored + 32: lane l takes back 32 * (S16[2l] sc[2l] + S16[2l+1] sc[2l+1])
                    offset = pair_sums(builder, builder.mul(sums, sum_scales))
                    sumi = builder.sub(sumi, builder.shl(offset, const_vec(I32, [5] * LANES)))
                d = builder.fmul(builder.fpext(x_d, F64), builder.fpext(d_w, F64)) if wide else \
                    builder.fmul(x_d, builder.fpext(d_w, F32))
                accumulate(pair, "acc", splat(builder, d, LANES), builder.sitofp(sumi, vec(acc_t, LANES)))
    totals = [[None] * len(x_rows) for _ in w_ptrs]
    for i, j in pairs:
        total = hsum_float_8(builder, builder.load(slots[(i, j), "acc"]))
        if fmt == "q4_k":  # (m0 + m2) + (m1 + m3), as GGML's movehl / movehdup
            m = builder.load(slots[(i, j), "mins"])
            el = [builder.extract_element(m, ir.Constant(I32, k)) for k in range(4)]
            total = builder.fadd(total, builder.fadd(builder.fadd(el[0], el[2]), builder.fadd(el[1], el[3])))
        if fmt == "q5_k":
            total = builder.fadd(total, builder.load(slots[(i, j), "summs"]))
        totals[i][j] = total
    return totals


# dot(w, r, xq, xd, xs, t): row r of weight w (uint8, K-quant fmt) against Q8_K activation row t (xq
# int8 values, xd f32 scale of each 256, xs int32 sum of each 16 values), in GGML's order
# (_emit_k_dots). _wide: float64 lanes. tile: TILE_ROWS x TILE_TOKENS of them at once.
dot_q4_k_q8k, dot_q4_k_q8k_wide, tile_q4_k_q8k = block_intrinsics(_emit_k_dots, "q4_k", "q8k", I32, TILE)
dot_q5_k_q8k, dot_q5_k_q8k_wide, tile_q5_k_q8k = block_intrinsics(_emit_k_dots, "q5_k", "q8k", I32, TILE)
dot_q6_k_q8k, dot_q6_k_q8k_wide, tile_q6_k_q8k = block_intrinsics(_emit_k_dots, "q6_k", "q8k", I32, TILE)
