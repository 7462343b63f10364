"""The pieces every LLVM-vector-IR row dot shares (simd_q8.py, simd_q8k.py, simd_float.py hold the dots).

Two reasons to spell the dots out as IR through numba intrinsics instead of writing numba loops:
- Speed: numba types integer arithmetic at machine width (int64), so a loop over int8 quants
  compiles to scalar code. Vector IR (<32 x i8> loads, widening multiplies) lowers to AVX2 on
  x86 and NEON on a Raspberry Pi.
- Fidelity: the float accumulation order is GGML's (8 lanes summed as
  ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)) at the end; for the formats llama.cpp repacks on x86, its
  repacked kernels' order: LaneSums and InLanes below; both in words:
  docs/kernels.md#summation-order). Rounding differences of one ulp get amplified through a deep network
  when they flip an activation's 8-bit rounding; keeping the same order keeps our logits on top
  of llama.cpp's on x86.

Here: IR types, loads, GGML's fused multiply-add and 8-lane sum, the operands of a row dot or a
prefill tile and the builder of a format's intrinsics, and the only instructions chosen per CPU
(the integer quad dots: AVX2, AVX512-VNNI, NEON with or without sdot; IQ4_NL's table lookup;
Q5's fifth bits), so that the dots themselves read the same on x86, AArch64 and elsewhere. Every
dot has a plain-numpy reference in `matmul.py` / `ops.py` / `attention.py`, and tests check them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from ..quant import IQ4_NL_VALUES

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
LANES = 8
_ZERO = ir.Constant(I64, 0)
# accumulator elements a packed strip or tile may carry per row and token from one span of blocks to
# the next (Span): at most 9 for the 32-value formats, 12 for the K-quants
CARRIED_PER_ROW = 16


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def const_vec(elem: ir.Type, values) -> ir.Constant:
    return ir.Constant(vec(elem, len(values)), list(values))


def data_ptr(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, value=array).data


def load_at(builder, base_ptr, byte_offset, elem: ir.Type, n: int | None = None):
    """Unaligned load of one `elem` (or n of them as a vector) at base_ptr + byte_offset bytes."""
    raw = builder.gep(builder.bitcast(base_ptr, I8.as_pointer()), [byte_offset])
    target = elem if n is None else vec(elem, n)
    return builder.load(builder.bitcast(raw, target.as_pointer()), align=1)


def _intrinsic_fn(builder, name: str, ret: ir.Type, args: list[ir.Type]):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def call_llvm(builder, name: str, ret: ir.Type, *values):
    """A call of LLVM's own intrinsic `name` (llvm.rint.v32f32, llvm.vector.reduce.add.v32i32 ...)."""
    return builder.call(_intrinsic_fn(builder, name, ret, [v.type for v in values]), list(values))


def round_to_f16(builder, x):
    """float32 x rounded to the nearest f16 (ties to even), as a float32 again."""
    return builder.fpext(builder.fptrunc(x, F16), F32)


def fmuladd(builder, a, b, c):
    """a*b + c, fused where the CPU has FMA (as GGML's AVX2 path), separately where it has not."""
    elem = a.type.element if isinstance(a.type, ir.VectorType) else a.type
    name = "f64" if isinstance(elem, ir.DoubleType) else "f32"
    suffix = f"v{a.type.count}{name}" if isinstance(a.type, ir.VectorType) else name
    return builder.call(_intrinsic_fn(builder, f"llvm.fmuladd.{suffix}", a.type, [a.type] * 3), [a, b, c])


def splat(builder, scalar, n: int):
    v = builder.insert_element(ir.Constant(vec(scalar.type, n), None), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, const_vec(I32, [0] * n))


def concat(builder, first, second):
    """Two vectors of one type side by side: <n x T>, <n x T> -> <2n x T>."""
    return builder.shuffle_vector(first, second, const_vec(I32, range(2 * first.type.count)))


def halves(builder, v) -> tuple:
    """concat's inverse: <2n x T> -> its first and its second <n x T>."""
    n = v.type.count // 2
    return tuple(builder.shuffle_vector(v, v, const_vec(I32, range(h, h + n))) for h in (0, n))


def opaque(builder, v):
    """v, with LLVM unable to see what it is. A splat kept opaque stays a vector, so that a product
    of two splats is one vector multiply rather than (LLVM's choice) a scalar multiply and a
    broadcast, one more instruction in a prefill tile's inner loop; a constant kept opaque (a loop's
    count) is not unrolled; loads through an opaque pointer are not forwarded from a store through
    the original (they stay loads, which x86 folds into an instruction's broadcast). No code: an
    empty asm; for vectors on x86 only (AArch64's constraint takes one 128-bit register, not an
    8-lane vector: as LLVM likes it there)."""
    if isinstance(v.type, ir.VectorType):
        if not _X86_AVX2:
            return v
        return builder.asm(ir.FunctionType(v.type, [v.type]), "", "=x,0", [v], side_effect=False)
    return builder.asm(ir.FunctionType(v.type, [v.type]), "", "=r,0", [v], side_effect=False)


