"""Row dots of the K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 values with sub-block scales)
against Q8_K activations, in the order of GGML's AVX2 ggml_vec_dot_<fmt>_q8_K. Apart from the
32-block formats (simd_q8.py) because their layout, their activations and their summation differ
throughout; the shared IR pieces are in simd.py, the numpy reference is matmul.py's matmul_ref.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (F16, F32, F64, I8, I32, I64, LANES, const_vec, fmuladd, hsum_float_8, load_at, quad_dot,
                   row_dot_operands, splat, vec)


# K-quants: super-blocks of 256 values against Q8_K activations (one f32 scale per 256, int8
# values, int sums of every 16). Byte layout: (bytes per super-block, field offsets)
_K_BLOCK = {
    "q4_k": (144, {"d": 0, "dmin": 2, "scales": 4, "qs": 16}),  # 8 sub-blocks of 32: 6-bit scale, 6-bit min
    "q5_k": (176, {"d": 0, "dmin": 2, "scales": 4, "qh": 16, "qs": 48}),  # Q4_K + a fifth bit per value
    "q6_k": (210, {"ql": 0, "qh": 128, "scales": 192, "d": 208}),  # 16 sub-blocks of 16: int8 scale
}


def _k_row_dot(fmt: str, wide: bool = False):
    """Build the intrinsic dot(w, r, xq, xd, xs, t): row r of weight w (uint8, K-quant `fmt`)
    against Q8_K activation row t (xq int8 values, xd f32 scale of each 256, xs int32 sum of
    each 16 values), in the order of GGML's AVX2 ggml_vec_dot_<fmt>_q8_K: per super-block, 8
    integer lanes (lane k: values 4k..4k+3 of every 32, times their sub-block scales) turned to
    floats and fused-multiply-added with the super-block scale into 8 float lanes; Q4_K's mins
    meet the activations' 32-sums in 4 more lanes, Q5_K's in one float. wide: float64 lanes."""
    block_bytes, at = _K_BLOCK[fmt]
    acc_t = F64 if wide else F32

    def typer(typingctx, w, r, xq, xd, xs, t):
        sig = (types.float64 if wide else types.float32)(w, r, xq, xd, xs, t)

        def codegen(context, builder, signature, args):
            w_ptr, xq_ptr, xd_ptr, xs_ptr, n_blocks = row_dot_operands(context, builder, signature, args, I32)
            acc_slot = cgutils.alloca_once_value(builder, ir.Constant(vec(acc_t, LANES), [0.0] * LANES))
            builder.store(ir.Constant(vec(acc_t, LANES), [0.0] * LANES), acc_slot)
            mins_slot = cgutils.alloca_once_value(builder, ir.Constant(vec(acc_t, 4), [0.0] * 4))
            builder.store(ir.Constant(vec(acc_t, 4), [0.0] * 4), mins_slot)
            summs_slot = cgutils.alloca_once_value(builder, ir.Constant(acc_t, 0.0))
            builder.store(ir.Constant(acc_t, 0.0), summs_slot)

            def byte(offset):  # the unsigned byte at w_ptr + offset, as i32
                return builder.zext(load_at(builder, w_ptr, offset, I8), I32)

            def const(v):
                return ir.Constant(I32, v)

            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                block = builder.mul(b, ir.Constant(I64, block_bytes))

                def field(name, extra=0):
                    return builder.add(block, ir.Constant(I64, at[name] + extra))

                x_d = builder.load(builder.gep(xd_ptr, [b]))
                xq_at = builder.mul(b, ir.Constant(I64, 256))
                sums = [builder.load(builder.gep(xs_ptr, [builder.add(builder.mul(b, ir.Constant(I64, 16)),
                                                                      ir.Constant(I64, i))])) for i in range(16)]
                sumi = ir.Constant(vec(I32, LANES), [0] * LANES)
                if fmt in ("q4_k", "q5_k"):
                    q = [byte(field("scales", i)) for i in range(12)]
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
                            xq = load_at(builder, xq_ptr, builder.add(xq_at, ir.Constant(I64, 64 * j + 32 * half)),
                                          I8, 32)
                            quad = quad_dot(builder, nibbles, xq, w_unsigned=True)
                            sumi = builder.add(sumi, builder.mul(quad, splat(builder, scales[2 * j + half], LANES)))
                    # mins: lane m = min[2m] * S[2m] + min[2m+1] * S[2m+1], S[i] the 32-sum of sub-block i
                    block_sums = [builder.add(sums[2 * i], sums[2 * i + 1]) for i in range(8)]
                    prod = ir.Constant(vec(I32, 4), None)
                    for m in range(4):
                        lane = builder.add(builder.mul(mins[2 * m], block_sums[2 * m]),
                                           builder.mul(mins[2 * m + 1], block_sums[2 * m + 1]))
                        prod = builder.insert_element(prod, lane, ir.Constant(I32, m))
                    dmin = builder.fmul(builder.fneg(x_d), builder.fpext(load_at(builder, w_ptr, field("dmin"), F16),
                                                                        F32))
                    if wide:
                        dmin = builder.fmul(builder.fneg(builder.fpext(x_d, F64)),
                                            builder.fpext(load_at(builder, w_ptr, field("dmin"), F16), F64))
                    if fmt == "q4_k":
                        builder.store(fmuladd(builder, splat(builder, dmin, 4), builder.sitofp(prod, vec(acc_t, 4)),
                                               builder.load(mins_slot)), mins_slot)
                    else:  # Q5_K adds the four lanes as integers, then one float per super-block
                        lanes = [builder.extract_element(prod, ir.Constant(I32, m)) for m in range(4)]
                        whole = builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3]))
                        builder.store(fmuladd(builder, dmin, builder.sitofp(whole, acc_t), builder.load(summs_slot)),
                                      summs_slot)
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
                            xq = load_at(builder, xq_ptr, builder.add(xq_at, ir.Constant(I64, 128 * j + 32 * k)),
                                          I8, 32)
                            quad = quad_dot(builder, q6, xq, w_unsigned=True)
                            s = 2 * (4 * j + k)
                            lane_scales = ir.Constant(vec(I32, LANES), None)
                            for lane in range(LANES):
                                lane_scales = builder.insert_element(lane_scales, scales[s + lane // 4],
                                                                     ir.Constant(I32, lane))
                            sumi = builder.add(sumi, builder.mul(quad, lane_scales))
                    # the values are stored + 32: lane l takes back 32 * (S16[2l] sc[2l] + S16[2l+1] sc[2l+1])
                    offset = ir.Constant(vec(I32, LANES), None)
                    for lane in range(LANES):
                        v = builder.add(builder.mul(sums[2 * lane], scales[2 * lane]),
                                        builder.mul(sums[2 * lane + 1], scales[2 * lane + 1]))
                        offset = builder.insert_element(offset, builder.shl(v, const(5)), ir.Constant(I32, lane))
                    sumi = builder.sub(sumi, offset)
                d_w = load_at(builder, w_ptr, field("d"), F16)
                d = builder.fmul(builder.fpext(x_d, F64), builder.fpext(d_w, F64)) if wide else \
                    builder.fmul(x_d, builder.fpext(d_w, F32))
                builder.store(fmuladd(builder, splat(builder, d, LANES), builder.sitofp(sumi, vec(acc_t, LANES)),
                                       builder.load(acc_slot)), acc_slot)
            total = hsum_float_8(builder, builder.load(acc_slot))
            if fmt == "q4_k":  # (m0 + m2) + (m1 + m3), as GGML's movehl / movehdup
                m = builder.load(mins_slot)
                el = [builder.extract_element(m, ir.Constant(I32, i)) for i in range(4)]
                total = builder.fadd(total, builder.fadd(builder.fadd(el[0], el[2]), builder.fadd(el[1], el[3])))
            if fmt == "q5_k":
                total = builder.fadd(total, builder.load(summs_slot))
            return total

        return sig, codegen

    typer.__name__ = f"dot_{fmt}_q8k{'_wide' if wide else ''}"
    return intrinsic(typer)


dot_q4_k_q8k = _k_row_dot("q4_k")
dot_q5_k_q8k = _k_row_dot("q5_k")
dot_q6_k_q8k = _k_row_dot("q6_k")
dot_q4_k_q8k_wide = _k_row_dot("q4_k", wide=True)
dot_q5_k_q8k_wide = _k_row_dot("q5_k", wide=True)
dot_q6_k_q8k_wide = _k_row_dot("q6_k", wide=True)
