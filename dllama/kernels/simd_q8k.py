"""Row dots of the K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 values with sub-block scales)
against Q8_K activations, in the order of GGML's AVX2 ggml_vec_dot_<fmt>_q8_K (Q4_K, which llama.cpp
repacks on x86: in the order of its repacked kernels, K_ROWS_IN_LANES). Apart from the
32-block formats (simd_q8.py) because their layout, their activations and their summation differ
throughout; the shared IR pieces are in simd.py, the numpy reference is matmul.py's matmul_ref.

One emitter serves rows as stored and rows packed by 4 or 2 (kernels/packing.py): a group's scales are
vector loads, its 6-bit scales and mins unpacked for all its rows at once (GGML's bit operations on
lanes), and each run's scale is a shuffle of its row's table. The integer lanes are exact whatever
instructions compute them; the float operations are GGML's, per (row, token), in its order.
"""

from __future__ import annotations

from functools import partial

from llvmlite import ir
from numba.core import cgutils

from .simd import (F16, F32, F64, I8, I16, I32, I64, LANES, X86_16_REGISTERS, X86_VNNI, X86_WIDE_RUNS, InLanes,
                   block_intrinsics, concat, const_vec, fmuladd, halves, hsum_float_8, lane_scales, load_at, opaque,
                   packed_intrinsics, pair_products, pair_sums, run_pair_scales, run_pair_scales_wide, run_scales,
                   scale_table, scaled_quad_dot, scaled_quad_dot_pair, scaled_quad_dot_runs, splat, vec)
from .simd_q8 import TILE, block_format, group_fields


# With VNNI two runs' integer lanes take three multiplies (scaled_quad_dot_pair), not four: measured
# (Zen 4, 1 core, 1024 x 2048 from cache) decode strips Q4_K 1.15x, Q6_K 1.08x; prefill tiles Q4_K up
# to 1.05x, Q6_K level
PAIRED_RUNS = X86_VNNI and not X86_WIDE_RUNS
# With AVX-512's 512-bit registers two runs side by side in each (scaled_quad_dot_runs): two multiplies for
# two runs where PAIRED_RUNS takes three on 256-bit registers, and no shuffle of the products. Measured
# (Sapphire Rapids, 1 core, 128 tokens, 2048 x 2048 to 8192 x 2048, interleaved runs) against PAIRED_RUNS:
# prefill tiles Q4_K 1.12-1.14x, Q5_K 1.20x, Q6_K 1.30-1.36x; one token level to 1.15x (Q6_K)
WIDE_RUNS = X86_WIDE_RUNS
# AVX2's 16 registers, several tokens: the runs as a loop (_looped_runs), not written out. Written out,
# LLVM's scheduler computed each pair's 8 runs in a row and spilled what the pairs share: ~220 stack
# loads and stores per super-block of a 2 x 4 tile. Measured (Zen 3, 1 core, 4096 x 2048, 8, 64 and 128
# tokens, best of 4 processes each, old and new alternated): Q4_K 1.2-1.4x, Q5_K 1.1-1.2x, Q6_K 1.06-1.13x
RUN_LOOP = X86_16_REGISTERS
assert not (RUN_LOOP and (PAIRED_RUNS or WIDE_RUNS))  # the loop takes one run at a time
# The K-quants llama.cpp repacks on x86 (Q4_K: ggml_gemv_q4_K_8x8_q8_K and its gemm), summed in the
# order of those kernels, which it takes by default there: per (row, token) one float for the scaled
# quants and one for the mins, to which each super-block adds its exact integer total (the sub-block
# scales' dots; the mins' dots with the 32-sums) times d_w * d_x (dmin_w * d_x) in one fused multiply-
# add; the row's dot is the first less the second.
K_ROWS_IN_LANES = ("q4_k",)