def hsum_float_8(builder, acc):
    """GGML's hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    half = builder.fadd(builder.shuffle_vector(acc, acc, const_vec(I32, [0, 1, 2, 3])),
                        builder.shuffle_vector(acc, acc, const_vec(I32, [4, 5, 6, 7])))
    quarter = builder.fadd(builder.shuffle_vector(half, half, const_vec(I32, [0, 1])),
                           builder.shuffle_vector(half, half, const_vec(I32, [2, 3])))
    return builder.fadd(builder.extract_element(quarter, ir.Constant(I32, 0)),
                        builder.extract_element(quarter, ir.Constant(I32, 1)))


def hsum_float_8_rows(builder, accs: list):
    """hsum_float_8 of 8 vectors at once: lane i of the result is accs[i]'s, by the same additions in
    the same tree, in 7 adds and 14 shuffles of 8 lanes, not 8 x (3 adds and 4 shuffles)."""
    assert len(accs) == 8
    accs = [accs[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]  # (so that the lanes come out in order)
    # a_i + a_(i+4) for i < 4, two vectors at a time: [a's 4 | b's 4]
    return _hsum_from_halves(builder, [_pairwise(builder, accs[k], accs[k + 1], [0, 1, 2, 3, 8, 9, 10, 11],
                                                 [4, 5, 6, 7, 12, 13, 14, 15]) for k in range(0, 8, 2)])


def hsum_float_8_halved(builder, halved: list):
    """hsum_float_8 of 2n rows (n = len(halved): 1, 2 or 4) whose first additions are made:
    halved[k] holds row k's a_i + a_(i+4) (i < 4) in lanes 0-3 and row k+n's in lanes 4-7 -> a
    vector of 2n lanes, lane i row i's total, by hsum_float_8's additions (a register of two rows'
    halves, added, gives this for both at once)."""
    if len(halved) == 4:
        return _hsum_from_halves(builder, halved)
    assert len(halved) in (1, 2)
    a, b = halved[0], halved[-1]
    if len(halved) == 2:  # (s0 + s2, s1 + s3) of each: [row 0's 2, row 1's 2 | row 2's 2, row 3's 2]
        quarters = _pairwise(builder, a, b, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
        return _pairwise(builder, quarters, quarters, [0, 2, 4, 6], [1, 3, 5, 7])
    quarters = _pairwise(builder, a, a, [0, 1, 4, 5], [2, 3, 6, 7])  # [row 0's 2 | row 1's 2]
    return _pairwise(builder, quarters, quarters, [0, 2], [1, 3])


def _pairwise(builder, a, b, first, second):
    return builder.fadd(builder.shuffle_vector(a, b, const_vec(I32, first)),
                        builder.shuffle_vector(a, b, const_vec(I32, second)))


def _hsum_from_halves(builder, halves_: list):
    """hsum_float_8_rows past its first additions: halves_[k] = [row k's 4 | row k+4's 4]."""
    # (s0 + s2, s1 + s3) of each: [a's 2, c's 2 | b's 2, d's 2]
    quarters = [_pairwise(builder, halves_[k], halves_[k + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
                for k in (0, 2)]
    return _pairwise(builder, quarters[0], quarters[1], [0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15])


# Two ways of summing lanes of <8 x i32> vectors pairwise, as shuffle masks (first, second) into the
# concatenation of two vectors: lane k of the result is lane first[k] plus lane second[k]
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # each vector's halves (cross-lane)
_ADJACENT = ([0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15])  # neighbours (x86: a vphaddd)
_TWO_APART = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])  # (alternating rows; x86: vshufps)


class LaneSums:
    """The integer totals of labelled lanes: vectors of <8 x i32> whose lanes each hold part of one
    (row, token) pair's block dot (`labels`: per vector, each lane's pair), summed by pairs of
    shuffles and an add until each lane of the result holds one pair's whole total (exact, in any
    order): for the formats whose rows keep their sums in lanes of their own (simd_q8.ROWS_IN_LANES).
    The plan is worked out on the labels once; `labels` then lists the results' lanes (None: empty)."""

    def __init__(self, labels: list[list]):
        self.levels = []
        items = [list(lanes) for lanes in labels]
        while any(self._duplicated(lanes) for lanes in items):
            step = next((step for step in (_HALVES, _ADJACENT, _TWO_APART) if self._merges(items, step)), None)
            assert step is not None, f"lanes that no pairwise sum can merge: {items}"
            if len(items) % 2:
                items.append([None] * LANES)
            self.levels.append((step, len(items)))
            items = [[self._merge(x[i], x[j]) for i, j in zip(*step)]
                     for x in (a + b for a, b in zip(items[::2], items[1::2]))]
        self.labels = items

    @staticmethod
    def _duplicated(lanes) -> bool:
        named = [label for label in lanes if label is not None]
        return len(set(named)) < len(named)

    @staticmethod
    def _merge(a, b):
        assert a is None or b is None or a == b
        return b if a is None else a

    @staticmethod
    def _merges(items, step) -> bool:
        """Whether `step` sums only lanes of one pair (or an empty one), at least one such sum."""
        pairs = [(x[i], x[j]) for lanes in items for x in (lanes + [None] * LANES,) for i, j in zip(*step)]
        return all(a is None or b is None or a == b for a, b in pairs) and any(a is not None and a == b
                                                                                 for a, b in pairs)

    def emit(self, builder, vectors: list) -> list:
        """The result vectors (lanes as `labels`) of the input vectors (lanes as given)."""
        zero = ir.Constant(vec(I32, LANES), [0] * LANES)
        vectors = list(vectors)
        for (first, second), count in self.levels:
            vectors += [zero] * (count - len(vectors))
            vectors = [builder.add(builder.shuffle_vector(a, b, const_vec(I32, first)),
                                   builder.shuffle_vector(a, b, const_vec(I32, second)))
                       for a, b in zip(vectors[::2], vectors[1::2])]
        return vectors


def gather_lanes(builder, values, lanes: list):
    """A vector whose lane k is values[lanes[k]] (values: a vector, or a list of scalars; a lane of
    None takes the first value)."""
    if isinstance(values, list):
        if len(values) == 1:
            return splat(builder, values[0], len(lanes))
        v = ir.Constant(vec(values[0].type, len(values)), None)
        for k, value in enumerate(values):
            v = builder.insert_element(v, value, ir.Constant(I32, k))
        values = v
    return builder.shuffle_vector(values, values, const_vec(I32, [0 if i is None else i for i in lanes]))


