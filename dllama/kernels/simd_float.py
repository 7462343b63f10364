"""Float intrinsics that round as GGML does: the f16 / f32 vector dots of llama.cpp's one-token
path (ggml_vec_dot_f16 / _f32: F16 and F32 weights, attention), its 8-lane sum (the softmax), and
scalar operations numba does not expose (fma with one rounding, float bit casts, f16 rounding)
that exp, RoPE and GELU need. Built on the IR pieces of simd.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (CACHE_LINE, F16, F32, I8, I16, I32, I64, LANES, X86_32_REGISTERS, const_vec, data_ptr, fmuladd,
                   hsum_float_8, load_at, prefetch, round_to_f16, row_ptr, vec)


def _ggml_vec_dot(elem: ir.Type):
    """The codegen of GGML's ggml_vec_dot_f16 / ggml_vec_dot_f32 order (see dot_f16_f16_vec)."""
    size = 2 if elem is F16 else 4

    def codegen(context, builder, signature, args):
        a_arr, a_off, b_arr, b_off, count = args
        a_ptr = builder.gep(data_ptr(context, builder, signature.args[0], a_arr), [a_off])
        b_ptr = builder.gep(data_ptr(context, builder, signature.args[2], b_arr), [b_off])
        zero = ir.Constant(vec(F32, LANES), [0.0] * LANES)
        slots = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        for slot in slots:
            builder.store(zero, slot)

        def load(ptr, offset):
            if elem is F32:
                return load_at(builder, ptr, offset, F32, LANES)
            return builder.fpext(builder.bitcast(load_at(builder, ptr, offset, I16, LANES), vec(F16, LANES)),
                                 vec(F32, LANES))

        n_steps = builder.sdiv(count, ir.Constant(count.type, 4 * LANES))
        with cgutils.for_range(builder, n_steps) as loop:
            base = builder.mul(loop.index, ir.Constant(I64, size * 4 * LANES))
            for j, slot in enumerate(slots):
                offset = builder.add(base, ir.Constant(I64, size * LANES * j))
                builder.store(fmuladd(builder, load(a_ptr, offset), load(b_ptr, offset), builder.load(slot)), slot)
        return _ggml_reduce(builder, [builder.load(slot) for slot in slots])

    return codegen


def _ggml_reduce(builder, accumulators):
    """GGML_F32_VEC_REDUCE of four 8-lane accumulators: (s0+s2)+(s1+s3), then t_k = s_k + s_k+4,
    then (t0+t1)+(t2+t3)."""
    s0, s1, s2, s3 = accumulators
    return _ggml_reduce_8(builder, builder.fadd(builder.fadd(s0, s2), builder.fadd(s1, s3)))


def _ggml_reduce_pairs(builder, s01, s23):
    """_ggml_reduce of the accumulators side by side in pairs, s01 = (s0, s1) and s23 = (s2, s3),
    16 lanes each: s01 + s23 is (s0+s2, s1+s3), then its halves' sum (s0+s2)+(s1+s3), the same
    operations on each lane."""
    both = builder.fadd(s01, s23)
    low, high = (builder.shuffle_vector(both, both, const_vec(I32, range(h * LANES, (h + 1) * LANES))) for h in (0, 1))
    return _ggml_reduce_8(builder, builder.fadd(low, high))