# GGML's get_scale_min_k4 on the 12 bytes as uint32 words s0, s1, s2, per row in 4 lanes:
# scales 0-3 = s0 & 0x3f.., scales 4-7 = (s2 & 0x0f..) | ((s0 >> 6) & 0x03..) << 4,
# mins 0-3 = s1 & 0x3f.., mins 4-7 = ((s2 >> 4) & 0x0f..) | ((s1 >> 6) & 0x03..) << 4:
# lane = ((A >> shift) & mask) | ((B >> 6) & high) << 4 with A, B these words of the row
_K4_A, _K4_B = (0, 2, 1, 2), (0, 0, 0, 1)
_K4_SHIFT, _K4_MASK, _K4_HIGH = (0, 0, 0, 4), (0x3F3F3F3F, 0x0F0F0F0F) * 2, (0, 0x03030303) * 2


def _scale_tables(builder, fmt: str, fields: dict, block, n_rows: int):
    """Each of n_rows rows' scale_table (packed field by field: their scales side by side): Q4_K /
    Q5_K its 8 sub-block scales then its 8 mins (unsigned), Q6_K its 16 int8 scales."""
    if fmt == "q6_k":  # per row: one 16-byte load and one widening
        return [scale_table(builder, load_at(builder, fields["scales"], builder.add(block, ir.Constant(I64, 16 * i)),
                                             I8, 16), signed=True) for i in range(n_rows)]
    else:
        words = load_at(builder, fields["scales"], block, I32, 3 * n_rows)

        def per_row(lanes):
            index = [3 * i + k for i in range(n_rows) for k in lanes]
            return builder.shuffle_vector(words, words, const_vec(I32, index))

        def rep(values):
            return const_vec(I32, list(values) * n_rows)

        low = builder.and_(builder.lshr(per_row(_K4_A), rep(_K4_SHIFT)), rep(_K4_MASK))
        high = builder.shl(builder.and_(builder.lshr(per_row(_K4_B), rep([6] * 4)), rep(_K4_HIGH)), rep([4] * 4))
        table = scale_table(builder, builder.bitcast(builder.or_(low, high), vec(I8, 16 * n_rows)), signed=False)
    return [builder.shuffle_vector(table, table, const_vec(I32, range(16 * i, 16 * i + 16))) for i in range(n_rows)]