class InLanes:
    """The float side of the formats summed in the order of llama.cpp's repacked kernels
    (simd_q8.ROWS_IN_LANES, simd_q8k.K_ROWS_IN_LANES): accumulators whose lanes are (row, token)
    pairs, each lane one pair's float, to which each block adds its integer dot (LaneSums) times
    d_w * d_x in one fused multiply-add."""

    def __init__(self, labels: list[list], acc_t: ir.Type, span, builder):
        """labels: per vector of a block's integer dots, each lane's (row, token)."""
        self.sums, self.acc_t = LaneSums(labels), acc_t
        zero = ir.Constant(vec(acc_t, LANES), [0.0] * LANES)
        self.slots = [span.accumulator(builder, zero) for _ in self.sums.labels]

    def add(self, builder, block_dots: list, d_rows, d_tokens: list):
        """One block: its integer dots (<8 x i32>, lanes as labelled), the rows' scales d_w (a
        vector, or a scalar per row) and the tokens' d_x (a scalar per token): their product in
        their type (as llama.cpp's, in f32), widened to the accumulators'."""
        for slot, dots, lanes in zip(self.slots, self.sums.emit(builder, block_dots), self.sums.labels):
            scale = builder.fmul(gather_lanes(builder, d_rows, [None if at is None else at[0] for at in lanes]),
                                 gather_lanes(builder, d_tokens, [None if at is None else at[1] for at in lanes]))
            if scale.type.element != self.acc_t:
                scale = builder.fpext(scale, vec(self.acc_t, LANES))
            acc_v = vec(self.acc_t, LANES)
            builder.store(fmuladd(builder, builder.sitofp(dots, acc_v), scale, builder.load(slot)), slot)

    def totals(self, builder, n_rows: int, n_tokens: int) -> list:
        """totals[row][token] (after the loop)."""
        totals = [[None] * n_tokens for _ in range(n_rows)]
        for slot, lanes in zip(self.slots, self.sums.labels):
            acc = builder.load(slot)
            for k, at in enumerate(lanes):
                if at is not None:
                    totals[at[0]][at[1]] = builder.extract_element(acc, ir.Constant(I32, k))
        return totals


# the features numba compiles for: the host's, or NUMBA_CPU_FEATURES (as when the kernels are checked
# for a Pi 5 under emulation)
_HOST_FEATURES = set((numba_config.CPU_FEATURES if numba_config.CPU_FEATURES is not None
                      else get_host_cpu_features()).split(","))
_X86_AVX2 = "+avx2" in _HOST_FEATURES
# DLLAMA_AVX2_ONLY: on a CPU with AVX-512, write what an AVX2-only CPU runs (no VNNI, the smaller
# tile), so that a test here checks that path gives the same bits
_X86_AVX512 = _X86_AVX2 and "+avx512vl" in _HOST_FEATURES and "DLLAMA_AVX2_ONLY" not in os.environ
# AVX512-VNNI's vpdpbusd (on 256-bit registers with AVX512-VL) is maddubs + madd in one instruction,
# without maddubs' 16-bit saturation, and adds into an accumulator: llama.cpp uses it where present.
# The integer sums are the same either way.
X86_VNNI = _X86_AVX512 and "+avx512vnni" in _HOST_FEATURES
# AVX-512 with VNNI and BW: two 256-bit quad dots side by side in one 512-bit vpdpbusd (quad_dot on
# 64 bytes), as Q8_0's row pairs use them on every such CPU (simd_q8.WIDE_Q8_0)
X86_WIDE_DOTS = X86_VNNI and "+avx512bw" in _HOST_FEATURES
# ... and the K-quants' quad dots two runs at a time (scaled_quad_dot_runs), Q4_1's and Q5's halves
# (simd_q8.WIDE_HALVES): measured on Intel (Sapphire Rapids). AMD's Zen 4 runs each 512-bit multiply
# as two 256-bit ones, and there they lose (EPYC Zen 4, 1 core, at 8 tokens: Q4_K 1.1-1.2x slower,
# Q6_K 1.03-1.05x, Q4_1 1.06x), so AMD keeps the 256-bit path for them
_CPU_NAME = numba_config.CPU_NAME if numba_config.CPU_NAME not in (None, "host") else llvm_binding.get_host_cpu_name()
X86_WIDE_RUNS = X86_WIDE_DOTS and not _CPU_NAME.startswith("znver")
# GFNI (Intel since Ice Lake, beside the wide runs): gf2p8affineqb applies an 8 x 8 bit matrix to every
# byte, a matrix per 64-bit lane: wide_nibbles splits 32 bytes into both nibbles' 64 in one instruction
X86_GFNI = X86_WIDE_RUNS and "+gfni" in _HOST_FEATURES
# Without VNNI an x86 quad dot is maddubs + madd, unsigned x signed: signed weights cost two psigns more
X86_MADDUBS = _X86_AVX2 and not X86_VNNI
# AVX-512 gives 32 vector registers (16 with AVX2): room for a prefill tile of 16 accumulators
X86_32_REGISTERS = _X86_AVX512
X86_16_REGISTERS = _X86_AVX2 and not _X86_AVX512  # (AVX2 without AVX-512: tiles chosen for it)
_AARCH64 = llvm_binding.get_process_triple().startswith(("aarch64", "arm64"))
# ARMv8.2's dot product (sdot: four int8 products summed into each i32 lane, one instruction), which a
# Pi 5's Cortex-A76 has and a Pi 4's A72 has not; DLLAMA_NO_DOTPROD takes the widening multiplies
AARCH64_DOTPROD = _AARCH64 and "+dotprod" in _HOST_FEATURES and "DLLAMA_NO_DOTPROD" not in os.environ
IQ4_NL_LEVELS = tuple(int(v) for v in IQ4_NL_VALUES)


def iq4_nl_values(builder, nibbles, biased: bool = False):
    """<16 x i8> indices 0..15 -> IQ4_NL's non-linear values (biased: plus 128, as unsigned bytes):
    one table lookup instruction (x86 pshufb, AArch64 tbl), or a select per entry elsewhere."""
    levels = [(v + 128) & 255 if biased else v for v in IQ4_NL_LEVELS]
    levels = [v - 256 if v > 127 else v for v in levels]  # as i8 constants
    table = const_vec(I8, levels)
    if _X86_AVX2:
        pshufb = _intrinsic_fn(builder, "llvm.x86.ssse3.pshuf.b.128", vec(I8, 16), [vec(I8, 16)] * 2)
        return builder.call(pshufb, [table, nibbles])
    if _AARCH64:
        tbl = _intrinsic_fn(builder, "llvm.aarch64.neon.tbl1.v16i8", vec(I8, 16), [vec(I8, 16)] * 2)
        return builder.call(tbl, [table, nibbles])
    out = const_vec(I8, [levels[0]] * 16)
    for k, value in enumerate(levels[1:], start=1):
        out = builder.select(builder.icmp_unsigned("==", nibbles, const_vec(I8, [k] * 16)),
                             const_vec(I8, [value] * 16), out)
    return out


