"""Row dots of the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against Q8
activations, in GGML's order: one fused multiply-add per block into 8 float lanes. One builder
serves every format, since only the unpacking of a block's quants differs; the shared IR pieces
are in simd.py, the numpy reference is matmul.py's matmul_ref.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (F16, F32, F64, I8, I32, I64, LANES, const_vec, fmuladd, hsum_float_8, iq4_nl_values, load_at,
                   quad_dot, row_dot_operands, splat, vec)

# Byte layout of each native block format: (bytes per block, offset of the quants); Q5's fifth
# bits (one uint32 per block) sit just before the quants
_BLOCK = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2), "q5_0": (22, 6), "q5_1": (24, 8), "iq4_nl": (18, 2)}
_WITH_MIN = ("q4_1", "q5_1")  # v = q * d + m: the activations' block sums meet m


def _quant_row_dot(fmt: str, wide: bool = False):
    """Build the intrinsic dot(w, r, xq, xd, xds, t): row r of weight w (uint8, block format
    `fmt`) against Q8 activation row t (xq int8 values, xd f16-rounded block scales, xds block
    d*sum(q), which only Q4_1 reads). wide: accumulate in float64 and return it (every block's
    contribution is exact in float64, so only the additions round, at 2^-53)."""
    block_bytes, qs_offset = _BLOCK[fmt]
    acc_t = F64 if wide else F32

    def typer(typingctx, w, r, xq, xd, xds, t):
        sig = (types.float64 if wide else types.float32)(w, r, xq, xd, xds, t)

        def codegen(context, builder, signature, args):
            w_ptr, xq_ptr, xd_ptr, xds_ptr, n_blocks = row_dot_operands(context, builder, signature, args, F32)
            acc_slot = cgutils.alloca_once_value(builder, ir.Constant(vec(acc_t, LANES), None))
            builder.store(ir.Constant(vec(acc_t, LANES), [0.0] * LANES), acc_slot)
            summs_slot = cgutils.alloca_once_value(builder, ir.Constant(acc_t, 0.0))
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                block = builder.mul(b, ir.Constant(I64, block_bytes))
                d_w = builder.fpext(load_at(builder, w_ptr, block, F16), F32)
                d_x = builder.load(builder.gep(xd_ptr, [b]))
                if fmt == "q8_0":
                    quants = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset)), I8, 32)
                else:
                    packed = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset)), I8, 16)
                    low = builder.and_(packed, const_vec(I8, [15] * 16))
                    high = builder.lshr(packed, const_vec(I8, [4] * 16))
                    if fmt == "iq4_nl":  # the nibbles index a table of 16 non-linear values
                        low, high = iq4_nl_values(builder, low), iq4_nl_values(builder, high)
                    quants = builder.shuffle_vector(low, high, const_vec(I32, range(32)))  # value order
                    if fmt in ("q5_0", "q5_1"):  # bit j of the block's uint32 is value j's fifth bit
                        qh = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset - 4)), I32)
                        bits = builder.and_(builder.lshr(splat(builder, qh, 32), const_vec(I32, range(32))),
                                            const_vec(I32, [1] * 32))
                        fifth = builder.shl(builder.trunc(bits, vec(I8, 32)), const_vec(I8, [4] * 32))
                        quants = builder.or_(quants, fifth)
                    if fmt in ("q4_0", "q5_0"):
                        offset = 8 if fmt == "q4_0" else 16
                        quants = builder.sub(quants, const_vec(I8, [offset] * 32))
                xq = load_at(builder, xq_ptr, builder.mul(b, ir.Constant(I64, 32)), I8, 32)
                quads = builder.sitofp(quad_dot(builder, quants, xq, w_unsigned=fmt in _WITH_MIN),
                                       vec(acc_t, LANES))
                scale = builder.fmul(d_w, d_x)  # exact: two f16 significands fit in f32
                scale = splat(builder, builder.fpext(scale, F64) if wide else scale, LANES)
                builder.store(fmuladd(builder, scale, quads, builder.load(acc_slot)), acc_slot)
                if fmt in _WITH_MIN:
                    m_w = builder.fpext(load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, 2)), F16), acc_t)
                    ds_x = builder.load(builder.gep(xds_ptr, [b]))
                    ds_x = builder.fpext(ds_x, F64) if wide else ds_x
                    builder.store(fmuladd(builder, m_w, ds_x, builder.load(summs_slot)), summs_slot)
            total = hsum_float_8(builder, builder.load(acc_slot))
            if fmt in _WITH_MIN:
                total = builder.fadd(total, builder.load(summs_slot))
            return total

        return sig, codegen

    typer.__name__ = f"dot_{fmt}_q8{'_wide' if wide else ''}"
    return intrinsic(typer)


dot_q4_0_q8 = _quant_row_dot("q4_0")
dot_q4_1_q8 = _quant_row_dot("q4_1")
dot_q8_0_q8 = _quant_row_dot("q8_0")
dot_iq4_nl_q8 = _quant_row_dot("iq4_nl")
dot_q5_0_q8 = _quant_row_dot("q5_0")
dot_q5_1_q8 = _quant_row_dot("q5_1")
dot_q4_0_q8_wide = _quant_row_dot("q4_0", wide=True)
dot_iq4_nl_q8_wide = _quant_row_dot("iq4_nl", wide=True)
dot_q5_0_q8_wide = _quant_row_dot("q5_0", wide=True)
dot_q5_1_q8_wide = _quant_row_dot("q5_1", wide=True)
dot_q4_1_q8_wide = _quant_row_dot("q4_1", wide=True)
dot_q8_0_q8_wide = _quant_row_dot("q8_0", wide=True)
