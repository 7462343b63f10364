"""Row dots of the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against Q8
activations, in GGML's orders: one fused multiply-add per block into 8 float lanes (its vec_dot), or
for the formats llama.cpp repacks on x86 (ROWS_IN_LANES) the order of its repacked kernels. One
builder serves every format, since only the unpacking of a block's quants differs; the shared IR
pieces are in simd.py, the numpy reference is matmul.py's matmul_ref.
"""

from __future__ import annotations

from functools import partial

from llvmlite import ir
from numba.core import cgutils

from ..quant import FORMATS, QType
from .activations import (PAIR_LANE_QUADS, PAIR_LANE_ROWS, PAIR_LANE_VALUES, PAIR_LANES_ALTERNATE, PAIRED_BLOCK_BYTES, STARTS_BIAS,
                          STARTS_BLOCK_BYTES)
from .simd import (F16, F32, F64, I8, I16, I32, I64, LANES, X86_16_REGISTERS, X86_32_REGISTERS, X86_GFNI, X86_MADDUBS,
                   X86_VNNI, X86_WIDE_DOTS, X86_WIDE_RUNS, InLanes, bits_to_bytes, block_intrinsics, concat, const_vec,
                   fmuladd, halves, hsum_float_8, hsum_float_8_halved, hsum_float_8_rows, iq4_nl_values, load_at,
                   opaque, packed_intrinsics, quad_dot, splat, vec, wide_nibbles)

_WITH_MIN = ("q4_1", "q5_1")  # v = q * d + m: the activations' block sums meet m
# The formats llama.cpp repacks on x86 (Q4_0, IQ4_NL: 8 rows interleaved, ggml-cpu/arch/x86/repack.cpp),
# summed in the order of its kernels for them, which it takes by default there, for one token or many,
# with AVX2 or AVX-512: each (row, token) keeps one float of its own, and each block adds to it its
# exact integer dot times d_w * d_x in one fused multiply-add. Here a block's integer dots are summed
# across lanes until each lane holds one pair's (simd.LaneSums), then one conversion and one multiply-
# add serve 8 pairs, where GGML's vec_dot order takes 8 lanes per pair and a final 8-lane sum.
ROWS_IN_LANES = ("q4_0", "iq4_nl")
# A tile of the prefill GEMM: each weight block unpacked once for TILE_TOKENS tokens, each activation
# block loaded once for TILE_ROWS rows. With AVX-512's 32 registers 4 x 4 (16 accumulators), 11%
# faster than 2 x 4 on Zen 4; 2 x 4 elsewhere (AVX2 has 16 registers, NEON 32 of half the width).
TILE_ROWS, TILE_TOKENS = (4 if X86_32_REGISTERS else 2), 4
TILE = (TILE_ROWS, TILE_TOKENS)
# With AVX-512 (Intel, X86_WIDE_RUNS), the formats summed in GGML's vec_dot order: a pair of rows' two
# 8-lane halves in one 512-bit register (one dot, one conversion, one multiply-add for both)
WIDE_HALVES = X86_WIDE_RUNS
# Q8_0's tiles hold two rows' 8 lanes in one 512-bit register on AMD's Zen 4 too (X86_WIDE_DOTS): its
# 8192 x 576 at 8 tokens, 1 core, EPYC Zen 4: 0.59-0.60 -> 0.45-0.52 ns per (row, token, block)
WIDE_Q8_0 = X86_WIDE_DOTS


# With VNNI the signed formats' quants are kept unsigned, biased by this much (Q4_0's and Q5_0's as
# stored, Q8_0's and IQ4_NL's values plus 128), and each lane of a block dot starts from -bias * (its
# four activations' sum), computed once per activation block for every row: exact integers either way
_BIAS = {"q4_0": 8, "q5_0": 16, "q8_0": 128, "iq4_nl": 128}
# With maddubs (AVX2 without VNNI) the same for the packed rows of Q4_0 and Q5_0 (biased, their quants
# times an activation stay within maddubs' int16), where a signed weight's quad dot costs two psigns
# more. The prefill tiles (one pair of rows on AVX2) load the bias sums with the activations' paired
# layout, which holds them times -PAIR_BIAS[fmt] (activations.py); the decode strips (four pairs) of
# _STRIP_BIAS work them out per activation block. Measured on Zen 3 (1 core, 2048-8192 x 2048, medians
# of interleaved processes against the same code without): Q4_0 strips 1.18x, Q5_0's 0.95x (so not
# them); Q5_0 tiles 1.0-1.06x with their sums.
PAIR_BIAS = {fmt: _BIAS[fmt] for fmt in ("q4_0", "q5_0")} if X86_MADDUBS else {}
_STRIP_BIAS = ("q4_0",) if X86_MADDUBS else ()


def block_format(fmt: str):
    """quant.py's Format of a kernel format name ("q4_0")."""
    return FORMATS[QType[fmt.upper()]]


def _fifth_bit(fmt: str, biased: bool) -> tuple[int, int]:
    """What a Q5 value's fifth bit adds to its nibble, set and clear: 16 and 0, or for Q5_0's signed
    values 0 and -16 (as GGML's AVX2 dot: 0xF0 | nibble is nibble - 16 as a signed byte)."""
    return (0, -16) if fmt == "q5_0" and not biased else (16, 0)