def bits_to_bytes(builder, words, bit_of_lane, if_set: int, if_clear: int = 0):
    """<32 x i8> whose byte j is `if_set` where bit bit_of_lane[j] of `words` (<k x i32>; word i's
    bits are bits 32i .. 32i+31) is set, else `if_clear`: Q5's fifth bits, lanes taking 16-bit runs.
    AVX-512 turns a <32 x i1> mask into bytes in one instruction; elsewhere LLVM lowers that mask
    poorly in the dots (Q5_0 and Q5_1 were 7x slower than here on AVX2; 72 instructions against 28
    on AArch64), so each byte takes its bit's byte of the words (one byte shuffle) and tests its
    own bit in it, as GGML's bytes_from_bits_32."""
    if _X86_AVX512:
        runs = [bit_of_lane[16 * r] // 16 for r in (0, 1)]
        assert all(bit_of_lane[16 * r + i] == 16 * run + i for r, run in enumerate(runs) for i in range(16))
        halves = builder.bitcast(words, vec(I16, 2 * words.type.count))
        mask = builder.bitcast(builder.shuffle_vector(halves, halves, const_vec(I32, runs)), vec(ir.IntType(1), 32))
    else:
        word_bytes = builder.bitcast(words, vec(I8, 4 * words.type.count))
        spread = builder.shuffle_vector(word_bytes, word_bytes, const_vec(I32, [b // 8 for b in bit_of_lane]))
        bits = const_vec(I8, [1 << (b % 8) if b % 8 < 7 else -128 for b in bit_of_lane])
        mask = builder.icmp_unsigned("!=", builder.and_(spread, bits), const_vec(I8, [0] * 32))
    return builder.select(mask, const_vec(I8, [if_set] * 32), const_vec(I8, [if_clear] * 32))


# gf2p8affineqb's matrices (a 64-bit lane's bytes in memory order): byte 7 - i selects the bits whose
# parity is bit i of the result. The low nibble kept, and the high nibble moved down.
_LOW_NIBBLE_MATRIX = [0, 0, 0, 0, 8, 4, 2, 1]
_HIGH_NIBBLE_MATRIX = [0, 0, 0, 0, 128, 64, 32, 16]


def wide_nibbles(builder, packed):
    """(X86_GFNI) <32 x i8> -> <64 x i8>: its low nibbles, then its high nibbles (each 0-15), in one
    instruction on the 32 bytes loaded twice (a load-port broadcast), where and, shift and insert
    are three on the ports the dots and conversions need."""
    assert X86_GFNI
    matrix = const_vec(I8, _LOW_NIBBLE_MATRIX * 4 + _HIGH_NIBBLE_MATRIX * 4)
    return call_llvm(builder, "llvm.x86.vgf2p8affineqb.512", vec(I8, 64), concat(builder, packed, packed), matrix,
                     ir.Constant(I8, 0))


def quad_dot(builder, w_i8, x_i8, w_unsigned: bool, acc=None):
    """<32 x i8> weights . <32 x i8> activations (+ <8 x i32> acc) -> <8 x i32>, lane k = sum of
    products 4k..4k+3. Integer sums are exact in any order; on AVX2 this is GGML's maddubs + madd
    pair, with AVX512-VNNI one vpdpbusd, on AArch64 with the dot product two sdot. With
    X86_WIDE_DOTS, unsigned weights: two such dots side by side (<64 x i8> -> <16 x i32>), one
    512-bit vpdpbusd."""
    if w_i8.type.count == 64:  # (X86_WIDE_DOTS) two 32-byte dots side by side: <16 x i32>
        assert X86_WIDE_DOTS and w_unsigned
        v16 = vec(I32, 16)
        dpbusd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16] * 3)
        start = acc if acc is not None else ir.Constant(v16, [0] * 16)
        return builder.call(dpbusd, [start, builder.bitcast(w_i8, v16), builder.bitcast(x_i8, v16)])
    if _X86_AVX2:
        if not w_unsigned:  # maddubs and vpdpbusd want unsigned x signed: move the sign onto the activations
            psign = _intrinsic_fn(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), [vec(I8, 32)] * 2)
            w_i8, x_i8 = builder.call(psign, [w_i8, w_i8]), builder.call(psign, [x_i8, w_i8])
        if X86_VNNI:
            dpbusd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), [vec(I32, 8)] * 3)
            start = acc if acc is not None else ir.Constant(vec(I32, 8), [0] * 8)
            return builder.call(dpbusd, [start, builder.bitcast(w_i8, vec(I32, 8)), builder.bitcast(x_i8, vec(I32, 8))])
        maddubs = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32)] * 2)
        madd = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16)] * 2)
        pairs = builder.call(maddubs, [w_i8, x_i8])
        quads = builder.call(madd, [pairs, const_vec(I16, [1] * 16)])
    elif AARCH64_DOTPROD:  # the weights read as unsigned here are below 128 (4-6 bit quants): signed too
        sdot = _intrinsic_fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", vec(I32, 4),
                             [vec(I32, 4), vec(I8, 16), vec(I8, 16)])
        start = acc if acc is not None else ir.Constant(vec(I32, 8), [0] * 8)
        halves = [builder.call(sdot, [builder.shuffle_vector(start, start, const_vec(I32, range(4 * h, 4 * h + 4))),
                                      builder.shuffle_vector(w_i8, w_i8, const_vec(I32, range(16 * h, 16 * h + 16))),
                                      builder.shuffle_vector(x_i8, x_i8, const_vec(I32, range(16 * h, 16 * h + 16)))])
                  for h in (0, 1)]
        return builder.shuffle_vector(halves[0], halves[1], const_vec(I32, range(8)))
    else:
        extend = builder.zext if w_unsigned else builder.sext
        p = builder.sext(builder.mul(extend(w_i8, vec(I16, 32)), builder.sext(x_i8, vec(I16, 32))), vec(I32, 32))
        parts = [builder.shuffle_vector(p, p, const_vec(I32, range(j, 32, 4))) for j in range(4)]
        quads = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    return quads if acc is None else builder.add(acc, quads)