def _ggml_reduce_pairs_4(builder, pairs):
    """_ggml_reduce_pairs of four dots at once -> <4 x float>, lane i dot i's sum: each step of
    GGML's tree (the pairs' sum, its halves' sum, t_k = x_k + x_k+4, (t0+t1)+(t2+t3)) as one vector
    operation on the four, lanes gathered by shuffles; the same additions of the same values. A
    decode strip's dots are short (a key: two steps of 32), so one dot's reduction alone (scalar
    extracts and adds) cost more than its multiply-adds."""
    both = [builder.fadd(s01, s23) for s01, s23 in pairs]  # 16 lanes: s0+s2, then s1+s3

    def halves_sum(a, b):  # (x_a | x_b), x = (s0+s2) + (s1+s3)
        low = builder.shuffle_vector(a, b, const_vec(I32, [*range(LANES), *range(2 * LANES, 3 * LANES)]))
        high = builder.shuffle_vector(a, b, const_vec(I32, [*range(LANES, 2 * LANES), *range(3 * LANES, 4 * LANES)]))
        return builder.fadd(low, high)

    x01, x23 = halves_sum(both[0], both[1]), halves_sum(both[2], both[3])
    # t_k = x_k + x_k+4 of each dot: four lanes per dot
    firsts = [i + 4 * h for h in range(8) for i in range(4) if h % 2 == 0]
    lasts = [i + 4 * h for h in range(8) for i in range(4) if h % 2 == 1]
    t = builder.fadd(builder.shuffle_vector(x01, x23, const_vec(I32, firsts)),
                     builder.shuffle_vector(x01, x23, const_vec(I32, lasts)))
    # (t0+t1)+(t2+t3): lanes 4i + (0, 2) hold t0+t1 and t2+t3 (t1+t0: the same sum), then lane 4i
    u = builder.fadd(t, builder.shuffle_vector(t, t, const_vec(I32, [4 * (i // 4) + (i % 4 ^ 1) for i in range(16)])))
    v = builder.fadd(u, builder.shuffle_vector(u, u, const_vec(I32, [4 * (i // 4) + (i % 4 ^ 2) for i in range(16)])))
    return builder.shuffle_vector(v, v, const_vec(I32, [0, 4, 8, 12]))


def _ggml_reduce_8(builder, x):
    """The end of GGML_F32_VEC_REDUCE, once its four accumulators are one x: t_k = x_k + x_k+4,
    then (t0+t1)+(t2+t3)."""
    t = builder.fadd(builder.shuffle_vector(x, x, const_vec(I32, [0, 1, 2, 3])),
                     builder.shuffle_vector(x, x, const_vec(I32, [4, 5, 6, 7])))
    el = [builder.extract_element(t, ir.Constant(I32, i)) for i in range(4)]
    return builder.fadd(builder.fadd(el[0], el[1]), builder.fadd(el[2], el[3]))


# A prefill tile: 2 rows x 2 tokens (16 accumulators, four per pair), each weight vector converted
# once for the tokens and each activation vector loaded once for the rows. Measured (2048 x 2048, 60
# tokens, 1 core): 1.4-1.9x faster than 1 row x 4 tokens, with AVX-512 and with AVX2 codegen; 2 x 3
# and 4 x 2 no better, 2 x 4 slower (spilled)
F16_TILE_ROWS, F16_TILE_TOKENS = 2, 2
# A decode strip: F16_STRIP_ROWS weight rows against one token, four 8-lane accumulators per row (16
# registers' worth with AVX-512's 32; AVX2 and NEON have 16 and 32 of half the width: 2 rows). Each
# activation vector is loaded once for the rows, and the rows are as many streams from DRAM.
F16_STRIP_ROWS = 4 if X86_32_REGISTERS else 2


def _f16_tile(n_rows: int, n_tokens: int, in_tiles: bool = False, prefetch_next: bool | None = None):
    """Codegen of an f16 weight tile (n_rows rows `step` apart x n_tokens tokens, float32
    activations that are f16s, exactly converted): each pair in dot_f16_f16_vec's order (its own
    four accumulators), each weight vector converted once for the tokens, each activation vector
    loaded once for the rows. in_tiles: w's rows are 32 values, and a row's next 32 are `run` rows
    further on (the KV cache's values, tiles of 32 positions: see attention.py). prefetch_next:
    prefetch the rows the caller's next tile reads (default: for one token, a decode strip)."""
    def codegen(context, builder, signature, args):
        if in_tiles:
            w_arr, row, step, run, x_arr, tok, count, out = args
            run = context.cast(builder, run, signature.args[3], types.intp)
            ty = signature.args[:3] + signature.args[4:]
        else:
            w_arr, row, step, x_arr, tok, count, out = args
            ty = signature.args
        row = context.cast(builder, row, ty[1], types.intp)
        step = context.cast(builder, step, ty[2], types.intp)
        tok = context.cast(builder, tok, ty[4], types.intp)
        # bytes from one step of 32 values of a row to its next
        step_bytes = builder.mul(run, builder.extract_value(context.make_array(ty[0])(context, builder, w_arr).strides,
                                                            0)) if in_tiles else ir.Constant(I64, 4 * LANES * 2)
        rows = [builder.add(row, builder.mul(step, ir.Constant(I64, i))) for i in range(n_rows)]
        w_ptrs = [row_ptr(context, builder, ty[0], w_arr, r) for r in rows]
        x_ptrs = [row_ptr(context, builder, ty[3], x_arr, builder.add(tok, ir.Constant(I64, j)))
                  for j in range(n_tokens)]
        # GGML's four 8-lane accumulators as two pairs side by side (s0, s1) and (s2, s3): each weight
        # conversion and multiply-add serves two of them (one 512-bit instruction with AVX-512), each
        # lane with the operations of its own (_ggml_reduce_pairs). On Sapphire Rapids (1 core): the
        # attention's key and value dots ~9% faster, SmolLM2's F16 FFN matrices at 8-32 tokens 1.1-1.2x
        zero = ir.Constant(vec(F32, 2 * LANES), [0.0] * 2 * LANES)
        slots = [[[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in x_ptrs] for _ in w_ptrs]
        for slot in (s for row_slots in slots for token_slots in row_slots for s in token_slots):
            builder.store(zero, slot)
        # A decode strip asks for the rows its caller's next strip reads, at the offset it reads:
        # adjacent rows (step 1: the attention's keys, one stream, and its transposed values, rows far
        # apart, each a short stream) go on with the n_rows after them, rows `step` apart (_mm_f16's
        # quarters of a matrix) each with the row after it
        next_rows = builder.select(builder.icmp_signed("==", step, ir.Constant(I64, 1)), ir.Constant(I64, n_rows),
                                   ir.Constant(I64, 1))
        ahead = [builder.bitcast(row_ptr(context, builder, ty[0], w_arr, builder.add(r, next_rows)), I8.as_pointer())
                 for r in rows] if (n_tokens == 1 if prefetch_next is None else prefetch_next) else []
        n_steps = builder.sdiv(context.cast(builder, count, ty[5], types.intp), ir.Constant(I64, 4 * LANES))
        with cgutils.for_range(builder, n_steps) as loop:
            at = builder.mul(loop.index, step_bytes)  # the step's first weight byte, from the row's
            for pointer in ahead:
                for line in range(0, 4 * LANES * 2, CACHE_LINE):
                    prefetch(builder, builder.gep(pointer, [builder.add(at, ir.Constant(I64, line))]))
            for k in range(2):  # values 16k .. 16k+15 of the step: accumulators 2k and 2k+1
                value = builder.add(builder.mul(loop.index, ir.Constant(I64, 4 * LANES)),
                                    ir.Constant(I64, 2 * LANES * k))
                xs = [load_at(builder, x_ptr, builder.mul(value, ir.Constant(I64, 4)), F32, 2 * LANES)
                      for x_ptr in x_ptrs]
                for w_ptr, row_slots in zip(w_ptrs, slots):
                    w16 = load_at(builder, w_ptr, builder.add(at, ir.Constant(I64, 4 * LANES * k)), I16, 2 * LANES)
                    w = builder.fpext(builder.bitcast(w16, vec(F16, 2 * LANES)), vec(F32, 2 * LANES))
                    for x, token_slots in zip(xs, row_slots):
                        builder.store(fmuladd(builder, w, x, builder.load(token_slots[k])), token_slots[k])
        dots = [(r, j, token_slots) for r, row_slots in zip(rows, slots) for j, token_slots in enumerate(row_slots)]
        sums = []
        for g in range(0, len(dots) - len(dots) % 4, 4):  # four dots' reductions at once, then any left alone
            four = _ggml_reduce_pairs_4(builder, [[builder.load(slot) for slot in d[2]] for d in dots[g:g + 4]])
            sums += [builder.extract_element(four, ir.Constant(I32, i)) for i in range(4)]
        sums += [_ggml_reduce_pairs(builder, *(builder.load(slot) for slot in d[2])) for d in dots[len(sums):]]
        for (r, j, _), total in zip(dots, sums):
            out_row = builder.bitcast(row_ptr(context, builder, ty[6], out, builder.add(tok, ir.Constant(I64, j))),
                                      F32.as_pointer())
            builder.store(total, builder.gep(out_row, [r]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def tile_f16_f32(typingctx, w, r, step, x, t, n, out):
    """out[t + j, r + i * step] = the sum of the first n (a multiple of 32) products of row r + i *
    step of w (f16 bits, each row contiguous) with row t + j of x (float32 values that are f16s,
    exactly converted), for i < F16_TILE_ROWS, j < F16_TILE_TOKENS: bit for bit dot_f16_f16_vec of
    each pair (prefill: each weight vector converted once for the tokens)."""
    return types.void(w, r, step, x, t, n, out), _f16_tile(F16_TILE_ROWS, F16_TILE_TOKENS)


@intrinsic
def strip_f16_f32(typingctx, w, r, step, x, t, n, out):
    """The same for rows r + i * step (i < F16_STRIP_ROWS) against token t (decode)."""
    return types.void(w, r, step, x, t, n, out), _f16_tile(F16_STRIP_ROWS, 1)


# The attention's dots: the query heads that share a KV head (GQA), up to GROUP_QUERIES at a time,
# against its keys, and their softmax weights against its values, each key or value vector converted
# once for all of them (strips of F16_STRIP_ROWS rows x g queries: 24 accumulators and 4 vectors at
# g = 3 in AVX-512's 32 registers; elsewhere a strip holds one query, as the strips above).
GROUP_QUERIES = 3 if X86_32_REGISTERS else 1


def _f16_group_tile(n_rows: int, in_tiles: bool):
    """Codegen of _f16_tile(n_rows, g, in_tiles) for g (1..GROUP_QUERIES) given at run time, as the
    argument after t: a branch per g."""
    bodies = [_f16_tile(n_rows, g, in_tiles, prefetch_next=True) for g in range(1, GROUP_QUERIES + 1)]
    at = 6 if in_tiles else 5  # g's place among the arguments

    def codegen(context, builder, signature, args):
        g = context.cast(builder, args[at], signature.args[at], types.intp)
        rest = signature.replace(args=signature.args[:at] + signature.args[at + 1:])
        for n_tokens, body in enumerate(bodies, 1):
            with builder.if_then(builder.icmp_signed("==", g, ir.Constant(I64, n_tokens))):
                body(context, builder, rest, args[:at] + args[at + 1:])
        return context.get_dummy_value()

    return codegen


@intrinsic
def keys_f16_f32(typingctx, w, r, step, x, t, g, n, out):
    """strip_f16_f32 against tokens t..t+g-1 (g <= GROUP_QUERIES): out[t + j, r + i * step] for
    i < F16_STRIP_ROWS, j < g, each key converted once for the g queries."""
    return types.void(w, r, step, x, t, g, n, out), _f16_group_tile(F16_STRIP_ROWS, False)


@intrinsic
def key_f16_f32(typingctx, w, r, step, x, t, g, n, out):
    """The same for row r alone."""
    return types.void(w, r, step, x, t, g, n, out), _f16_group_tile(1, False)


@intrinsic
def values_f16_f32(typingctx, w, r, step, run, x, t, g, n, out):
    """keys_f16_f32 of rows whose values come 32 at a time, `run` rows of w apart (in_tiles)."""
    return types.void(w, r, step, run, x, t, g, n, out), _f16_group_tile(F16_STRIP_ROWS, True)


@intrinsic
def value_f16_f32(typingctx, w, r, step, run, x, t, g, n, out):
    """The same for row r alone."""
    return types.void(w, r, step, run, x, t, g, n, out), _f16_group_tile(1, True)


@intrinsic
def dot_f16_f16_vec(typingctx, a, a_offset, b, b_offset, n):
    """sum(a[a_offset:+n] * b[b_offset:+n]) of two f16 vectors (uint16 arrays of f16 bits), in
    the order of GGML's ggml_vec_dot_f16, which llama.cpp uses when the other operand is a single
    vector (one token), products and sums in f32: four 8-lane accumulators over steps of 32
    elements, summed (s0+s2)+(s1+s3), then t_k = s_k + s_k+4, then (t0+t1)+(t2+t3).
    n must be a multiple of 32 (the caller adds any tail)."""
    return types.float32(a, a_offset, b, b_offset, n), _ggml_vec_dot(F16)


@intrinsic
def dot_f32_f32_vec(typingctx, a, a_offset, b, b_offset, n):
    """The same for two float32 vectors, in the order of GGML's ggml_vec_dot_f32 (the same
    accumulators and reduction). n must be a multiple of 32."""
    return types.float32(a, a_offset, b, b_offset, n), _ggml_vec_dot(F32)


@intrinsic
def hsum8(typingctx, x, offset):
    """GGML's 8-lane horizontal sum of x[offset:offset+8] (float32)."""
    sig = types.float32(x, offset)

    def codegen(context, builder, signature, args):
        ptr = builder.gep(data_ptr(context, builder, signature.args[0], args[0]), [args[1]])
        return hsum_float_8(builder, load_at(builder, ptr, ir.Constant(I64, 0), F32, LANES))

    return sig, codegen


def _fused_multiply_add(name: str, float_type):
    def typer(typingctx, a, b, c):
        def codegen(context, builder, signature, args):
            return fmuladd(builder, *args)

        return float_type(float_type, float_type, float_type), codegen

    typer.__name__ = name
    return intrinsic(typer)


# a*b + c with one rounding where the CPU has FMA
fma = _fused_multiply_add("fma", types.float32)
fma64 = _fused_multiply_add("fma64", types.float64)


def _scalar_op(name: str, source, target, build):
    """An intrinsic of one scalar: `build(builder, value)` emits the IR (a bit cast, an f16 rounding)."""
    def typer(typingctx, x):
        def codegen(context, builder, signature, args):
            return build(builder, args[0])

        return target(source), codegen

    typer.__name__ = name
    return intrinsic(typer)


# bit casts (no conversion), and the bits of the f16 nearest to x (ties to even)
f32_bits = _scalar_op("f32_bits", types.float32, types.int32, lambda b, x: b.bitcast(x, I32))
f32_from_bits = _scalar_op("f32_from_bits", types.int32, types.float32, lambda b, x: b.bitcast(x, F32))
f64_bits = _scalar_op("f64_bits", types.float64, types.int64, lambda b, x: b.bitcast(x, I64))
f64_from_bits = _scalar_op("f64_from_bits", types.int64, types.float64, lambda b, x: b.bitcast(x, ir.DoubleType()))
f16_bits = _scalar_op("f16_bits", types.float32, types.uint16, lambda b, x: b.bitcast(b.fptrunc(x, F16), I16))
# x rounded to the nearest f16 (ties to even), as a float32: numpy's x.astype(float16).astype(float32)
f16_round = _scalar_op("f16_round", types.float32, types.float32, round_to_f16)


@intrinsic
def f16_at(typingctx, a, offset):
    """The f16 value (as float32) at element `offset` from the start of a's data (uint16 array of
    f16 bits): addressed like dot_f16_f16_vec, so it reaches a strided 2-D array's rows too."""
    sig = types.float32(a, offset)

    def codegen(context, builder, signature, args):
        ptr = data_ptr(context, builder, signature.args[0], args[0])
        byte_offset = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), ir.Constant(I64, 2))
        return builder.fpext(load_at(builder, ptr, byte_offset, F16), F32)

    return sig, codegen
