"""The pieces every LLVM-vector-IR row dot shares (simd_q8.py, simd_q8k.py, simd_float.py hold the dots).

Two reasons to spell the dots out as IR through numba intrinsics instead of writing numba loops:
- Speed: numba types integer arithmetic at machine width (int64), so a loop over int8 quants
  compiles to scalar code. Vector IR (<32 x i8> loads, widening multiplies) lowers to AVX2 on
  x86 and NEON on a Raspberry Pi.
- Fidelity: the float accumulation order is GGML's (8 lanes, one fused multiply-add per block,
  lanes summed as ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)) at the end). Rounding differences of one
  ulp get amplified through a deep network when they flip an activation's 8-bit rounding; keeping
  the same order keeps our logits on top of llama.cpp's on x86.

Here: IR types, loads, GGML's fused multiply-add and 8-lane sum, the operands of a row dot, and
the only instructions chosen per CPU (the integer quad dot, IQ4_NL's table lookup), so that the
dots themselves read the same on x86, AArch64 and elsewhere. Every dot has a plain-numpy
reference in `matmul.py` / `ops.py` / `attention.py`, and tests check them.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils

from ..quant import IQ4_NL_VALUES

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
LANES = 8


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


def fmuladd(builder, a, b, c):
    """a*b + c, fused where the CPU has FMA (as GGML's AVX2 path), separately where it has not."""
    elem = a.type.element if isinstance(a.type, ir.VectorType) else a.type
    name = "f64" if isinstance(elem, ir.DoubleType) else "f32"
    suffix = f"v{a.type.count}{name}" if isinstance(a.type, ir.VectorType) else name
    return builder.call(_intrinsic_fn(builder, f"llvm.fmuladd.{suffix}", a.type, [a.type] * 3), [a, b, c])


def splat(builder, scalar, n: int):
    v = builder.insert_element(ir.Constant(vec(scalar.type, n), None), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, const_vec(I32, [0] * n))


def hsum_float_8(builder, acc):
    """GGML's hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    half = builder.fadd(builder.shuffle_vector(acc, acc, const_vec(I32, [0, 1, 2, 3])),
                        builder.shuffle_vector(acc, acc, const_vec(I32, [4, 5, 6, 7])))
    quarter = builder.fadd(builder.shuffle_vector(half, half, const_vec(I32, [0, 1])),
                           builder.shuffle_vector(half, half, const_vec(I32, [2, 3])))
    return builder.fadd(builder.extract_element(quarter, ir.Constant(I32, 0)),
                        builder.extract_element(quarter, ir.Constant(I32, 1)))


_X86_AVX2 = "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")
_AARCH64 = llvm_binding.get_process_triple().startswith(("aarch64", "arm64"))
IQ4_NL_LEVELS = tuple(int(v) for v in IQ4_NL_VALUES)  # as i8 constants


def iq4_nl_values(builder, nibbles):
    """<16 x i8> indices 0..15 -> IQ4_NL's non-linear values: one table lookup instruction
    (x86 pshufb, AArch64 tbl), or a select per entry elsewhere."""
    table = const_vec(I8, IQ4_NL_LEVELS)
    if _X86_AVX2:
        pshufb = _intrinsic_fn(builder, "llvm.x86.ssse3.pshuf.b.128", vec(I8, 16), [vec(I8, 16)] * 2)
        return builder.call(pshufb, [table, nibbles])
    if _AARCH64:
        tbl = _intrinsic_fn(builder, "llvm.aarch64.neon.tbl1.v16i8", vec(I8, 16), [vec(I8, 16)] * 2)
        return builder.call(tbl, [table, nibbles])
    out = const_vec(I8, [IQ4_NL_LEVELS[0]] * 16)
    for k, value in enumerate(IQ4_NL_LEVELS[1:], start=1):
        out = builder.select(builder.icmp_unsigned("==", nibbles, const_vec(I8, [k] * 16)),
                             const_vec(I8, [value] * 16), out)
    return out


def quad_dot(builder, w_i8, x_i8, w_unsigned: bool):
    """<32 x i8> weights . <32 x i8> activations -> <8 x i32>, lane k = sum of products 4k..4k+3.
    Integer sums are exact in any order; on AVX2 this is GGML's maddubs + madd pair."""
    if _X86_AVX2:
        if not w_unsigned:  # maddubs wants unsigned x signed: move the sign onto the activations
            psign = _intrinsic_fn(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), [vec(I8, 32)] * 2)
            w_i8, x_i8 = builder.call(psign, [w_i8, w_i8]), builder.call(psign, [x_i8, w_i8])
        maddubs = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32)] * 2)
        madd = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16)] * 2)
        pairs = builder.call(maddubs, [w_i8, x_i8])
        return builder.call(madd, [pairs, const_vec(I16, [1] * 16)])
    extend = builder.zext if w_unsigned else builder.sext
    p = builder.sext(builder.mul(extend(w_i8, vec(I16, 32)), builder.sext(x_i8, vec(I16, 32))), vec(I32, 32))
    parts = [builder.shuffle_vector(p, p, const_vec(I32, range(j, 32, 4))) for j in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _row_ptr(context, builder, array_type, array, row):
    """Pointer to array[row, 0] of a 2-D array whose rows are contiguous. Indexing through the
    array struct (not a numba view per row) avoids a reference count update per row, which is an
    atomic on a shared cache line when several threads run the loop."""
    a = context.make_array(array_type)(context, builder, value=array)
    stride = builder.extract_value(a.strides, 0)
    base = builder.bitcast(a.data, I8.as_pointer())
    return builder.gep(base, [builder.mul(row, stride)])


def row_dot_operands(context, builder, signature, args, sums_type: ir.Type):
    """The operands of dot(w, r, xq, xd, xs, t): pointers to row r of w, to row t of the
    activations' values, scales and per-block sums (of sums_type), and the number of blocks."""
    w_arr, row, xq_arr, xd_arr, xs_arr, tok = args
    ty = signature.args
    row = context.cast(builder, row, ty[1], types.intp)
    tok = context.cast(builder, tok, ty[5], types.intp)
    w_ptr = _row_ptr(context, builder, ty[0], w_arr, row)
    xq_ptr = _row_ptr(context, builder, ty[2], xq_arr, tok)
    xd_ptr = builder.bitcast(_row_ptr(context, builder, ty[3], xd_arr, tok), F32.as_pointer())
    xs_ptr = builder.bitcast(_row_ptr(context, builder, ty[4], xs_arr, tok), sums_type.as_pointer())
    n_blocks = builder.extract_value(context.make_array(ty[3])(context, builder, xd_arr).shape, 1)
    return w_ptr, xq_ptr, xd_ptr, xs_ptr, n_blocks