def lane_scales(builder, low, high=None):
    """The i32 scales of a scaled quad dot's 8 lanes (lanes 0-3 `low`, 4-7 `high`, default `low`) in
    the form scaled_quad_dot takes here: on x86 16 i16 (madd's i16 lanes 2k, 2k+1 feed i32 lane k).
    low and high are integers, truncated to that lane type unless they are of it (scale_table's)."""
    elem, n = (I16, 16) if _X86_AVX2 else (I32, LANES)
    low_v = splat(builder, builder.trunc(low, elem) if low.type != elem else low, n)
    if high is None:
        return low_v
    high_v = splat(builder, builder.trunc(high, elem) if high.type != elem else high, n)
    return builder.shuffle_vector(low_v, high_v, const_vec(I32, list(range(n // 2)) + list(range(n, n + n // 2))))


def scale_table(builder, values_i8, signed: bool):
    """Sub-block scales (<n x i8>) widened to the lanes lane_scales gives (x86: i16, else i32), for
    run_scales to pick from: one widening for every run of a block."""
    widen = builder.sext if signed else builder.zext
    return widen(values_i8, vec(I16 if _X86_AVX2 else I32, values_i8.type.count))


def run_scales(builder, table, low: int, high: int | None = None):
    """lane_scales of entries `low` (lanes 0-3) and `high` (4-7, default `low`) of a scale_table: a
    shuffle (AVX-512: one vpermw) instead of a scalar load and broadcast per run."""
    half = (16 if _X86_AVX2 else LANES) // 2
    return builder.shuffle_vector(table, table, const_vec(I32, [low] * half + [low if high is None else high] * half))


def pair_products(builder, a, b):
    """<2n x iK>, <2n x iK> -> <n x i32>: lane k = a[2k] b[2k] + a[2k+1] b[2k+1] (signed; x86's pmaddwd
    when both are 16-bit values)."""
    wide = vec(I32, a.type.count)
    return pair_sums(builder, builder.mul(builder.sext(a, wide) if a.type.element != I32 else a,
                                          builder.sext(b, wide) if b.type.element != I32 else b))


def scaled_quad_dot(builder, w_u8, x_i8, scales, acc):
    """acc + <8 x i32> whose lane k is scale_k * (sum of products 4k..4k+3) of unsigned weights and
    signed activations (`scales` from lane_scales): GGML's maddubs + madd by the scales on AVX2, the
    madd fused into the accumulation (vpdpwssd) with VNNI. Exact integers in any case."""
    if _X86_AVX2:
        maddubs = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32)] * 2)
        pairs = builder.bitcast(builder.call(maddubs, [w_u8, x_i8]), vec(I32, 8))
        if X86_VNNI:
            dpwssd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpwssd.256", vec(I32, 8), [vec(I32, 8)] * 3)
            return builder.call(dpwssd, [acc, pairs, builder.bitcast(scales, vec(I32, 8))])
        madd = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16)] * 2)
        return builder.add(acc, builder.call(madd, [builder.bitcast(pairs, vec(I16, 16)), scales]))
    return builder.add(acc, builder.mul(quad_dot(builder, w_u8, x_i8, w_unsigned=True), scales))


def run_pair_scales(builder, table, a: tuple[int, int], b: tuple[int, int]):
    """For scaled_quad_dot_pair (VNNI): i16 lanes 2k, 2k+1 = the scales of runs a and b in lane k,
    each run's (lanes 0-3, lanes 4-7) entries of a scale_table: one shuffle for two runs."""
    return builder.shuffle_vector(table, table, const_vec(I32, [a[0], b[0]] * 4 + [a[1], b[1]] * 4))


def scaled_quad_dot_pair(builder, w_a, x_a, w_b, x_b, scales, acc):
    """scaled_quad_dot of two runs (a, b) into acc, with VNNI: each run's quad dots by one vpdpbusd
    (unsigned weights below 64 and activations of magnitude at most 127: every lane fits 16 bits),
    their lanes interleaved as i16 pairs and multiplied by the runs' scales (run_pair_scales) and
    added in one vpdpwssd: three multiplies for two runs where maddubs + vpdpwssd take four. The
    same integers in every lane."""
    quads = [builder.bitcast(quad_dot(builder, w, x, w_unsigned=True), vec(I16, 16))
             for w, x in ((w_a, x_a), (w_b, x_b))]
    lows = [i for k in range(8) for i in (2 * k, 16 + 2 * k)]  # each i32 lane's low half, a's then b's
    interleaved = builder.shuffle_vector(quads[0], quads[1], const_vec(I32, lows))
    dpwssd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpwssd.256", vec(I32, 8), [vec(I32, 8)] * 3)
    return builder.call(dpwssd, [acc, builder.bitcast(interleaved, vec(I32, 8)), builder.bitcast(scales, vec(I32, 8))])


def run_pair_scales_wide(builder, table, a: tuple[int, int], b: tuple[int, int]):
    """For scaled_quad_dot_runs: i32 lane k of 16 = as i16 pair (scale, 0), the scale of run a (lanes
    0-7) or b (lanes 8-15), each run's (first 4 lanes, last 4) entries of a scale_table (x86: i16)."""
    zero = table.type.count  # an entry of the zero vector beside the table
    entries = [a[0]] * 4 + [a[1]] * 4 + [b[0]] * 4 + [b[1]] * 4
    zeros = ir.Constant(table.type, [0] * table.type.count)
    return builder.shuffle_vector(table, zeros, const_vec(I32, [i for e in entries for i in (e, zero)]))


def scaled_quad_dot_runs(builder, w_runs, x_runs, scales, acc):
    """acc (<16 x i32>) + the scaled quad dots of two runs side by side (w_runs, x_runs: <64 x i8>, run
    a's 32 bytes then run b's; unsigned weights below 64, activations of magnitude at most 127): one
    512-bit vpdpbusd gives run a's 8 quad dots in lanes 0-7 and b's in 8-15, each within 16 bits, and
    one vpdpwssd multiplies each by its scale (run_pair_scales_wide: the pair (scale, 0), so a lane's
    upper half, its sign, is multiplied by 0) and adds it. Lane k + 8 holds run b's part of the
    scaled_quad_dot lane k of run a: the two halves summed give its integers exactly."""
    v16 = vec(I32, 16)
    quads = quad_dot(builder, w_runs, x_runs, w_unsigned=True)
    dpwssd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpwssd.512", v16, [v16] * 3)
    return builder.call(dpwssd, [acc, quads, builder.bitcast(scales, v16)])


def pair_sums(builder, v):
    """<2n x i32> -> <n x i32>: lane k = v[2k] + v[2k+1]."""
    n = v.type.count // 2
    return builder.add(builder.shuffle_vector(v, v, const_vec(I32, range(0, 2 * n, 2))),
                       builder.shuffle_vector(v, v, const_vec(I32, range(1, 2 * n, 2))))