def _run(builder, fmt: str, fields: dict, block, i: int, k: int):
    """Run k (values 32k .. 32k+31) of row i's super-block at byte `block` past its group's field
    pointers: (unsigned quants <32 x i8>, the run's entries in the scale table (lanes 0-3, 4-7)).
    Runs share loads (LLVM keeps one of each)."""
    sizes = dict(block_format(fmt).fields)

    def load(name, offset):
        return load_at(builder, fields[name], builder.add(block, ir.Constant(I64, sizes[name] * i + offset)), I8, 32)

    def splat8(v):
        return const_vec(I8, [v] * 32)

    if fmt in ("q4_k", "q5_k"):  # 64 values per 32 bytes: low nibbles = sub-block 2j, high = 2j+1
        packed = load("qs", 32 * (k // 2))
        nibbles = builder.and_(packed, splat8(15)) if k % 2 == 0 else builder.lshr(packed, splat8(4))
        if fmt == "q5_k":  # bit k of byte b: value b's fifth bit
            bit = builder.and_(builder.lshr(load("qh", 0), splat8(k)), splat8(1))
            nibbles = builder.or_(nibbles, builder.shl(bit, splat8(4)))
        return nibbles, (k, k)
    # q6_k: per 128 values (j), runs of 32 from the low nibbles of ql's 64 bytes, then the high
    # nibbles, and 2 more bits from qh; two 16-value sub-blocks (scales) each
    j, m = divmod(k, 4)
    low = load("ql", 64 * j + 32 * (m % 2))
    low = builder.and_(low, splat8(15)) if m < 2 else builder.lshr(low, splat8(4))
    top = builder.and_(builder.lshr(load("qh", 32 * j), splat8(2 * m)), splat8(3))
    return builder.or_(low, builder.shl(top, splat8(4))), (2 * k, 2 * k + 1)


def _looped_run(builder, fmt: str, fields: dict, block, i: int, p, half: int, k):
    """_run's quants for _looped_runs, where the run is an IR value: runs come two to a 32-byte load
    of nibbles, `half` 0 (the low nibbles) or 1 (the high), and p (IR i64, the loop's index) numbers
    the load; k (IR) is that run's number (_run_number). The shifts that depend on p are of 16-bit
    lanes (one x86 instruction; LLVM makes a byte shift by a variable of several)."""
    sizes = dict(block_format(fmt).fields)

    def load(name, offset):
        return load_at(builder, fields[name], builder.add(block, builder.add(_i64(sizes[name] * i), offset)), I8, 32)

    def splat8(v):
        return const_vec(I8, [v] * 32)

    def nibbles(packed):
        return builder.and_(packed, splat8(15)) if half == 0 else builder.lshr(packed, splat8(4))

    def bits_down(v, amount):  # bytes shifted right as 16-bit lanes: exact in the bits below 8 - amount
        lanes = builder.bitcast(v, vec(I16, 16))
        return builder.bitcast(builder.lshr(lanes, splat(builder, builder.trunc(amount, I16), 16)), vec(I8, 32))

    if fmt in ("q4_k", "q5_k"):  # 64 values per 32 bytes: low nibbles = run 2p, high = 2p+1
        quants = nibbles(load("qs", builder.mul(p, _i64(32))))
        if fmt == "q5_k":  # bit k of byte b: value b's fifth bit
            bit = builder.and_(bits_down(load("qh", _i64(0)), k), splat8(1))
            quants = builder.or_(quants, builder.shl(bit, splat8(4)))
        return quants
    # q6_k (as in _run): load p = 2j + h is ql's bytes 64j + 32h, runs 4j + h (low nibbles) and
    # 4j + h + 2 (high nibbles), whose top bits are qh's (bytes 32j) bits 2h and 2h + 4
    j, h = builder.lshr(p, _i64(1)), builder.and_(p, _i64(1))
    low = nibbles(load("ql", builder.add(builder.mul(j, _i64(64)), builder.mul(h, _i64(32)))))
    top_at = builder.add(builder.mul(h, _i64(2)), _i64(4 * half))
    top = builder.and_(bits_down(load("qh", builder.mul(j, _i64(32))), top_at), splat8(3))
    return builder.or_(low, builder.shl(top, splat8(4)))


def _run_number(builder, fmt: str, p, half: int):
    """The run (0-7: values 32k .. 32k+31) that _looped_run(p, half) gives, as IR."""
    if fmt in ("q4_k", "q5_k"):
        return builder.add(builder.mul(p, _i64(2)), _i64(half))
    j, h = builder.lshr(p, _i64(1)), builder.and_(p, _i64(1))
    return builder.add(builder.add(builder.mul(j, _i64(4)), h), _i64(2 * half))


def _i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def _unrolled_runs(builder, fmt: str, groups, rows, block, tables, x_at) -> dict:
    """The integer lanes (sumi) of every (row, token) pair over the super-block's 8 runs, written out
    in order. Several tokens: run by run (one run's quants and scale per row live at a time, shared
    by the tokens; row by row they spill: Q6_K's 2 x 4 tile 1.3x slower); one token: row by row
    (run by run 1.3x slower). x_at: per token, the pointer to its values and the byte of the
    super-block."""
    width = 2 * LANES if WIDE_RUNS else LANES  # WIDE_RUNS: run k + 1's lanes beside run k's, summed at the end
    sumi = {(r, j): ir.Constant(vec(I32, width), [0] * width) for r in range(len(rows)) for j in range(len(x_at))}
    step = 2 if PAIRED_RUNS or WIDE_RUNS else 1  # runs k, k+1 together
    order = [(k, r) for k in range(0, 8, step) for r in range(len(rows))] if len(x_at) > 1 \
        else [(k, r) for r in range(len(rows)) for k in range(0, 8, step)]

    def activations(j: int, k: int, runs: int = 1):  # token j's of runs k .. k + runs - 1 (LLVM loads each once)
        xq_ptr, xq_at = x_at[j]
        return load_at(builder, xq_ptr, builder.add(xq_at, _i64(32 * k)), I8, 32 * runs)

    for k, r in order:
        g, i = rows[r]
        quants, runs = _run(builder, fmt, groups[g][0], block, i, k)
        if WIDE_RUNS:
            quants_b, runs_b = _run(builder, fmt, groups[g][0], block, i, k + 1)
            scales = run_pair_scales_wide(builder, tables[g][i], runs, runs_b)
            both = concat(builder, quants, quants_b)
            for j in range(len(x_at)):
                sumi[r, j] = scaled_quad_dot_runs(builder, both, activations(j, k, 2), scales, sumi[r, j])
        elif PAIRED_RUNS:
            quants_b, runs_b = _run(builder, fmt, groups[g][0], block, i, k + 1)
            scales = run_pair_scales(builder, tables[g][i], runs, runs_b)
            for j in range(len(x_at)):
                sumi[r, j] = scaled_quad_dot_pair(builder, quants, activations(j, k), quants_b,
                                                  activations(j, k + 1), scales, sumi[r, j])
        else:
            scales = run_scales(builder, tables[g][i], *runs)
            for j in range(len(x_at)):
                sumi[r, j] = scaled_quad_dot(builder, quants, activations(j, k), scales, sumi[r, j])
    if WIDE_RUNS:
        sumi = {pair: builder.add(*halves(builder, v)) for pair, v in sumi.items()}
    return sumi


def _looped_runs(builder, fmt: str, groups, rows, block, tables, x_at) -> dict:
    """_unrolled_runs' sumi (AVX2, several tokens, no VNNI), as a loop of 4 iterations of the 2 runs
    of one load (_looped_run), which LLVM keeps a loop: its 8 sumi stay in registers, and each run's
    quants and scales are made once for the tokens. Each row's scale table is stored once per
    super-block, and a run's scales loaded from it. x_at: per token, the pointer to its values and
    the byte of the super-block."""
    sumi_slots = {}
    for r in range(len(rows)):
        for j in range(len(x_at)):
            sumi_slots[r, j] = cgutils.alloca_once_value(builder, ir.Constant(vec(I32, LANES), [0] * LANES))
    table_at = []
    for g, i in rows:
        slot = cgutils.alloca_once_value(builder, tables[g][i])
        table_at.append(builder.bitcast(slot, tables[g][i].type.element.as_pointer()))
    with cgutils.for_range(builder, opaque(builder, _i64(4))) as loop:  # (a count LLVM cannot see: kept a loop)
        p = loop.index
        for half in (0, 1):
            k = _run_number(builder, fmt, p, half)
            if fmt == "q6_k":  # as _run's (low, high) entries
                first = builder.mul(k, _i64(2))
                entries = (first, builder.add(first, _i64(1)))
            else:
                entries = (k, k)
            per_row = []
            for r, (g, i) in enumerate(rows):
                low, high = (builder.load(builder.gep(table_at[r], [e])) for e in entries)
                per_row.append((_looped_run(builder, fmt, groups[g][0], block, i, p, half, k),
                                lane_scales(builder, low, high)))
            for j, (xq_ptr, xq_at) in enumerate(x_at):
                x = load_at(builder, xq_ptr, builder.add(xq_at, builder.mul(k, _i64(32))), I8, 32)
                for r, (quants, scales) in enumerate(per_row):
                    slot = sumi_slots[r, j]
                    builder.store(scaled_quad_dot(builder, quants, x, scales, builder.load(slot)), slot)
    return {pair: builder.load(slot) for pair, slot in sumi_slots.items()}


def _emit_k_dots(builder, fmt: str, acc_t: ir.Type, groups, x_rows, span, block_stride: int):
    """IR of the dot of every weight row with every Q8_K activation row (x_rows: pointers to its
    values, scales, 16-sums) -> totals[row][token], rows in `groups` of (pointers to the first row's
    fields, number of rows packed field by field; 1: a row as stored), blocks block_stride apart.
    The order of GGML's AVX2 ggml_vec_dot_<fmt>_q8_K: per super-block, 8 integer lanes (lane k:
    values 4k..4k+3 of every 32, times their sub-block scales) turned to floats and fused-multiply-
    added with the super-block scale into 8 float lanes; Q4_K's mins meet the activations' 32-sums
    in 4 more lanes, Q5_K's in one float. Q4_K instead in the order of llama.cpp's repacked kernels
    (K_ROWS_IN_LANES). Each pair has its own accumulators, added to as when it is alone (batch
    invariance)."""
    wide = acc_t is F64
    rows = [(g, i) for g, (_, n) in enumerate(groups) for i in range(n)]
    pairs = [(r, j) for r in range(len(rows)) for j in range(len(x_rows))]
    slots = {}
    in_lanes = fmt in K_ROWS_IN_LANES
    if in_lanes:  # the scaled quants' totals, and the mins' (two pairs' 4 lanes to a vector)
        dots = InLanes([[pair] * LANES for pair in pairs], acc_t, span, builder)
        twos = [pairs[k:k + 2] + [None] * (k + 2 - len(pairs)) for k in range(0, len(pairs), 2)]
        mins_in_lanes = InLanes([[a] * 4 + [b] * 4 for a, b in twos], acc_t, span, builder)
    for pair in pairs if not in_lanes else ():
        init = [("acc", ir.Constant(vec(acc_t, LANES), [0.0] * LANES))]
        init += {"q4_k": [("mins", ir.Constant(vec(acc_t, 4), [0.0] * 4))],
                 "q5_k": [("summs", ir.Constant(acc_t, 0.0))]}.get(fmt, [])
        for name, zero in init:
            slots[pair, name] = span.accumulator(builder, zero)

    def accumulate(pair, name, scale, value):
        slot = slots[pair, name]
        builder.store(fmuladd(builder, scale, value, builder.load(slot)), slot)

    def widen(v):  # f16 scalars or vectors -> the products' type
        elem = F64 if wide else F32
        return builder.fpext(v, vec(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem)

    with span.loop(builder, block_stride) as (b, block):
        d_w = [widen(load_at(builder, fields["d"], block, F16, n)) for fields, n in groups]
        dmin_w = [widen(load_at(builder, fields["dmin"], block, F16, n)) for fields, n in groups] \
            if fmt != "q6_k" else None
        tables = [_scale_tables(builder, fmt, fields, block, n) for fields, n in groups]
        per_token, x_at = [], []
        for xq_ptr, xd_ptr, xs_ptr in x_rows:
            x_d = builder.load(builder.gep(xd_ptr, [b]))
            x_at.append((xq_ptr, builder.mul(b, ir.Constant(I64, 256))))
            sums = builder.load(builder.bitcast(builder.gep(xs_ptr, [builder.mul(b, ir.Constant(I64, 16))]),
                                                vec(I32, 16).as_pointer()), align=4)  # the 16-sums (int8 x 16: i16)
            # Q4_K/Q5_K: the 32-sums, which meet the mins; Q6_K: the 16-sums, which meet the scales
            sums = pair_sums(builder, sums) if fmt != "q6_k" else sums
            sums = builder.trunc(sums, vec(I16, sums.type.count))
            # every row's d_w * d_x (and -d_x * dmin_w) in one multiply per group, exact: the same bits
            x_d_wide = widen(x_d) if wide else x_d
            d = [builder.fmul(v, splat(builder, x_d_wide, v.type.count)) for v in d_w]
            dmin = [builder.fmul(splat(builder, builder.fneg(x_d_wide), v.type.count), v) for v in dmin_w] \
                if dmin_w is not None else None
            per_token.append((sums, d, dmin))
        # The integer lanes of every pair, then each pair's float operations
        if RUN_LOOP and len(x_rows) > 1:
            sumi = _looped_runs(builder, fmt, groups, rows, block, tables, x_at)
        else:
            sumi = _unrolled_runs(builder, fmt, groups, rows, block, tables, x_at)
        min_dots = {}
        for r, (g, i) in enumerate(rows):
            table = tables[g][i]
            for j, (sums, d, dmin) in enumerate(per_token):
                pair = (r, j)
                if fmt in ("q4_k", "q5_k"):
                    # mins: lane m = min[2m] * S[2m] + min[2m+1] * S[2m+1], S[i] the 32-sum of sub-block i
                    mins = builder.shuffle_vector(table, table, const_vec(I32, range(8, 16)))
                    prod = pair_products(builder, mins, sums)
                    dmin_i = builder.extract_element(dmin[g], ir.Constant(I32, i))
                    if in_lanes:
                        min_dots[pair] = prod
                        continue
                    if fmt == "q4_k":
                        accumulate(pair, "mins", splat(builder, dmin_i, 4), builder.sitofp(prod, vec(acc_t, 4)))
                    else:  # Q5_K adds the four lanes as integers, then one float per super-block
                        lanes = [builder.extract_element(prod, ir.Constant(I32, m)) for m in range(4)]
                        whole = builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3]))
                        accumulate(pair, "summs", dmin_i, builder.sitofp(whole, acc_t))
                else:  # the values are stored + 32: lane l takes back 32 * (S16[2l] sc[2l] + S16[2l+1] sc[2l+1])
                    offset = pair_products(builder, table, sums)
                    sumi[pair] = builder.sub(sumi[pair], builder.shl(offset, const_vec(I32, [5] * LANES)))
                d_i = builder.extract_element(d[g], ir.Constant(I32, i))
                accumulate(pair, "acc", splat(builder, d_i, LANES), builder.sitofp(sumi[pair], vec(acc_t, LANES)))
        if in_lanes:
            # the scales' products as llama.cpp's (d_w * d_x rounded to f32), the mins' negated (an
            # exact negation of the same product): their sum is its difference of the two floats
            d_rows = [builder.extract_element(d_w[g], ir.Constant(I32, i)) for g, i in rows]
            dmin_rows = [builder.extract_element(dmin_w[g], ir.Constant(I32, i)) for g, i in rows]
            x_ds = [builder.load(builder.gep(xd_ptr, [b])) for _, xd_ptr, _ in x_rows]
            x_ds = [widen(x_d) if wide else x_d for x_d in x_ds]
            dots.add(builder, [sumi[pair] for pair in pairs], d_rows, x_ds)
            zero = ir.Constant(vec(I32, 4), [0] * 4)
            min_vectors = [concat(builder, min_dots[a], zero if b is None else min_dots[b]) for a, b in twos]
            mins_in_lanes.add(builder, min_vectors, dmin_rows, [builder.fneg(x_d) for x_d in x_ds])
    span.save(builder)
    if in_lanes:
        totals = dots.totals(builder, len(rows), len(x_rows))
        minus = mins_in_lanes.totals(builder, len(rows), len(x_rows))
        return [[builder.fadd(total, less) for total, less in zip(*row)] for row in zip(totals, minus)]
    totals = [[None] * len(x_rows) for _ in rows]
    for r, j in pairs:
        total = hsum_float_8(builder, builder.load(slots[(r, j), "acc"]))
        if fmt == "q4_k":  # (m0 + m2) + (m1 + m3), as GGML's movehl / movehdup
            m = builder.load(slots[(r, j), "mins"])
            el = [builder.extract_element(m, ir.Constant(I32, k)) for k in range(4)]
            total = builder.fadd(total, builder.fadd(builder.fadd(el[0], el[2]), builder.fadd(el[1], el[3])))
        if fmt == "q5_k":
            total = builder.fadd(total, builder.load(slots[(r, j), "summs"]))
        totals[r][j] = total
    return totals