def _unpack(builder, fmt: str, fields: dict, block, biased: bool):
    """One weight block at byte `block` past each of its row's field pointers (`fields`: name ->
    i8*): its 32 quants (<32 x i8>, in value order; the signed values, or biased by _BIAS[fmt] if
    `biased`, for the formats without a min), its scale d (f32) and, with a min, m (f16)."""
    d_w = builder.fpext(load_at(builder, fields["d"], block, F16), F32)
    m_w = load_at(builder, fields["m"], block, F16) if fmt in _WITH_MIN else None
    if fmt == "q8_0":
        quants = load_at(builder, fields["qs"], block, I8, 32)
        return (builder.xor(quants, const_vec(I8, [-128] * 32)) if biased else quants), d_w, m_w
    packed = load_at(builder, fields["qs"], block, I8, 16)
    low = builder.and_(packed, const_vec(I8, [15] * 16))
    high = builder.lshr(packed, const_vec(I8, [4] * 16))
    if fmt == "iq4_nl":  # the nibbles index a table of 16 non-linear values
        low, high = iq4_nl_values(builder, low, biased), iq4_nl_values(builder, high, biased)
    quants = builder.shuffle_vector(low, high, const_vec(I32, range(32)))  # value order
    if fmt in ("q5_0", "q5_1"):  # bit j of the block's uint32 is value j's fifth bit
        quants = builder.or_(quants, bits_to_bytes(builder, load_at(builder, fields["qh"], block, I32, 1), range(32),
                                                   *_fifth_bit(fmt, biased)))
    if fmt == "q4_0" and not biased:
        quants = builder.sub(quants, const_vec(I8, [_BIAS[fmt]] * 32))
    return quants, d_w, m_w


def _row_fields(builder, fmt: str, base, offsets: dict[str, int]) -> dict:
    return {name: builder.gep(base, [ir.Constant(I64, offset)]) for name, offset in offsets.items()}


def _emit_dots(builder, fmt: str, acc_t: ir.Type, w_ptrs, x_rows, span):
    """IR of the dot of every weight row as stored (pointers w_ptrs) with every activation row
    (x_rows: pointers to its values, block scales and block d*sums) -> totals[row][token]."""
    offsets = block_format(fmt).field_offsets()
    rows = [_row_fields(builder, fmt, builder.bitcast(w_ptr, I8.as_pointer()), offsets) for w_ptr in w_ptrs]
    return _emit_row_dots(builder, fmt, acc_t, rows, x_rows, span, block_format(fmt).block_bytes)


def _bias_start(builder, fmt: str, x):
    """Where a biased format's block dot with activations x (<32 x i8>) starts, lane by lane: -_BIAS[fmt]
    times the sum of the lane's four activations."""
    bias = quad_dot(builder, const_vec(I8, [_BIAS[fmt]] * 32), x, w_unsigned=True)
    return builder.sub(ir.Constant(vec(I32, LANES), [0] * LANES), bias)