CACHE_LINE = 64  # bytes (x86, and the Cortex-A7x of the Pis)


def prefetch(builder, address) -> None:
    """A hint to read the cache line at `address` (any pointer) into every cache level: it reads
    nothing into the program and cannot fault, wherever it points."""
    hint = _intrinsic_fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    read, keep, data = ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)
    builder.call(hint, [builder.bitcast(address, I8.as_pointer()), read, keep, data])


# How far past the block it reads a strip or tile of packed rows asks for the weights' bytes
# (software prefetch). A decode step reads each matrix once, and a small model's matrices are short
# streams that the hardware prefetcher picks up late and drops at every 4 KB page: SmolLM2's decode
# step 5-17% faster with it, 8 sequences' step (tiles) ~10% (an AVX2-only AMD EPYC, 1 and 2
# threads), prefill unchanged; 2048 beside 512 to 8192, from interleaved runs.
PREFETCH_AHEAD = 2048


class Span:
    """The blocks a row dot runs over and where its accumulators start. A row's blocks lie in spans
    of `per_span` blocks, `span_bytes` apart (rows packed span-major, kernels/packing.py; a row as
    stored is one span); the dot runs over spans [first, stop). Its accumulators start at zero, or,
    with carry (a pointer to acc_t elements), from what the same row's earlier spans left there
    (zero on span 0), and are saved there after: a row computed span by span adds every block in the
    same order into the same accumulators, the bits of the whole row at once.
    prefetch: a pointer to the first byte the block offsets count from (the group's, in packed
    rows): each block then asks for the bytes PREFETCH_AHEAD past it (a hint, which reads nothing
    and cannot fault, whatever lies there), always or, given prefetch_if (an i1), where it holds."""

    def __init__(self, first, stop, per_span, span_bytes, carry=None, prefetch=None, prefetch_if=None):
        self.first, self.stop, self.per_span, self.span_bytes, self.carry = first, stop, per_span, span_bytes, carry
        self.prefetch, self.prefetch_if = prefetch, prefetch_if
        self._slots, self.carried = [], 0

    @classmethod
    def whole(cls, n_blocks) -> "Span":
        """A row's n_blocks as one span (a row as stored)."""
        return cls(_ZERO, ir.Constant(I64, 1), n_blocks, _ZERO)

    @contextmanager
    def loop(self, builder, block_stride: int):
        """`with span.loop(builder, block_stride) as (b, block):` the body once per block, b its
        index in the row, block its byte offset from the row's first block (blocks block_stride
        bytes apart within a span)."""
        with cgutils.for_range_slice(builder, self.first, self.stop, ir.Constant(I64, 1)) as (s, _):
            span_at = builder.mul(s, self.span_bytes)
            b0 = builder.mul(s, self.per_span)
            with cgutils.for_range(builder, self.per_span) as inner:
                i = inner.index
                block = builder.add(span_at, builder.mul(i, ir.Constant(I64, block_stride)))
                self._prefetch_past(builder, block, block_stride)
                yield builder.add(b0, i), block

    def loop_pairs(self, builder, block_stride: int, emit_block, start_span=None) -> None:
        """As `loop`, with the body written out for two blocks a trip (half the loop's own
        instructions, and a body that knows which of the two it is): emit_block(b, block, k,
        has_next) per block, k its place in the pair (0 or 1; a span's odd last block alone, as 0),
        has_next whether the span has a block after it (a Python bool: the last pair is apart);
        start_span(b0, span_at) before each span's first block (b0 its index in the row, span_at
        its byte offset). Spans of no blocks run nothing (packed rows have none: no spans)."""
        one, two = ir.Constant(I64, 1), ir.Constant(I64, 2)
        stop = builder.select(builder.icmp_unsigned("==", self.per_span, _ZERO), self.first, self.stop)
        with cgutils.for_range_slice(builder, self.first, stop, one) as (s, _):
            span_at = builder.mul(s, self.span_bytes)
            b0 = builder.mul(s, self.per_span)
            if start_span is not None:
                start_span(b0, span_at)

            def one_block(i, k, has_next):
                block = builder.add(span_at, builder.mul(i, ir.Constant(I64, block_stride)))
                self._prefetch_past(builder, block, block_stride)
                emit_block(builder.add(b0, i), block, k, has_next)

            # the pairs whose second block has one after it, then the span's last pair or last block
            with cgutils.for_range(builder, builder.udiv(builder.sub(self.per_span, one), two)) as pair:
                i = builder.mul(pair.index, two)
                one_block(i, 0, True)
                one_block(builder.add(i, one), 1, True)
            last = builder.sub(self.per_span, one)
            with builder.if_else(builder.icmp_unsigned("==", builder.urem(self.per_span, two), _ZERO)) as (even, odd):
                with even:
                    one_block(builder.sub(last, one), 0, True)
                    one_block(last, 1, False)
                with odd:
                    one_block(last, 0, False)

    def _prefetch_past(self, builder, block, block_stride: int) -> None:
        """The prefetch of a block, where the span asks for one (always, or where prefetch_if holds)."""
        if self.prefetch is not None and self.prefetch_if is not None:
            with builder.if_then(self.prefetch_if):
                self._prefetch(builder, block, block_stride)
        elif self.prefetch is not None:
            self._prefetch(builder, block, block_stride)

    def _prefetch(self, builder, block, block_stride: int) -> None:
        """Ask for each cache line of the block_stride bytes PREFETCH_AHEAD past `block`."""
        for line in range(0, block_stride, CACHE_LINE):
            prefetch(builder, builder.gep(self.prefetch, [builder.add(block, ir.Constant(I64, PREFETCH_AHEAD + line))]))

    def accumulator(self, builder, zero: ir.Constant):
        """A slot (alloca) holding zero, or the value carried in."""
        slot = cgutils.alloca_once(builder, zero.type)
        init = zero
        if self.carry is not None:
            saved = builder.bitcast(builder.gep(self.carry, [ir.Constant(I64, self.carried)]), zero.type.as_pointer())
            init = builder.select(builder.icmp_signed("==", self.first, _ZERO), zero, builder.load(saved, align=4))
            self._slots.append((slot, saved))
            self.carried += zero.type.count if isinstance(zero.type, ir.VectorType) else 1
        builder.store(init, slot)
        return slot

    def save(self, builder) -> None:
        """Store the accumulators for the row's next span (call after the loop)."""
        for slot, saved in self._slots:
            builder.store(builder.load(slot), saved, align=4)