def _emit_stored(builder, fmt: str, acc_t: ir.Type, w_ptrs, x_rows, span):
    """The dots of rows in the file's layout (each its own group of one)."""
    offsets = block_format(fmt).field_offsets()
    groups = [({name: builder.gep(builder.bitcast(w_ptr, I8.as_pointer()), [ir.Constant(I64, at)])
                for name, at in offsets.items()}, 1) for w_ptr in w_ptrs]
    return _emit_k_dots(builder, fmt, acc_t, groups, x_rows, span, block_format(fmt).block_bytes)


def _emit_packed(builder, acc_t: ir.Type, group_ptr, i0, n_rows: int, x_rows, span, fmt: str, pack: int):
    """The dots of rows i0 .. i0+n_rows-1 of a group of `pack` rows packed field by field."""
    groups = [(group_fields(builder, fmt, group_ptr, i0, pack), n_rows)]
    return _emit_k_dots(builder, fmt, acc_t, groups, x_rows, span, pack * block_format(fmt).block_bytes)


# dot(w, r, xq, xd, xs, t): row r of weight w (uint8, K-quant fmt) against Q8_K activation row t (xq
# int8 values, xd f32 scale of each 256, xs int32 sum of each 16 values), in GGML's order
# (_emit_k_dots). _wide: float64 lanes. tile: TILE_ROWS x TILE_TOKENS of them at once.
dot_q4_k_q8k, dot_q4_k_q8k_wide, tile_q4_k_q8k = block_intrinsics(_emit_stored, "q4_k", "q8k", I32, TILE)
dot_q5_k_q8k, dot_q5_k_q8k_wide, tile_q5_k_q8k = block_intrinsics(_emit_stored, "q5_k", "q8k", I32, TILE)
dot_q6_k_q8k, dot_q6_k_q8k_wide, tile_q6_k_q8k = block_intrinsics(_emit_stored, "q6_k", "q8k", I32, TILE)

