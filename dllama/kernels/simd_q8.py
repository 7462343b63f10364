"""Row dots of the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against Q8
activations, in GGML's order: one fused multiply-add per block into 8 float lanes. One builder
serves every format, since only the unpacking of a block's quants differs; the shared IR pieces
are in simd.py, the numpy reference is matmul.py's matmul_ref.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .simd import (F16, F32, F64, I8, I32, I64, LANES, X86_32_REGISTERS, X86_VNNI, block_intrinsics, const_vec,
                   fmuladd, hsum_float_8, iq4_nl_values, load_at, opaque, packed_intrinsics, quad_dot, splat, vec)

# Byte layout of each native block format: (bytes per block, offset of the quants); Q5's fifth
# bits (one uint32 per block) sit just before the quants
_BLOCK = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2), "q5_0": (22, 6), "q5_1": (24, 8), "iq4_nl": (18, 2)}
_WITH_MIN = ("q4_1", "q5_1")  # v = q * d + m: the activations' block sums meet m
# A tile of the prefill GEMM: each weight block unpacked once for TILE_TOKENS tokens, each activation
# block loaded once for TILE_ROWS rows. With AVX-512's 32 registers 4 x 4 (16 accumulators), 11%
# faster than 2 x 4 on Zen 4; 2 x 4 elsewhere (AVX2 has 16 registers, NEON 32 of half the width).
TILE_ROWS, TILE_TOKENS = (4 if X86_32_REGISTERS else 2), 4
TILE = (TILE_ROWS, TILE_TOKENS)


# With VNNI the signed formats' quants are kept unsigned, biased by this much (Q4_0's and Q5_0's as
# stored, Q8_0's and IQ4_NL's values plus 128), and each lane of a block dot starts from -bias * (its
# four activations' sum), computed once per activation block for every row: exact integers either way
_BIAS = {"q4_0": 8, "q5_0": 16, "q8_0": 128, "iq4_nl": 128}


def _unpack(builder, fmt: str, w_ptr, block, biased: bool):
    """One weight block at byte `block` of a row: its 32 quants (<32 x i8>, in value order; the
    signed values, or biased by _BIAS[fmt] if `biased`, for the formats without a min), its scale
    d (f32) and, with a min, m (f16)."""
    _, qs_offset = _BLOCK[fmt]
    d_w = builder.fpext(load_at(builder, w_ptr, block, F16), F32)
    m_w = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, 2)), F16) if fmt in _WITH_MIN else None
    if fmt == "q8_0":
        quants = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset)), I8, 32)
        return (builder.xor(quants, const_vec(I8, [-128] * 32)) if biased else quants), d_w, m_w
    packed = load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset)), I8, 16)
    low = builder.and_(packed, const_vec(I8, [15] * 16))
    high = builder.lshr(packed, const_vec(I8, [4] * 16))
    if fmt == "iq4_nl":  # the nibbles index a table of 16 non-linear values
        low, high = iq4_nl_values(builder, low, biased), iq4_nl_values(builder, high, biased)
    quants = builder.shuffle_vector(low, high, const_vec(I32, range(32)))  # value order
    if fmt in ("q5_0", "q5_1"):  # bit j of the block's uint32 is value j's fifth bit
        # (as a mask of 32 bits: AVX-512 turns it into bytes in one instruction, AVX2 in a few)
        bits = builder.bitcast(load_at(builder, w_ptr, builder.add(block, ir.Constant(I64, qs_offset - 4)), I32),
                               vec(ir.IntType(1), 32))
        quants = builder.or_(quants, builder.select(bits, const_vec(I8, [16] * 32), const_vec(I8, [0] * 32)))
    if fmt in ("q4_0", "q5_0") and not biased:
        quants = builder.sub(quants, const_vec(I8, [_BIAS[fmt]] * 32))
    return quants, d_w, m_w


def _emit_dots(builder, fmt: str, acc_t: ir.Type, w_ptrs, x_rows, n_blocks, block_stride: int | None = None):
    """IR of the dot of every weight row (pointers w_ptrs; a row's blocks block_stride bytes apart,
    default one block: rows as stored) with every activation row (x_rows: pointers to its values,
    block scales and block d*sums) -> totals[row][token]. Each pair has
    its own accumulators, added to in the same order as when it is alone, so a pair's bits do
    not depend on the tile it is computed in (batch invariance); the tile shares the unpacking of
    each weight block among its tokens and each activation block among its rows."""
    block_bytes, _ = _BLOCK[fmt]
    biased = X86_VNNI and fmt in _BIAS
    pairs = [(i, j) for i in range(len(w_ptrs)) for j in range(len(x_rows))]
    zero = ir.Constant(vec(acc_t, LANES), [0.0] * LANES)
    acc_slots, summs_slots = {}, {}
    for pair in pairs:
        acc_slots[pair] = cgutils.alloca_once_value(builder, zero)
        builder.store(zero, acc_slots[pair])
        if fmt in _WITH_MIN:
            summs_slots[pair] = cgutils.alloca_once_value(builder, ir.Constant(acc_t, 0.0))
            builder.store(ir.Constant(acc_t, 0.0), summs_slots[pair])

    def splat_scale(scale):
        return splat(builder, builder.fpext(scale, F64) if acc_t is F64 else scale, LANES)

    with cgutils.for_range(builder, n_blocks) as loop:
        b = loop.index
        block = builder.mul(b, ir.Constant(I64, block_stride or block_bytes))
        weights = [_unpack(builder, fmt, w_ptr, block, biased) for w_ptr in w_ptrs]
        for j, (xq_ptr, xd_ptr, xds_ptr) in enumerate(x_rows):
            xq = load_at(builder, xq_ptr, builder.mul(b, ir.Constant(I64, 32)), I8, 32)
            d_x = builder.load(builder.gep(xd_ptr, [b]))
            # in a tile, d_x's splat is one register multiplied by each row's d_w splat
            dx_splat = opaque(builder, splat(builder, d_x, LANES)) if acc_t is F32 and len(w_ptrs) > 1 else None
            start = None
            if biased:  # -bias * the sum of each lane's four activations
                bias = quad_dot(builder, const_vec(I8, [_BIAS[fmt]] * 32), xq, w_unsigned=True)
                start = builder.sub(ir.Constant(vec(I32, LANES), [0] * LANES), bias)
            for i, (quants, d_w, m_w) in enumerate(weights):
                quads = quad_dot(builder, quants, xq, w_unsigned=biased or fmt in _WITH_MIN, acc=start)
                # the scale's product is exact (two f16 significands fit in f32): a product of splats
                # is the splat of the product
                if dx_splat is not None:
                    scale = builder.fmul(splat_scale(d_w), dx_splat)
                else:
                    scale = builder.fmul(splat_scale(d_w), splat_scale(d_x)) if acc_t is F32 else \
                        splat_scale(builder.fmul(d_w, d_x))
                slot = acc_slots[i, j]
                builder.store(fmuladd(builder, scale, builder.sitofp(quads, vec(acc_t, LANES)), builder.load(slot)),
                              slot)
                if fmt in _WITH_MIN:
                    ds_x = builder.load(builder.gep(xds_ptr, [b]))
                    ds_x = builder.fpext(ds_x, F64) if acc_t is F64 else ds_x
                    slot = summs_slots[i, j]
                    builder.store(fmuladd(builder, builder.fpext(m_w, acc_t), ds_x, builder.load(slot)), slot)
    totals = [[None] * len(x_rows) for _ in w_ptrs]
    for i, j in pairs:
        total = hsum_float_8(builder, builder.load(acc_slots[i, j]))
        if fmt in _WITH_MIN:
            total = builder.fadd(total, builder.load(summs_slots[i, j]))
        totals[i][j] = total
    return totals


# dot(w, r, xq, xd, xds, t): row r of weight w (uint8, block format fmt) against Q8 activation row t
# (xq int8 values, xd f16-rounded block scales, xds block d*sum(q), which only Q4_1 and Q5_1 read).
# _wide: accumulated in float64 (every block's contribution is exact in float64, so only the
# additions round, at 2^-53). tile: TILE_ROWS x TILE_TOKENS of them at once.
dot_q4_0_q8, dot_q4_0_q8_wide, tile_q4_0_q8 = block_intrinsics(_emit_dots, "q4_0", "q8", F32, TILE)
dot_q4_1_q8, dot_q4_1_q8_wide, tile_q4_1_q8 = block_intrinsics(_emit_dots, "q4_1", "q8", F32, TILE)
dot_q8_0_q8, dot_q8_0_q8_wide, tile_q8_0_q8 = block_intrinsics(_emit_dots, "q8_0", "q8", F32, TILE)
dot_iq4_nl_q8, dot_iq4_nl_q8_wide, tile_iq4_nl_q8 = block_intrinsics(_emit_dots, "iq4_nl", "q8", F32, TILE)
dot_q5_0_q8, dot_q5_0_q8_wide, tile_q5_0_q8 = block_intrinsics(_emit_dots, "q5_0", "q8", F32, TILE)
dot_q5_1_q8, dot_q5_1_q8_wide, tile_q5_1_q8 = block_intrinsics(_emit_dots, "q5_1", "q8", F32, TILE)

# The same in rows packed by PACK_ROWS[fmt] (kernels/packing.py): strip = PACK_ROWS rows x 1 token (the
# decode matvec: PACK_ROWS independent chains of multiply-adds over one sequential stream), strip_wide
# in float64, tile_..._packed = TILE rows x tokens. 8 rows where their 8 chains fit the registers
# (Zen 4, 1 core, from DRAM: Q4_0 1.35x one row at a time, Q4_1 0.77x: spills), 4 elsewhere.
PACK_ROWS = {"q4_0": 8, "q4_1": 4, "q8_0": 4, "q5_0": 8, "q5_1": 4, "iq4_nl": 8}
assert all(n % TILE_ROWS == 0 for n in PACK_ROWS.values())
PACKED = {fmt: packed_intrinsics(_emit_dots, fmt, "q8", F32, _BLOCK[fmt][0], PACK_ROWS[fmt], TILE) for fmt in _BLOCK}