def row_ptr(context, builder, array_type, array, row):
    """Pointer to array[row, 0] of a 2-D array whose rows are contiguous. Indexing through the
    array struct (not a numba view per row) avoids a reference count update per row, which is an
    atomic on a shared cache line when several threads run the loop."""
    a = context.make_array(array_type)(context, builder, value=array)
    stride = builder.extract_value(a.strides, 0)
    base = builder.bitcast(a.data, I8.as_pointer())
    return builder.gep(base, [builder.mul(row, stride)])


def _token_operands(context, builder, arg_types, values, sums_type: ir.Type, n_tokens: int):
    """For activations (xq, xd, xs, t): each of tokens t .. t+n_tokens-1's (values, scales, sums)
    row pointers, and the number of blocks."""
    xq_arr, xd_arr, xs_arr, tok = values
    tok = context.cast(builder, tok, arg_types[3], types.intp)
    x_rows = []
    for j in range(n_tokens):
        t = builder.add(tok, ir.Constant(I64, j))
        x_rows.append((row_ptr(context, builder, arg_types[0], xq_arr, t),
                       builder.bitcast(row_ptr(context, builder, arg_types[1], xd_arr, t), F32.as_pointer()),
                       builder.bitcast(row_ptr(context, builder, arg_types[2], xs_arr, t), sums_type.as_pointer())))
    n_blocks = builder.extract_value(context.make_array(arg_types[1])(context, builder, xd_arr).shape, 1)
    return x_rows, n_blocks


def tile_operands(context, builder, signature, args, sums_type: ir.Type, n_rows: int, n_tokens: int):
    """The operands of tile(w, r, xq, xd, xs, t, ...): pointers to rows r .. r+n_rows-1 of w; for
    each of tokens t .. t+n_tokens-1 its (values, scales, sums) row pointers; the number of blocks."""
    ty = signature.args
    row = context.cast(builder, args[1], ty[1], types.intp)
    w_ptrs = [row_ptr(context, builder, ty[0], args[0], builder.add(row, ir.Constant(I64, i))) for i in range(n_rows)]
    return (w_ptrs, *_token_operands(context, builder, ty[2:6], args[2:6], sums_type, n_tokens))


def store_tile(context, builder, signature, args, totals):
    """For tile(w, r, xq, xd, xs, t, out): out[t + j, r + i] = totals[i][j] (out: 2-D, rows contiguous)."""
    ty = signature.args
    row = context.cast(builder, args[1], ty[1], types.intp)
    tok = context.cast(builder, args[5], ty[5], types.intp)
    for j in range(len(totals[0])):
        out_row = row_ptr(context, builder, ty[6], args[6], builder.add(tok, ir.Constant(I64, j)))
        out_row = builder.bitcast(out_row, totals[0][0].type.as_pointer())
        for i, column in enumerate(totals):
            builder.store(column[j], builder.gep(out_row, [builder.add(row, ir.Constant(I64, i))]))


def block_intrinsics(emit_dots, fmt: str, suffix: str, sums_type: ir.Type, tile_shape: tuple[int, int]):
    """The intrinsics (dot, dot_wide, tile) of one weight format, named dot_<fmt>_<suffix>, ...:
    dot(w, r, xq, xd, xs, t) -> float32 (dot_wide: float64): row r of weight w against activation
    row t (values xq, block scales xd, per-block sums xs of sums_type); tile(w, r, xq, xd, xs, t,
    out): out[t + j, r + i] = dot(w, r + i, xq, xd, xs, t + j) for (i, j) < tile_shape, bit for bit
    (out float32). emit_dots(builder, fmt, acc_type, weight row pointers, activation row pointers,
    Span of the blocks) -> totals[row][token] writes the IR; it gives each pair its own accumulators,
    added to in the order of the pair alone, so a tile's pairs are the dots' bits."""

    def dot(wide: bool):
        acc_t = F64 if wide else F32

        def typer(typingctx, w, r, xq, xd, xs, t):
            def codegen(context, builder, signature, args):
                w_ptrs, x_rows, n_blocks = tile_operands(context, builder, signature, args, sums_type, 1, 1)
                return emit_dots(builder, fmt, acc_t, w_ptrs, x_rows, Span.whole(n_blocks))[0][0]

            return (types.float64 if wide else types.float32)(w, r, xq, xd, xs, t), codegen

        typer.__name__ = f"dot_{fmt}_{suffix}{'_wide' if wide else ''}"
        return intrinsic(typer)

    def tile_typer(typingctx, w, r, xq, xd, xs, t, out):
        def codegen(context, builder, signature, args):
            w_ptrs, x_rows, n_blocks = tile_operands(context, builder, signature, args, sums_type, *tile_shape)
            totals = emit_dots(builder, fmt, F32, w_ptrs, x_rows, Span.whole(n_blocks))
            store_tile(context, builder, signature, args, totals)
            return context.get_dummy_value()

        return types.void(w, r, xq, xd, xs, t, out), codegen

    tile_typer.__name__ = f"tile_{fmt}_{suffix}"
    return dot(False), dot(True), intrinsic(tile_typer)