# The same over rows packed by K_PACK_ROWS (kernels/packing.py): strip = K_PACK_ROWS rows x 1 token,
# tile = K_PACKED_TILE rows x tokens. From measurement (Zen 4, 1 core, from DRAM), one token against the
# rows as stored: Q4_K by 4 rows 1.15-1.4x (by 8 faster on 2048 columns, slower on 8192, as Q4_0's 8-row
# groups are too; by 2 slower), Q6_K by 2 1.0-1.25x (by 4 or 8 2x slower: spilled registers); prefill
# tiles (run by run, see _emit_k_dots) against the stored rows' 4 x 4: Q4_K 4 x 4 and Q6_K 2 x 4 1.05-1.1x
# (4 x 2, 4 x 6, 4 x 8, 2 x 8 no better).
# With WIDE_RUNS (Sapphire Rapids, 128 tokens): Q4_K's 4 x 6 tile 1.10-1.15x its 4 x 4 (4 x 8, 2 x 8 and
# 8 x 4 slower than 4 x 6; 8 and 16 tokens 0.96-0.98x, the tokens past the last whole tile taken one by
# one); Q5_K 4 x 6 level with 4 x 4; Q6_K 2 x 4 still best (4 x 4, 2 x 6, 2 x 8 0.8-0.95x)
K_PACK_ROWS = {"q4_k": 4, "q5_k": 4, "q6_k": 2}
K_PACKED_TILE = {"q4_k": (4, 6) if WIDE_RUNS else TILE, "q5_k": TILE, "q6_k": (2, TILE[1])}
assert all(rows % K_PACKED_TILE[fmt][0] == 0 for fmt, rows in K_PACK_ROWS.items())
PACKED_K = {fmt: packed_intrinsics(partial(_emit_packed, fmt=fmt, pack=rows), fmt, "q8k", I32, rows, K_PACKED_TILE[fmt],
                                   block_format(fmt).block_bytes)
            for fmt, rows in K_PACK_ROWS.items()}
# The tiles of the tokens past the last whole tile: where a tile is wider than TILE's 4 tokens (Q4_K's
# 6), TILE, so that 4 and 5 tokens (a small batch's decode step) still share each weight block
# (Q4_K's strips alone: ~0.65x its 4 x 4 tiles at 4 tokens); else the tile itself (no tail)
K_TAIL_TILE = {fmt: TILE if tile[1] > TILE[1] else tile for fmt, tile in K_PACKED_TILE.items()}
PACKED_K_TAIL = {fmt: PACKED_K[fmt] if K_TAIL_TILE[fmt] == K_PACKED_TILE[fmt] else
                 packed_intrinsics(partial(_emit_packed, fmt=fmt, pack=rows), fmt, "q8k", I32, rows, K_TAIL_TILE[fmt],
                                   block_format(fmt).block_bytes)
                 for fmt, rows in K_PACK_ROWS.items()}
assert all(K_TAIL_TILE[fmt] == K_PACKED_TILE[fmt] for fmt in ("q5_k", "q6_k"))  # (matmul.py's tails: Q4_K's)