def _pair_products(builder, weights, xq, start, d_rows, d_x, acc_slots, j) -> None:
    """One activation block (xq, scale d_x, _bias_start or None) of token j into the accumulators of
    each pair of rows, rows 2p and 2p+1 side by side (_emit_row_dots' row_pairs)."""
    x_both = concat(builder, xq, xq)
    biased = start is not None
    if biased:
        start = concat(builder, start, start)
    # every row's d_w * d_x in one multiply (exact: two f16 significands fit in f32)
    products = builder.fmul(d_rows, splat(builder, d_x, len(weights)))
    for p in range(len(weights) // 2):
        (low, _, _), (high, _, _) = weights[2 * p], weights[2 * p + 1]
        scale = builder.shuffle_vector(products, products, const_vec(I32, [2 * p] * LANES + [2 * p + 1] * LANES))
        quads = quad_dot(builder, concat(builder, low, high), x_both, w_unsigned=biased, acc=start)
        slot = acc_slots[p, j]
        builder.store(fmuladd(builder, scale, builder.sitofp(quads, vec(F32, 2 * LANES)), builder.load(slot)), slot)


def _emit_row_dots(builder, fmt: str, acc_t: ir.Type, rows, x_rows, span, block_stride: int,
                   scales_side_by_side: bool = False, starts: bool = False):
    """The dots of weight rows (each a dict of field pointers, its blocks block_stride bytes apart)
    with activation rows. Each pair has its own accumulators, added to in the same order as when it
    is alone, so a pair's bits do not depend on the tile it is computed in (batch invariance); the
    tile shares the unpacking of each weight block among its tokens and each activation block among
    its rows. scales_side_by_side: the rows' scales d are adjacent f16s (rows packed field by field),
    loaded and multiplied by the activation's scale as one vector for one token. starts: the
    activation rows are in the starts layout (activations.Q8Activations.with_starts: Q8_0's row pairs)."""
    biased = X86_VNNI and fmt in _BIAS
    pairs = [(i, j) for i in range(len(rows)) for j in range(len(x_rows))]
    zero = ir.Constant(vec(acc_t, LANES), [0.0] * LANES)
    acc_slots, summs_slots = {}, {}
    in_lanes = InLanes([[pair] * LANES for pair in pairs], acc_t, span, builder) if fmt in ROWS_IN_LANES else None
    # WIDE_Q8_0 (as _emit_pair_dots' halves): a tile of Q8_0 rows packed side by side holds rows 2p and
    # 2p+1 in one 512-bit register (lanes 0-7 and 8-15), each lane with the operations of its 8-lane dot
    row_pairs = WIDE_Q8_0 and fmt == "q8_0" and scales_side_by_side and len(x_rows) > 1 and len(rows) % 2 == 0 \
        and acc_t is F32
    assert row_pairs or not starts, "only Q8_0's row pairs read the starts layout"
    if row_pairs:
        zero_pair = ir.Constant(vec(acc_t, 2 * LANES), [0.0] * 2 * LANES)
        acc_slots = {(p, j): span.accumulator(builder, zero_pair) for p in range(len(rows) // 2)
                     for j in range(len(x_rows))}
    for pair in pairs if in_lanes is None and not row_pairs else ():
        acc_slots[pair] = span.accumulator(builder, zero)
        if fmt in _WITH_MIN:
            summs_slots[pair] = span.accumulator(builder, ir.Constant(acc_t, 0.0))

    def splat_scale(scale):
        return splat(builder, builder.fpext(scale, F64) if acc_t is F64 else scale, LANES)

    one_vector = scales_side_by_side and len(x_rows) == 1 and len(rows) > 1
    with span.loop(builder, block_stride) as (b, block):
        weights = [_unpack(builder, fmt, fields, block, biased) for fields in rows]
        if one_vector or row_pairs:
            d_rows = builder.fpext(load_at(builder, rows[0]["d"], block, F16, len(rows)), vec(F32, len(rows)))
        block_dots, d_tokens = {}, []
        for j, (xq_ptr, xd_ptr, xds_ptr) in enumerate(x_rows):
            if starts:  # the block's values, then its quad dots' starts
                at = builder.mul(b, ir.Constant(I64, STARTS_BLOCK_BYTES))
                xq = load_at(builder, xq_ptr, at, I8, 32)
                start = load_at(builder, xq_ptr, builder.add(at, ir.Constant(I64, 32)), I32, LANES)
            else:
                xq = load_at(builder, xq_ptr, builder.mul(b, ir.Constant(I64, 32)), I8, 32)
                start = _bias_start(builder, fmt, xq) if biased else None
            d_x = builder.load(builder.gep(xd_ptr, [b]))
            d_tokens.append(d_x)
            if in_lanes is not None:
                for i, (quants, _, _) in enumerate(weights):
                    block_dots[i, j] = quad_dot(builder, quants, xq, w_unsigned=biased, acc=start)
                continue
            if row_pairs:
                _pair_products(builder, weights, xq, start, d_rows, d_x, acc_slots, j)
                continue
            # every row's d_w * d_x in one multiply (exact: two f16 significands fit in f32)
            products = builder.fmul(d_rows, splat(builder, d_x, len(rows))) if one_vector else None
            # in a tile, d_x's splat is one register multiplied by each row's d_w splat
            dx_splat = opaque(builder, splat(builder, d_x, LANES)) \
                if acc_t is F32 and len(rows) > 1 and not one_vector else None
            for i, (quants, d_w, m_w) in enumerate(weights):
                quads = quad_dot(builder, quants, xq, w_unsigned=biased or fmt in _WITH_MIN, acc=start)
                # the scale's product is exact (two f16 significands fit in f32): a product of splats
                # is the splat of the product
                if products is not None:
                    scale = builder.extract_element(products, ir.Constant(I32, i))
                    scale = splat(builder, builder.fpext(scale, F64) if acc_t is F64 else scale, LANES)
                elif dx_splat is not None:
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
        if in_lanes is not None:
            in_lanes.add(builder, [block_dots[pair] for pair in pairs], [d_w for _, d_w, _ in weights], d_tokens)
    span.save(builder)
    if in_lanes is not None:
        return in_lanes.totals(builder, len(rows), len(x_rows))
    totals = [[None] * len(x_rows) for _ in rows]
    if row_pairs:  # every row's hsum_float_8 at once, token by token (the output matrix 1.035x)
        assert len(rows) == 8, "Q8_0's row pairs come in tiles of 8 rows (_Q8_0_PACKING)"
        for j in range(len(x_rows)):
            accs = [h for p in range(4) for h in halves(builder, builder.load(acc_slots[p, j]))]
            sums = hsum_float_8_rows(builder, accs)
            for i in range(8):
                totals[i][j] = builder.extract_element(sums, ir.Constant(I32, i))
        return totals
    for i, j in pairs:
        total = hsum_float_8(builder, builder.load(acc_slots[i, j]))
        if fmt in _WITH_MIN:
            total = builder.fadd(total, builder.load(summs_slots[i, j]))
        totals[i][j] = total
    return totals


# The nibble formats whose two rows' quants, packed side by side, are one 32-byte load (_emit_pair_dots)
_NIBBLE_PAIRS = ("q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# The formats whose pairs of packed rows interleave their nibbles (kernels/packing.py), read by
# _emit_interleaved_dots: AVX-512 with VNNI where the 512-bit halves are not taken (AMD's Zen 4).
# Against the pairs (Zen 4, 1 core, interleaved runs, 1536 x 576 and 576 x 1536): 8 tokens 0.49 ->
# 0.46-0.48 and 0.46-0.47 -> 0.42-0.43 ns per (row, token, block), 16 tokens 0.48 -> 0.45-0.47 and
# 0.45 -> 0.41-0.42, 2 tokens 1.02-1.04x, one token (the strips) level
INTERLEAVED_NIBBLES = ("q4_1",) if X86_VNNI and not WIDE_HALVES else ()
# the formats whose 512-bit tiles split their nibbles with one GFNI instruction (simd.wide_nibbles)
_GFNI_NIBBLES = ("q4_1",)
# GGML's lanes 0-3 of a block dot sum values 0-15, lanes 4-7 values 16-31: the activation halves, each
# lane's four values as the pair's lanes meet them (activations.PAIR_LANE_VALUES)
_X_HALVES = (list(PAIR_LANE_VALUES[:32]), list(PAIR_LANE_VALUES[32:]))
# A pair's fifth bits (Q5: its two words' 64 bits) that its low nibbles' 32 bytes take, then its high
# nibbles': each row's in turn, or in lane order, as packing.py puts them (PAIR_LANE_ORDER)
_FIFTH_BITS = ([[*range(16 * h, 16 * h + 16), *range(32 + 16 * h, 48 + 16 * h)] for h in (0, 1)],
               [list(range(32 * h, 32 * h + 32)) for h in (0, 1)])
# the rows' lanes of a pair's 8-lane sum in their order (row 2p's four, then row 2p+1's), for the last sums
_ROWS_FIRST = sorted(range(8), key=lambda k: (PAIR_LANE_ROWS[k], PAIR_LANE_QUADS[k]))


def _emit_pair_dots(builder, fmt: str, acc_t: ir.Type, fields: dict, n_rows: int, x_rows, span, block_stride: int,
                    paired: bool = False):
    """The dots of n_rows (even) rows packed field by field (`fields`: pointers to the first row's
    fields of the group's first block) with activation rows: rows 2p and 2p+1 as one 32-byte load of
    their nibbles, in the order of the lanes they meet (activations.PAIR_LANE_ROWS). Its low nibbles
    against the activations' values 0-15 (each lane's four) give row 2p's GGML lanes 0-3 and row
    2p+1's lanes 0-3 in one quad dot, the high nibbles against values 16-31 their lanes 4-7: every
    lane gets the same operations as in the 8-lane dot (the same bits), with the unpacking, the dots
    and the scales of two rows in the instructions of one. The rows' scales (and mins) are one vector.
    paired: the activation rows are in the paired layout (activations.Q8Activations.paired): those
    halves, then -PAIR_BIAS[fmt] times each lane's four values' sum, loaded instead of worked out per
    token (a prefill tile: one pair of rows on AVX2, where each token's shuffles cost as much as its
    dots)."""
    biased = (X86_VNNI and fmt in _BIAS) or (fmt in PAIR_BIAS if paired else fmt in _STRIP_BIAS)
    n_pairs, tokens = n_rows // 2, range(len(x_rows))
    zero = ir.Constant(vec(acc_t, LANES), [0.0] * LANES)
    acc_slots = {}
    # (ROWS_IN_LANES) a pair of rows' dot with a token: each lane its row's (PAIR_LANE_ROWS)
    in_lanes = InLanes([[(2 * p + PAIR_LANE_ROWS[k], j) for k in range(LANES)] for p in range(n_pairs) for j in tokens],
                       acc_t, span, builder) if fmt in ROWS_IN_LANES else None
    # WIDE_HALVES: a pair of rows' two halves side by side in one 512-bit register (lanes 0-7 the
    # low nibbles' dot, 8-15 the high's), each lane with the operations of its 8-lane one; a tile's
    # (one token's strip: Q4_1 0.8-0.9x with them, Sapphire Rapids)
    halves_512 = WIDE_HALVES and in_lanes is None and len(x_rows) > 1
    if halves_512:
        zero = ir.Constant(vec(acc_t, 2 * LANES), [0.0] * 2 * LANES)
    for key in ((p, j, h) for p in range(n_pairs) for j in tokens for h in ((0,) if halves_512 else (0, 1))) \
            if in_lanes is None else ():
        acc_slots[key] = span.accumulator(builder, zero)
    summs_slots = {}
    if fmt in _WITH_MIN:  # lane i: row i's sum of m * (d*sum) of the activations' blocks
        for j in tokens:
            summs_slots[j] = span.accumulator(builder, ir.Constant(vec(acc_t, n_rows), [0.0] * n_rows))
    # halves_512 (float32): a token's rows' d_w * d_x stored each block, a pair's two (its lanes
    # alternate: PAIR_LANES_ALTERNATE) loaded into its 16 lanes by one 64-bit broadcast, a load port's
    # work. Against a pair's 16 lanes worked out (a permute, then a multiply a token and two pairs:
    # 8 + 1 of ~70 vector instructions a block of an 8 x 4 tile, on the ports the dots need), the
    # same bits; SmolLM2's Q4_1 3072 x 576 and 576 x 1536 at 8 tokens, 1 thread, Sapphire Rapids: 0.34
    # and 0.33 -> 0.31 and 0.30 ns per (row, token, block)
    scales_in_memory = halves_512 and acc_t is F32
    if scales_in_memory:
        assert PAIR_LANES_ALTERNATE
        scratch = cgutils.alloca_once(builder, vec(F32, n_rows), size=len(x_rows))
        scales_at = opaque(builder, builder.bitcast(scratch, F32.as_pointer()))  # (loads, not forwarded)

    def halves_of(vector, f):  # a per-16-byte operation over a 32-byte vector
        parts = [builder.shuffle_vector(vector, vector, const_vec(I32, range(16 * h, 16 * h + 16))) for h in (0, 1)]
        return concat(builder, *(f(part) for part in parts))

    with span.loop(builder, block_stride) as (b, block):
        d_w = builder.fpext(load_at(builder, fields["d"], block, F16, n_rows), vec(F32, n_rows))
        m_w = builder.fpext(load_at(builder, fields["m"], block, F16, n_rows), vec(acc_t, n_rows)) \
            if fmt in _WITH_MIN else None
        nibbles = []  # a pair's quants: (low nibbles' 32 bytes, high's), or with halves_512 both side by side
        for p in range(n_pairs):
            packed = load_at(builder, fields["qs"], builder.add(block, ir.Constant(I64, 32 * p)), I8, 32)
            if halves_512 and X86_GFNI and fmt in _GFNI_NIBBLES:  # both nibbles in one instruction
                low, high = halves(builder, wide_nibbles(builder, packed))
            else:
                low = builder.and_(packed, const_vec(I8, [15] * 32))
                high = builder.lshr(packed, const_vec(I8, [4] * 32))
            if fmt == "iq4_nl":
                low, high = (halves_of(v, partial(iq4_nl_values, builder, biased=biased)) for v in (low, high))
            if fmt in ("q5_0", "q5_1"):  # the fifth bits: each half's 16 of the two rows' uint32s
                words = load_at(builder, fields["qh"], builder.add(block, ir.Constant(I64, 8 * p)), I32, 2)
                low, high = (builder.or_(v, bits_to_bytes(builder, words, _FIFTH_BITS[fmt in PAIR_LANE_ORDER][h],
                                                          *_fifth_bit(fmt, biased)))
                             for h, v in enumerate((low, high)))
            if fmt == "q4_0" and not biased:
                low, high = (builder.sub(v, const_vec(I8, [_BIAS[fmt]] * 32)) for v in (low, high))
            nibbles.append(concat(builder, low, high) if halves_512 else (low, high))
        d_tokens = [builder.load(builder.gep(xd_ptr, [b])) for _, xd_ptr, _ in x_rows]
        if scales_in_memory:  # every token's rows' scales, before the dots load them
            for j, d_x in enumerate(d_tokens):
                builder.store(builder.fmul(d_w, splat(builder, d_x, n_rows)), builder.gep(scratch, [ir.Constant(I64, j)]))
        block_dots = {}
        for j, (xq_ptr, _, xds_ptr) in enumerate(x_rows):
            starts = (None, None)
            if paired:
                at = builder.mul(b, ir.Constant(I64, PAIRED_BLOCK_BYTES))
                x_halves = [load_at(builder, xq_ptr, builder.add(at, ir.Constant(I64, 32 * h)), I8, 32) for h in (0, 1)]
                if fmt in PAIR_BIAS:  # the sums times -bias, as int16 after the halves
                    starts = [builder.sext(load_at(builder, xq_ptr, builder.add(at, ir.Constant(I64, 64 + 16 * h)),
                                                   I16, LANES), vec(I32, LANES)) for h in (0, 1)]
                elif biased:  # (VNNI) a half's quad dot with the bias is already in the pairs' lane order
                    starts = [_bias_start(builder, fmt, half) for half in x_halves]
            else:
                xq = load_at(builder, xq_ptr, builder.mul(b, ir.Constant(I64, 32)), I8, 32)
                x_halves = [builder.shuffle_vector(xq, xq, const_vec(I32, lanes)) for lanes in _X_HALVES]
                if biased:  # -bias * the sum of each lane's four activations, in the pairs' lane order
                    start = _bias_start(builder, fmt, xq)
                    starts = [builder.shuffle_vector(start, start, const_vec(I32, PAIR_LANE_QUADS[8 * h:8 * h + 8]))
                              for h in (0, 1)]
            if in_lanes is not None:  # the two halves' dots added: each row's whole block dot in its 4 lanes
                for p, pair in enumerate(nibbles):
                    low, high = (quad_dot(builder, quants, x_half, w_unsigned=biased, acc=start)
                                 for quants, x_half, start in zip(pair, x_halves, starts))
                    block_dots[p, j] = builder.add(low, high)
                continue
            # every row's d_w * d_x in one multiply (exact: two f16 significands fit in f32)
            scales = None if scales_in_memory else builder.fmul(d_w, splat(builder, d_tokens[j], n_rows))
            if halves_512:
                x_both = concat(builder, *x_halves)
                start = concat(builder, *starts) if starts[0] is not None else None
                for p, pair in enumerate(nibbles):
                    if scales_in_memory:
                        at = builder.gep(scales_at, [ir.Constant(I64, n_rows * j + 2 * p)])
                        scale = builder.load(builder.bitcast(at, vec(F32, 2).as_pointer()), align=4)
                        scale = builder.shuffle_vector(scale, scale, const_vec(I32, PAIR_LANE_ROWS))
                    else:
                        scale = builder.shuffle_vector(scales, scales,
                                                       const_vec(I32, [2 * p + r for r in PAIR_LANE_ROWS]))
                        scale = builder.fpext(scale, vec(F64, 2 * LANES)) if acc_t is F64 else scale
                    quads = quad_dot(builder, pair, x_both, w_unsigned=biased or fmt in _WITH_MIN, acc=start)
                    slot = acc_slots[p, j, 0]
                    builder.store(fmuladd(builder, scale, builder.sitofp(quads, vec(acc_t, 2 * LANES)),
                                          builder.load(slot)), slot)
            for p, pair in enumerate(nibbles) if not halves_512 else ():
                scale = builder.shuffle_vector(scales, scales, const_vec(I32, [2 * p + r for r in PAIR_LANE_ROWS[:LANES]]))
                scale = builder.fpext(scale, vec(F64, LANES)) if acc_t is F64 else scale
                for h, (quants, x_half, start) in enumerate(zip(pair, x_halves, starts)):
                    quads = quad_dot(builder, quants, x_half, w_unsigned=biased or fmt in _WITH_MIN, acc=start)
                    slot = acc_slots[p, j, h]
                    builder.store(fmuladd(builder, scale, builder.sitofp(quads, vec(acc_t, LANES)),
                                          builder.load(slot)), slot)
            if fmt in _WITH_MIN:
                ds_x = builder.load(builder.gep(xds_ptr, [b]))
                ds_x = splat(builder, builder.fpext(ds_x, F64) if acc_t is F64 else ds_x, n_rows)
                builder.store(fmuladd(builder, m_w, ds_x, builder.load(summs_slots[j])), summs_slots[j])
        if in_lanes is not None:
            in_lanes.add(builder, [block_dots[p, j] for p in range(n_pairs) for j in tokens], d_w, d_tokens)
    span.save(builder)
    if in_lanes is not None:
        return in_lanes.totals(builder, n_rows, len(x_rows))
    # a token's rows summed as one tree (hsum_float_8_halved): a pair's two dots (or a register's
    # halves) added give both rows' first additions, a_i + a_(i+4), at once; rows 2p and 2p+1 come
    # out in lanes p and n_pairs + p. The same additions as hsum_float_8's, in ~30 IR operations a
    # token of 8 rows, not ~100 row by row: ~220 fewer instructions an 8 x 4 tile with the 512-bit
    # halves, whose 18 blocks take ~2470. SmolLM2's Q4_1 3072 x 576 at 8 tokens, Sapphire Rapids,
    # interleaved processes: 1 thread 0.39-0.43 -> 0.34-0.37 ns per (row, token, block), 2 threads
    # 0.20-0.235 -> 0.174-0.193; a step of 8 sequences 10.2-10.9 -> 9.9-10.2 ms
    at_lane = [r // 2 + n_pairs * (r % 2) for r in range(n_rows)]
    totals = [[None] * len(x_rows) for _ in range(n_rows)]
    for j in tokens:
        pairs = [halves(builder, builder.load(acc_slots[p, j, 0])) if halves_512 else
                 (builder.load(acc_slots[p, j, 0]), builder.load(acc_slots[p, j, 1])) for p in range(n_pairs)]
        firsts = [builder.fadd(low, high) for low, high in pairs]  # each lane a_i + a_(i+4) of its row
        sums = hsum_float_8_halved(builder, [builder.shuffle_vector(v, v, const_vec(I32, _ROWS_FIRST)) for v in firsts])
        if fmt in _WITH_MIN:
            summs = builder.load(summs_slots[j])
            sums = builder.fadd(sums, builder.shuffle_vector(summs, summs, const_vec(I32, [at_lane.index(v)
                                                                                       for v in range(n_rows)])))
        for r in range(n_rows):
            totals[r][j] = builder.extract_element(sums, ir.Constant(I32, at_lane[r]))
    return totals


def _emit_interleaved_dots(builder, fmt: str, acc_t: ir.Type, fields: dict, n_rows: int, x_rows, span,
                           block_stride: int):
    """The dots of n_rows (even) rows of Q4_1 packed field by field, their nibbles interleaved by
    pairs (INTERLEAVED_NIBBLES: byte k of a pair's 32 holds value k of row 2p in its low nibble and
    of row 2p+1 in its high one), with activation rows in value order. One 32-byte load, a mask and
    a shift give both rows' 32 quants in value order, so each (row, token) block dot is one quad dot
    in GGML's 8 lanes, one conversion and one multiply-add whose scale d_w * d_x is a broadcast
    from memory: no shuffle (_emit_pair_dots shuffles twice a pair and token for its scales). A
    block's scales (every row's for a token: one multiply) are worked out and stored one block
    ahead. In a C copy of this loop (Zen 4, cycles at 3.5 GHz), per (row, token) block dot: about
    1.7 with the scales stored just before their loads (which wait for the store) against 1.25; with
    x a memory operand of each row's dot, 2.2 against 1.7.
    Two blocks a trip of the loop (Span.loop_pairs: the scratch's halves known, no branch for a
    span's first block, no select past its last) and the 8 rows' final sums as one tree
    (hsum_float_8_rows): 8 x 2 tiles 1.07-1.09x at 8 tokens (3072 x 576 and 576 x 1536, 1 core,
    Zen 4, interleaved processes; about 80 -> 50 cycles a tile beside its blocks' ~22 each),
    16 tokens 1.06-1.09x, one token's strips level.
    Zen 4 runs vpdpbusd and vfmadd231ps on the same two pipes (ymm: two a cycle of either, not of
    each; zmm: one), so a block's 16 (row, token) dots take 16 cycles at least (18 in a C loop of
    only the dots, conversions and multiply-adds), against the ~22 above. Two rows a 512-bit
    register (their quads interleaved at load, the scales broadcast as pairs from the scratch:
    about 70 instructions a block instead of ~100, the same bits) was slower, 0.43 -> 0.58 ns per
    (row, token, block) on SmolLM2's 3072 x 576 at 8 tokens (1 core), and 0.43 even without its
    shifts, permutes and scale loads: not kept."""
    assert fmt == "q4_1", "unsigned 4-bit quants with a min (Q4_1's)"
    tokens = range(len(x_rows))
    zero = ir.Constant(vec(acc_t, LANES), [0.0] * LANES)
    acc_slots = {(i, j): span.accumulator(builder, zero) for i in range(n_rows) for j in tokens}
    summs_slots = {j: span.accumulator(builder, ir.Constant(vec(acc_t, n_rows), [0.0] * n_rows)) for j in tokens}
    per_block = n_rows * len(x_rows)  # a block's scales, (token, row)
    scratch = cgutils.alloca_once(builder, vec(acc_t, n_rows), size=2 * len(x_rows))  # two blocks' scales
    scales_at = opaque(builder, builder.bitcast(scratch, acc_t.as_pointer()))  # (loads, not forwarded)

    def store_scales(b, block, half: int):
        """Block b's (at byte `block`) scales into half `half` (0 or 1) of the scratch."""
        d_w = builder.fpext(load_at(builder, fields["d"], block, F16, n_rows), vec(F32, n_rows))
        for j, (_, xd_ptr, _) in enumerate(x_rows):
            # every row's d_w * d_x in one multiply (exact: two f16 significands fit in f32)
            products = builder.fmul(d_w, splat(builder, builder.load(builder.gep(xd_ptr, [b])), n_rows))
            if acc_t is F64:
                products = builder.fpext(products, vec(F64, n_rows))
            builder.store(products, builder.gep(scratch, [ir.Constant(I64, half * len(x_rows) + j)]))

    one, stride = ir.Constant(I64, 1), ir.Constant(I64, block_stride)

    def emit_block(b, block, k, has_next):
        """Block b's dots, its scales in half k of the scratch; the next block's scales into the
        other half (past a span's last block none: that one is computed alone, as k 0)."""
        if has_next:
            store_scales(builder.add(b, one), builder.add(block, stride), 1 - k)
        m_w = builder.fpext(load_at(builder, fields["m"], block, F16, n_rows), vec(acc_t, n_rows))
        quants = []
        for p in range(n_rows // 2):
            packed = load_at(builder, fields["qs"], builder.add(block, ir.Constant(I64, 32 * p)), I8, 32)
            # the high nibbles by a 16-bit shift and a mask: LLVM's byte shift is a GFNI affine here, on
            # the ports the dots and multiply-adds need
            words = builder.lshr(builder.bitcast(packed, vec(I16, 16)), const_vec(I16, [4] * 16))
            quants += [builder.and_(packed, const_vec(I8, [15] * 32)),
                       builder.and_(builder.bitcast(words, vec(I8, 32)), const_vec(I8, [15] * 32))]
        for j, (xq_ptr, _, xds_ptr) in enumerate(x_rows):
            # in a register for the rows' dots (not a memory operand of each: see above)
            xq = opaque(builder, load_at(builder, xq_ptr, builder.mul(b, ir.Constant(I64, 32)), I8, 32))
            for i, w in enumerate(quants):
                quads = quad_dot(builder, w, xq, w_unsigned=True)
                at = ir.Constant(I64, k * per_block + n_rows * j + i)
                scale = splat(builder, builder.load(builder.gep(scales_at, [at])), LANES)
                slot = acc_slots[i, j]
                builder.store(fmuladd(builder, builder.sitofp(quads, vec(acc_t, LANES)), scale, builder.load(slot)),
                              slot)
            ds_x = builder.load(builder.gep(xds_ptr, [b]))
            ds_x = splat(builder, builder.fpext(ds_x, F64) if acc_t is F64 else ds_x, n_rows)
            builder.store(fmuladd(builder, m_w, ds_x, builder.load(summs_slots[j])), summs_slots[j])

    # a span's first block's scales before its loop, each later block's one block ahead
    span.loop_pairs(builder, block_stride, emit_block, start_span=lambda b0, span_at: store_scales(b0, span_at, 0))
    span.save(builder)
    if n_rows == 8 and acc_t is F32:  # every row's hsum_float_8 at once (with loop_pairs, see the docstring)
        totals = [builder.fadd(hsum_float_8_rows(builder, [builder.load(acc_slots[i, j]) for i in range(n_rows)]),
                               builder.load(summs_slots[j])) for j in tokens]
        return [[builder.extract_element(totals[j], ir.Constant(I32, i)) for j in tokens] for i in range(n_rows)]
    return [[builder.fadd(hsum_float_8(builder, builder.load(acc_slots[i, j])),
                          builder.extract_element(builder.load(summs_slots[j]), ir.Constant(I32, i)))
             for j in tokens] for i in range(n_rows)]


def group_fields(builder, fmt: str, group_ptr, i0, pack: int) -> dict:
    """Pointers to row i0's fields in the first block of a group of `pack` rows packed field by field."""
    fields = {}
    for (name, size), at in zip(block_format(fmt).fields, block_format(fmt).field_offsets(pack).values()):
        fields[name] = builder.gep(group_ptr, [builder.add(ir.Constant(I64, at),
                                                           builder.mul(i0, ir.Constant(I64, size)))])
    return fields


def _emit_packed(builder, acc_t: ir.Type, group_ptr, i0, n_rows: int, x_rows, span, fmt: str, pack: int,
                 paired: bool = False, starts: bool = False):
    """The dots of rows i0 .. i0+n_rows-1 of a group of `pack` rows packed field by field (group_ptr:
    the group's first byte) with activation rows (paired: in the layout _emit_pair_dots reads; starts:
    in the one _emit_row_dots' Q8_0 row pairs read)."""
    fields = group_fields(builder, fmt, group_ptr, i0, pack)
    stride = pack * block_format(fmt).block_bytes
    if fmt in INTERLEAVED_NIBBLES and n_rows % 2 == 0:
        assert not paired, "interleaved nibbles meet the activations in value order"
        return _emit_interleaved_dots(builder, fmt, acc_t, fields, n_rows, x_rows, span, stride)
    if fmt in _NIBBLE_PAIRS and n_rows % 2 == 0:
        return _emit_pair_dots(builder, fmt, acc_t, fields, n_rows, x_rows, span, stride, paired)
    assert not paired, "only the nibble formats' pairs of rows read the paired layout"
    sizes = dict(block_format(fmt).fields)
    rows = [{name: builder.gep(ptr, [ir.Constant(I64, sizes[name] * i)]) for name, ptr in fields.items()}
            for i in range(n_rows)]
    return _emit_row_dots(builder, fmt, acc_t, rows, x_rows, span, stride, scales_side_by_side=True, starts=starts)


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
# in float64, tile_..._packed = PACKED_TILE[fmt] rows x tokens. Both per format from measurement (Zen 4,
# 1 core, from DRAM, against 4 rows and 4 x 4 tiles): the formats of two rows per load gain with 8 rows
# and 8 x 2 tiles (8 rows' quants loaded once per 2 tokens; 16 accumulators as 4 x 4): Q4_0 1.05-1.2x at
# 4-128 tokens, IQ4_NL and Q4_1 1.05-1.1x at 8-128 (level at 4); Q8_0, Q5_0 and Q5_1 lose there.
_PAIR_TILE = (8, 2) if X86_32_REGISTERS else TILE  # AVX2's 16 registers: 16 accumulators would spill
# Q4_1 with AVX2 only (Zen 3, 1 core, 3072 x 576, interleaved runs): 4 x 2 tiles 1.15-1.2x faster than
# 2 x 4 at 8 and 64 tokens; Q4_0 and IQ4_NL 1.1-1.2x slower with them (so they keep 2 x 4). With
# WIDE_HALVES (half the accumulators) 8 x 4: Q4_1 1.12-1.15x 8 x 2 at 8 and 128 tokens (Sapphire Rapids)
_Q4_1_TILE = (4, 2) if X86_16_REGISTERS else (8, 4) if WIDE_HALVES else _PAIR_TILE
# Q8_0 with WIDE_Q8_0 (a pair of rows per register, _pair_products): rows packed by 8 and 8 x 4 tiles,
# 1.5x its 4 x 4 tiles at 4-16 tokens, 1.4x at 64 (SmolLM2's 49152 x 576 output matrix, 1 core, Sapphire
# Rapids; 4 x 4, 4 x 6, 4 x 8, 8 x 2 and 8 x 6 with pairs: 1.05-1.25x); Zen 4 1.15-1.3x at 8 and 64 tokens
_Q8_0_PACKING = (8, (8, 4)) if WIDE_Q8_0 else (4, TILE)
_PACKING = {"q4_0": (8, _PAIR_TILE), "q4_1": (8, _Q4_1_TILE), "iq4_nl": (8, _PAIR_TILE),
            "q8_0": _Q8_0_PACKING, "q5_0": (8, TILE), "q5_1": (4, TILE)}
PACK_ROWS = {fmt: rows for fmt, (rows, _) in _PACKING.items()}
PACKED_TILE = {fmt: tile for fmt, (_, tile) in _PACKING.items()}
assert all(rows % tile[0] == 0 for rows, tile in _PACKING.values())
# The tiles of the nibble formats read the activations in the paired layout (PAIRED_TILES), Q8_0's
# 512-bit ones in the starts layout (STARTS_TILES; its tile 5-7% faster, Sapphire Rapids, 1 core)
PAIRED_TILES = tuple(fmt for fmt in _NIBBLE_PAIRS if fmt not in INTERLEAVED_NIBBLES)
# the formats whose packed pairs of rows hold their quants in the order of the lanes they meet, where
# it is not the rows one after the other (activations.PAIR_LANES_ALTERNATE; kernels/packing.py)
PAIR_LANE_ORDER = PAIRED_TILES if PAIR_LANES_ALTERNATE else ()
STARTS_TILES = ("q8_0",) if WIDE_Q8_0 else ()
assert _BIAS["q8_0"] == STARTS_BIAS
assert all(tile[0] % 2 == 0 for fmt, (_, tile) in _PACKING.items() if fmt in PAIRED_TILES)
PACKED = {fmt: packed_intrinsics(partial(_emit_packed, fmt=fmt, pack=rows), fmt, "q8", F32, rows, tile,
                                 block_format(fmt).block_bytes,
                                 emit_tile=partial(_emit_packed, fmt=fmt, pack=rows, paired=fmt in PAIRED_TILES,
                                                   starts=fmt in STARTS_TILES))
          for fmt, (rows, tile) in _PACKING.items()}
# The tiles of the tokens past the last whole tile (as simd_q8k.K_TAIL_TILE): Q4_1's and Q8_0's 8 x 4
# leave 2 or 3 tokens to an 8 x 2 tile (a small batch's decode step); the others have no tail
TAILED = ("q4_1", "q8_0")
PACKED_TAIL_TILE = {fmt: (8, 2) if fmt in TAILED and tile == (8, 4) else tile for fmt, (_, tile) in _PACKING.items()}
PACKED_TAIL = {fmt: PACKED[fmt] if PACKED_TAIL_TILE[fmt] == tile else
               packed_intrinsics(partial(_emit_packed, fmt=fmt, pack=rows), fmt, "q8", F32, rows, PACKED_TAIL_TILE[fmt],
                                 block_format(fmt).block_bytes,
                                 emit_tile=partial(_emit_packed, fmt=fmt, pack=rows, paired=fmt in PAIRED_TILES,
                                                   starts=fmt in STARTS_TILES))
               for fmt, (rows, tile) in _PACKING.items()}