def packed_intrinsics(emit_packed, fmt: str, suffix: str, sums_type: ir.Type, pack: int,
                      tile_shape: tuple[int, int], block_bytes: int, emit_tile=None):
    """The intrinsics (strip, strip_wide, tile, strip_span, strip_span_wide, tile_span) of one weight
    format in rows packed by `pack` (kernels/packing.py: wp[s, g] holds span s of rows pack*g ..
    pack*g+pack-1, block after block, each block_bytes per row), named strip_<fmt>_<suffix>, ...:
    strip(wp, g, i0, xq, xd, xs, t, out, col): out[t, col + i] = the dot of row pack*g + i with
    activation row t, for i < pack (i0 is 0); strip_wide the same in float64 (out float64);
    tile(wp, g, i0, xq, xd, xs, t, out, col): out[t + j, col + i] = the dot of row pack*g + i0 + i
    with activation row t + j for (i, j) < tile_shape;
    <name>_span(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot): the same over span s alone, its
    accumulators taken from carry[slot] (unless s is 0) and left there (CARRIED_PER_ROW per row and
    token, float32; float64 for strip_span_wide): after the last span, out holds the bits of the
    whole rows.
    emit_packed(builder, acc type, group pointer, i0, rows, activation row pointers, Span) ->
    totals[row][token] writes the IR; each pair summed as by block_intrinsics' dot (its own
    accumulators, the one-pair order), so the bits do not depend on the layout either; the layout
    makes a group of rows one sequential stream.
    emit_tile: emit_packed's counterpart for the tiles (default emit_packed), where they read their
    activations in another layout (their xq argument then holds that layout's rows)."""

    group_bytes = pack * block_bytes
    emit_tile = emit_tile or emit_packed

    def spans_of(context, builder, wp_type, wp, first=None, prefetch=None, prefetch_if=None):
        """The Span of a group's blocks in packed rows wp (spans, groups, span bytes): all its spans,
        or span `first` alone, with its accumulators carried; prefetch (the group's pointer) and
        prefetch_if as Span takes them (decode reads the groups one span at a time, or rows of one
        span: the bytes past a block are the next group's)."""
        a = context.make_array(wp_type)(context, builder, value=wp)
        per_span = builder.udiv(builder.extract_value(a.shape, 2), ir.Constant(I64, group_bytes))
        span_bytes = builder.extract_value(a.strides, 0)
        if first is None:
            return Span(_ZERO, builder.extract_value(a.shape, 0), per_span, span_bytes, prefetch=prefetch,
                        prefetch_if=prefetch_if)
        return Span(first, builder.add(first, ir.Constant(I64, 1)), per_span, span_bytes, prefetch=prefetch,
                    prefetch_if=prefetch_if)

    def first_tokens(context, builder, ty, args, n_tokens: int):
        """When a strip or tile prefetches: a strip (one token) always, a tile only as the first of
        its group's tiles (token 0, row 0: each block's prefetch covers the whole group's rows, the
        group's later tiles find its bytes in cache, and a prefill would otherwise ask once per
        tile, 32-64 times for 128 tokens)."""
        if n_tokens == 1:
            return None
        token, row = (context.cast(builder, args[k], ty[k], types.intp) for k in (6, 2))
        return builder.and_(builder.icmp_signed("==", token, _ZERO), builder.icmp_signed("==", row, _ZERO))

    def build(n_rows: int, n_tokens: int, acc_t: ir.Type, name: str, emit=emit_packed):
        def typer(typingctx, wp, g, i0, xq, xd, xs, t, out, col):
            def codegen(context, builder, signature, args):
                ty = signature.args
                x_rows, _ = _token_operands(context, builder, ty[3:7], args[3:7], sums_type, n_tokens)
                i0 = context.cast(builder, args[2], ty[2], types.intp)
                group = _group_ptr(context, builder, ty, args)
                span = spans_of(context, builder, ty[0], args[0], prefetch=group,
                                prefetch_if=first_tokens(context, builder, ty, args, n_tokens))
                totals = emit(builder, acc_t, group, i0, n_rows, x_rows, span)
                _store_group(context, builder, ty, args, totals)
                return context.get_dummy_value()

            return types.void(wp, g, i0, xq, xd, xs, t, out, col), codegen

        typer.__name__ = name
        return intrinsic(typer)

    def build_span(n_rows: int, n_tokens: int, acc_t: ir.Type, name: str, emit=emit_packed):
        def typer(typingctx, wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot):
            def codegen(context, builder, signature, args):
                ty = signature.args
                x_rows, _ = _token_operands(context, builder, ty[3:7], args[3:7], sums_type, n_tokens)
                group = _group_ptr(context, builder, ty, args)
                span = spans_of(context, builder, ty[0], args[0], context.cast(builder, args[9], ty[9], types.intp),
                                prefetch=group, prefetch_if=first_tokens(context, builder, ty, args, n_tokens))
                at = context.cast(builder, args[11], ty[11], types.intp)
                span.carry = builder.bitcast(row_ptr(context, builder, ty[10], args[10], at), acc_t.as_pointer())
                i0 = context.cast(builder, args[2], ty[2], types.intp)
                totals = emit(builder, acc_t, group, i0, n_rows, x_rows, span)
                assert span.carried <= CARRIED_PER_ROW * n_rows * n_tokens, "a carry slot is too short"
                _store_group(context, builder, ty, args, totals)
                return context.get_dummy_value()

            return types.void(wp, g, i0, xq, xd, xs, t, out, col, s, carry, slot), codegen

        typer.__name__ = name
        return intrinsic(typer)

    return (build(pack, 1, F32, f"strip_{fmt}_{suffix}"), build(pack, 1, F64, f"strip_{fmt}_{suffix}_wide"),
            build(*tile_shape, F32, f"tile_{fmt}_{suffix}_packed", emit_tile),
            build_span(pack, 1, F32, f"strip_span_{fmt}_{suffix}"),
            build_span(pack, 1, F64, f"strip_span_{fmt}_{suffix}_wide"),
            build_span(*tile_shape, F32, f"tile_span_{fmt}_{suffix}", emit_tile))


def _group_ptr(context, builder, ty, args):
    """Pointer to the first byte of group args[1] of the packed rows args[0] (spans, groups, bytes)."""
    a = context.make_array(ty[0])(context, builder, value=args[0])
    group = context.cast(builder, args[1], ty[1], types.intp)
    base = builder.bitcast(a.data, I8.as_pointer())
    return builder.gep(base, [builder.mul(group, builder.extract_value(a.strides, 1))])


def _store_group(context, builder, ty, args, totals):
    """out[t + j, col + i] = totals[i][j] for (wp, g, _, xq, xd, xs, t, out, col) = args."""
    tok = context.cast(builder, args[6], ty[6], types.intp)
    col = context.cast(builder, args[8], ty[8], types.intp)
    for j in range(len(totals[0])):
        out_row = builder.bitcast(row_ptr(context, builder, ty[7], args[7], builder.add(tok, ir.Constant(I64, j))),
                                  totals[0][0].type.as_pointer())
        for i, column in enumerate(totals):
            builder.store(column[j], builder.gep(out_row, [builder.add(col, ir.Constant(I64, i))]))
