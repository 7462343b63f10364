"""Row dot products written as LLVM vector IR through numba intrinsics.

Two reasons to spell these out instead of writing numba loops:
- Speed: numba types integer arithmetic at machine width (int64), so a loop over int8 quants
  compiles to scalar code. Vector IR (<32 x i8> loads, widening multiplies) lowers to AVX2 on
  x86 and NEON on a Raspberry Pi.
- Fidelity: the float accumulation order is GGML's (8 lanes, one fused multiply-add per block,
  lanes summed as ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)) at the end). Rounding differences of one
  ulp get amplified through a deep network when they flip an activation's 8-bit rounding; keeping
  the same order keeps our logits on top of llama.cpp's on x86.

Every product here has a plain-numpy reference in `matmul.py` / `ops.py`, and tests check them.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import IQ4_NL_VALUES

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F16, _F32, _F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
_LANES = 8


def _vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def _const_vec(elem: ir.Type, values) -> ir.Constant:
    return ir.Constant(_vec(elem, len(values)), list(values))


def _data_ptr(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, value=array).data


def _load_at(builder, base_ptr, byte_offset, elem: ir.Type, n: int | None = None):
    """Unaligned load of one `elem` (or n of them as a vector) at base_ptr + byte_offset bytes."""
    raw = builder.gep(builder.bitcast(base_ptr, _I8.as_pointer()), [byte_offset])
    target = elem if n is None else _vec(elem, n)
    return builder.load(builder.bitcast(raw, target.as_pointer()), align=1)


def _intrinsic_fn(builder, name: str, ret: ir.Type, args: list[ir.Type]):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _fmuladd(builder, a, b, c):
    """a*b + c, fused where the CPU has FMA (as GGML's AVX2 path), separately where it has not."""
    elem = a.type.element if isinstance(a.type, ir.VectorType) else a.type
    name = "f64" if isinstance(elem, ir.DoubleType) else "f32"
    suffix = f"v{a.type.count}{name}" if isinstance(a.type, ir.VectorType) else name
    return builder.call(_intrinsic_fn(builder, f"llvm.fmuladd.{suffix}", a.type, [a.type] * 3), [a, b, c])


def _splat(builder, scalar, n: int):
    v = builder.insert_element(ir.Constant(_vec(scalar.type, n), None), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _const_vec(_I32, [0] * n))


def _hsum8(builder, acc):
    """GGML's hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    half = builder.fadd(builder.shuffle_vector(acc, acc, _const_vec(_I32, [0, 1, 2, 3])),
                        builder.shuffle_vector(acc, acc, _const_vec(_I32, [4, 5, 6, 7])))
    quarter = builder.fadd(builder.shuffle_vector(half, half, _const_vec(_I32, [0, 1])),
                           builder.shuffle_vector(half, half, _const_vec(_I32, [2, 3])))
    return builder.fadd(builder.extract_element(quarter, ir.Constant(_I32, 0)),
                        builder.extract_element(quarter, ir.Constant(_I32, 1)))


_X86_AVX2 = "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")
_AARCH64 = llvm_binding.get_process_triple().startswith(("aarch64", "arm64"))
IQ4_NL_LEVELS = tuple(int(v) for v in IQ4_NL_VALUES)  # as i8 constants


def _iq4_nl_values(builder, nibbles):
    """<16 x i8> indices 0..15 -> IQ4_NL's non-linear values: one table lookup instruction
    (x86 pshufb, AArch64 tbl), or a select per entry elsewhere."""
    table = _const_vec(_I8, IQ4_NL_LEVELS)
    if _X86_AVX2:
        pshufb = _intrinsic_fn(builder, "llvm.x86.ssse3.pshuf.b.128", _vec(_I8, 16), [_vec(_I8, 16)] * 2)
        return builder.call(pshufb, [table, nibbles])
    if _AARCH64:
        tbl = _intrinsic_fn(builder, "llvm.aarch64.neon.tbl1.v16i8", _vec(_I8, 16), [_vec(_I8, 16)] * 2)
        return builder.call(tbl, [table, nibbles])
    out = _const_vec(_I8, [IQ4_NL_LEVELS[0]] * 16)
    for k, value in enumerate(IQ4_NL_LEVELS[1:], start=1):
        out = builder.select(builder.icmp_unsigned("==", nibbles, _const_vec(_I8, [k] * 16)),
                             _const_vec(_I8, [value] * 16), out)
    return out


def _quad_dot(builder, w_i8, x_i8, w_unsigned: bool):
    """<32 x i8> weights . <32 x i8> activations -> <8 x i32>, lane k = sum of products 4k..4k+3.
    Integer sums are exact in any order; on AVX2 this is GGML's maddubs + madd pair."""
    if _X86_AVX2:
        if not w_unsigned:  # maddubs wants unsigned x signed: move the sign onto the activations
            psign = _intrinsic_fn(builder, "llvm.x86.avx2.psign.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
            w_i8, x_i8 = builder.call(psign, [w_i8, w_i8]), builder.call(psign, [x_i8, w_i8])
        maddubs = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
        madd = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
        pairs = builder.call(maddubs, [w_i8, x_i8])
        return builder.call(madd, [pairs, _const_vec(_I16, [1] * 16)])
    extend = builder.zext if w_unsigned else builder.sext
    p = builder.sext(builder.mul(extend(w_i8, _vec(_I16, 32)), builder.sext(x_i8, _vec(_I16, 32))), _vec(_I32, 32))
    parts = [builder.shuffle_vector(p, p, _const_vec(_I32, range(j, 32, 4))) for j in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


# Byte layout of each native block format: (bytes per block, offset of the quants); Q5's fifth
# bits (one uint32 per block) sit just before the quants
_BLOCK = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2), "q5_0": (22, 6), "q5_1": (24, 8), "iq4_nl": (18, 2)}
_WITH_MIN = ("q4_1", "q5_1")  # v = q * d + m: the activations' block sums meet m


def _row_ptr(context, builder, array_type, array, row):
    """Pointer to array[row, 0] of a 2-D array whose rows are contiguous. Indexing through the
    array struct (not a numba view per row) avoids a reference count update per row, which is an
    atomic on a shared cache line when several threads run the loop."""
    a = context.make_array(array_type)(context, builder, value=array)
    stride = builder.extract_value(a.strides, 0)
    base = builder.bitcast(a.data, _I8.as_pointer())
    return builder.gep(base, [builder.mul(row, stride)])


def _row_dot_operands(context, builder, signature, args, sums_type: ir.Type):
    """The operands of dot(w, r, xq, xd, xs, t): pointers to row r of w, to row t of the
    activations' values, scales and per-block sums (of sums_type), and the number of blocks."""
    w_arr, row, xq_arr, xd_arr, xs_arr, tok = args
    ty = signature.args
    row = context.cast(builder, row, ty[1], types.intp)
    tok = context.cast(builder, tok, ty[5], types.intp)
    w_ptr = _row_ptr(context, builder, ty[0], w_arr, row)
    xq_ptr = _row_ptr(context, builder, ty[2], xq_arr, tok)
    xd_ptr = builder.bitcast(_row_ptr(context, builder, ty[3], xd_arr, tok), _F32.as_pointer())
    xs_ptr = builder.bitcast(_row_ptr(context, builder, ty[4], xs_arr, tok), sums_type.as_pointer())
    n_blocks = builder.extract_value(context.make_array(ty[3])(context, builder, xd_arr).shape, 1)
    return w_ptr, xq_ptr, xd_ptr, xs_ptr, n_blocks


def _quant_row_dot(fmt: str, wide: bool = False):
    """Build the intrinsic dot(w, r, xq, xd, xds, t): row r of weight w (uint8, block format
    `fmt`) against Q8 activation row t (xq int8 values, xd f16-rounded block scales, xds block
    d*sum(q), which only Q4_1 reads). wide: accumulate in float64 and return it (every block's
    contribution is exact in float64, so only the additions round, at 2^-53)."""
    block_bytes, qs_offset = _BLOCK[fmt]
    acc_t = _F64 if wide else _F32

    def typer(typingctx, w, r, xq, xd, xds, t):
        sig = (types.float64 if wide else types.float32)(w, r, xq, xd, xds, t)

        def codegen(context, builder, signature, args):
            w_ptr, xq_ptr, xd_ptr, xds_ptr, n_blocks = _row_dot_operands(context, builder, signature, args, _F32)
            acc_slot = cgutils.alloca_once_value(builder, ir.Constant(_vec(acc_t, _LANES), None))
            builder.store(ir.Constant(_vec(acc_t, _LANES), [0.0] * _LANES), acc_slot)
            summs_slot = cgutils.alloca_once_value(builder, ir.Constant(acc_t, 0.0))
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                block = builder.mul(b, ir.Constant(_I64, block_bytes))
                d_w = builder.fpext(_load_at(builder, w_ptr, block, _F16), _F32)
                d_x = builder.load(builder.gep(xd_ptr, [b]))
                if fmt == "q8_0":
                    quants = _load_at(builder, w_ptr, builder.add(block, ir.Constant(_I64, qs_offset)), _I8, 32)
                else:
                    packed = _load_at(builder, w_ptr, builder.add(block, ir.Constant(_I64, qs_offset)), _I8, 16)
                    low = builder.and_(packed, _const_vec(_I8, [15] * 16))
                    high = builder.lshr(packed, _const_vec(_I8, [4] * 16))
                    if fmt == "iq4_nl":  # the nibbles index a table of 16 non-linear values
                        low, high = _iq4_nl_values(builder, low), _iq4_nl_values(builder, high)
                    quants = builder.shuffle_vector(low, high, _const_vec(_I32, range(32)))  # value order
                    if fmt in ("q5_0", "q5_1"):  # bit j of the block's uint32 is value j's fifth bit
                        qh = _load_at(builder, w_ptr, builder.add(block, ir.Constant(_I64, qs_offset - 4)), _I32)
                        bits = builder.and_(builder.lshr(_splat(builder, qh, 32), _const_vec(_I32, range(32))),
                                            _const_vec(_I32, [1] * 32))
                        fifth = builder.shl(builder.trunc(bits, _vec(_I8, 32)), _const_vec(_I8, [4] * 32))
                        quants = builder.or_(quants, fifth)
                    if fmt in ("q4_0", "q5_0"):
                        offset = 8 if fmt == "q4_0" else 16
                        quants = builder.sub(quants, _const_vec(_I8, [offset] * 32))
                xq = _load_at(builder, xq_ptr, builder.mul(b, ir.Constant(_I64, 32)), _I8, 32)
                quads = builder.sitofp(_quad_dot(builder, quants, xq, w_unsigned=fmt in _WITH_MIN),
                                       _vec(acc_t, _LANES))
                scale = builder.fmul(d_w, d_x)  # exact: two f16 significands fit in f32
                scale = _splat(builder, builder.fpext(scale, _F64) if wide else scale, _LANES)
                builder.store(_fmuladd(builder, scale, quads, builder.load(acc_slot)), acc_slot)
                if fmt in _WITH_MIN:
                    m_w = builder.fpext(_load_at(builder, w_ptr, builder.add(block, ir.Constant(_I64, 2)), _F16), acc_t)
                    ds_x = builder.load(builder.gep(xds_ptr, [b]))
                    ds_x = builder.fpext(ds_x, _F64) if wide else ds_x
                    builder.store(_fmuladd(builder, m_w, ds_x, builder.load(summs_slot)), summs_slot)
            total = _hsum8(builder, builder.load(acc_slot))
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
    acc_t = _F64 if wide else _F32

    def typer(typingctx, w, r, xq, xd, xs, t):
        sig = (types.float64 if wide else types.float32)(w, r, xq, xd, xs, t)

        def codegen(context, builder, signature, args):
            w_ptr, xq_ptr, xd_ptr, xs_ptr, n_blocks = _row_dot_operands(context, builder, signature, args, _I32)
            acc_slot = cgutils.alloca_once_value(builder, ir.Constant(_vec(acc_t, _LANES), [0.0] * _LANES))
            builder.store(ir.Constant(_vec(acc_t, _LANES), [0.0] * _LANES), acc_slot)
            mins_slot = cgutils.alloca_once_value(builder, ir.Constant(_vec(acc_t, 4), [0.0] * 4))
            builder.store(ir.Constant(_vec(acc_t, 4), [0.0] * 4), mins_slot)
            summs_slot = cgutils.alloca_once_value(builder, ir.Constant(acc_t, 0.0))
            builder.store(ir.Constant(acc_t, 0.0), summs_slot)

            def byte(offset):  # the unsigned byte at w_ptr + offset, as i32
                return builder.zext(_load_at(builder, w_ptr, offset, _I8), _I32)

            def const(v):
                return ir.Constant(_I32, v)

            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                block = builder.mul(b, ir.Constant(_I64, block_bytes))

                def field(name, extra=0):
                    return builder.add(block, ir.Constant(_I64, at[name] + extra))

                x_d = builder.load(builder.gep(xd_ptr, [b]))
                xq_at = builder.mul(b, ir.Constant(_I64, 256))
                sums = [builder.load(builder.gep(xs_ptr, [builder.add(builder.mul(b, ir.Constant(_I64, 16)),
                                                                      ir.Constant(_I64, i))])) for i in range(16)]
                sumi = ir.Constant(_vec(_I32, _LANES), [0] * _LANES)
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
                    fifth_bits = _load_at(builder, w_ptr, field("qh"), _I8, 32) if fmt == "q5_k" else None
                    for j in range(4):  # 64 values: low nibbles = sub-block 2j, high = 2j+1
                        packed = _load_at(builder, w_ptr, field("qs", 32 * j), _I8, 32)
                        for half, nibbles in enumerate((builder.and_(packed, _const_vec(_I8, [15] * 32)),
                                                        builder.lshr(packed, _const_vec(_I8, [4] * 32)))):
                            if fifth_bits is not None:  # bit 2j+half of byte b: value b's fifth bit
                                bit = builder.and_(builder.lshr(fifth_bits, _const_vec(_I8, [2 * j + half] * 32)),
                                                   _const_vec(_I8, [1] * 32))
                                nibbles = builder.or_(nibbles, builder.shl(bit, _const_vec(_I8, [4] * 32)))
                            xq = _load_at(builder, xq_ptr, builder.add(xq_at, ir.Constant(_I64, 64 * j + 32 * half)),
                                          _I8, 32)
                            quad = _quad_dot(builder, nibbles, xq, w_unsigned=True)
                            sumi = builder.add(sumi, builder.mul(quad, _splat(builder, scales[2 * j + half], _LANES)))
                    # mins: lane m = min[2m] * S[2m] + min[2m+1] * S[2m+1], S[i] the 32-sum of sub-block i
                    block_sums = [builder.add(sums[2 * i], sums[2 * i + 1]) for i in range(8)]
                    prod = ir.Constant(_vec(_I32, 4), None)
                    for m in range(4):
                        lane = builder.add(builder.mul(mins[2 * m], block_sums[2 * m]),
                                           builder.mul(mins[2 * m + 1], block_sums[2 * m + 1]))
                        prod = builder.insert_element(prod, lane, ir.Constant(_I32, m))
                    dmin = builder.fmul(builder.fneg(x_d), builder.fpext(_load_at(builder, w_ptr, field("dmin"), _F16),
                                                                        _F32))
                    if wide:
                        dmin = builder.fmul(builder.fneg(builder.fpext(x_d, _F64)),
                                            builder.fpext(_load_at(builder, w_ptr, field("dmin"), _F16), _F64))
                    if fmt == "q4_k":
                        builder.store(_fmuladd(builder, _splat(builder, dmin, 4), builder.sitofp(prod, _vec(acc_t, 4)),
                                               builder.load(mins_slot)), mins_slot)
                    else:  # Q5_K adds the four lanes as integers, then one float per super-block
                        lanes = [builder.extract_element(prod, ir.Constant(_I32, m)) for m in range(4)]
                        whole = builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3]))
                        builder.store(_fmuladd(builder, dmin, builder.sitofp(whole, acc_t), builder.load(summs_slot)),
                                      summs_slot)
                else:  # q6_k: 128 values per chunk, 4 runs of 32 (two 16-value sub-blocks each)
                    scales = [builder.sext(_load_at(builder, w_ptr, field("scales", i), _I8), _I32) for i in range(16)]
                    for j in range(2):
                        low1 = _load_at(builder, w_ptr, field("ql", 64 * j), _I8, 32)
                        low2 = _load_at(builder, w_ptr, field("ql", 64 * j + 32), _I8, 32)
                        high = _load_at(builder, w_ptr, field("qh", 32 * j), _I8, 32)
                        fifteen, three, four = (_const_vec(_I8, [v] * 32) for v in (15, 3, 4))
                        lows = (builder.and_(low1, fifteen), builder.and_(low2, fifteen),
                                builder.lshr(low1, four), builder.lshr(low2, four))
                        for k in range(4):
                            top = builder.and_(builder.lshr(high, _const_vec(_I8, [2 * k] * 32)), three)
                            q6 = builder.or_(lows[k], builder.shl(top, _const_vec(_I8, [4] * 32)))
                            xq = _load_at(builder, xq_ptr, builder.add(xq_at, ir.Constant(_I64, 128 * j + 32 * k)),
                                          _I8, 32)
                            quad = _quad_dot(builder, q6, xq, w_unsigned=True)
                            s = 2 * (4 * j + k)
                            lane_scales = ir.Constant(_vec(_I32, _LANES), None)
                            for lane in range(_LANES):
                                lane_scales = builder.insert_element(lane_scales, scales[s + lane // 4],
                                                                     ir.Constant(_I32, lane))
                            sumi = builder.add(sumi, builder.mul(quad, lane_scales))
                    # the values are stored + 32: lane l takes back 32 * (S16[2l] sc[2l] + S16[2l+1] sc[2l+1])
                    offset = ir.Constant(_vec(_I32, _LANES), None)
                    for lane in range(_LANES):
                        v = builder.add(builder.mul(sums[2 * lane], scales[2 * lane]),
                                        builder.mul(sums[2 * lane + 1], scales[2 * lane + 1]))
                        offset = builder.insert_element(offset, builder.shl(v, const(5)), ir.Constant(_I32, lane))
                    sumi = builder.sub(sumi, offset)
                d_w = _load_at(builder, w_ptr, field("d"), _F16)
                d = builder.fmul(builder.fpext(x_d, _F64), builder.fpext(d_w, _F64)) if wide else \
                    builder.fmul(x_d, builder.fpext(d_w, _F32))
                builder.store(_fmuladd(builder, _splat(builder, d, _LANES), builder.sitofp(sumi, _vec(acc_t, _LANES)),
                                       builder.load(acc_slot)), acc_slot)
            total = _hsum8(builder, builder.load(acc_slot))
            if fmt == "q4_k":  # (m0 + m2) + (m1 + m3), as GGML's movehl / movehdup
                m = builder.load(mins_slot)
                el = [builder.extract_element(m, ir.Constant(_I32, i)) for i in range(4)]
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


def _ggml_vec_dot(elem: ir.Type):
    """The codegen of GGML's ggml_vec_dot_f16 / ggml_vec_dot_f32 order (see dot_f16_f16_vec)."""
    size = 2 if elem is _F16 else 4

    def codegen(context, builder, signature, args):
        a_arr, a_off, b_arr, b_off, count = args
        a_ptr = builder.gep(_data_ptr(context, builder, signature.args[0], a_arr), [a_off])
        b_ptr = builder.gep(_data_ptr(context, builder, signature.args[2], b_arr), [b_off])
        zero = ir.Constant(_vec(_F32, _LANES), [0.0] * _LANES)
        slots = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        for slot in slots:
            builder.store(zero, slot)

        def load(ptr, offset):
            if elem is _F32:
                return _load_at(builder, ptr, offset, _F32, _LANES)
            return builder.fpext(builder.bitcast(_load_at(builder, ptr, offset, _I16, _LANES), _vec(_F16, _LANES)),
                                 _vec(_F32, _LANES))

        n_steps = builder.sdiv(count, ir.Constant(count.type, 4 * _LANES))
        with cgutils.for_range(builder, n_steps) as loop:
            base = builder.mul(loop.index, ir.Constant(_I64, size * 4 * _LANES))
            for j, slot in enumerate(slots):
                offset = builder.add(base, ir.Constant(_I64, size * _LANES * j))
                builder.store(_fmuladd(builder, load(a_ptr, offset), load(b_ptr, offset), builder.load(slot)), slot)
        s0, s1, s2, s3 = (builder.load(slot) for slot in slots)
        x = builder.fadd(builder.fadd(s0, s2), builder.fadd(s1, s3))
        t = builder.fadd(builder.shuffle_vector(x, x, _const_vec(_I32, [0, 1, 2, 3])),
                         builder.shuffle_vector(x, x, _const_vec(_I32, [4, 5, 6, 7])))
        el = [builder.extract_element(t, ir.Constant(_I32, i)) for i in range(4)]
        return builder.fadd(builder.fadd(el[0], el[1]), builder.fadd(el[2], el[3]))

    return codegen


@intrinsic
def dot_f16_f16_vec(typingctx, a, a_offset, b, b_offset, n):
    """sum(a[a_offset:+n] * b[b_offset:+n]) of two f16 vectors (uint16 arrays of f16 bits), in
    the order of GGML's ggml_vec_dot_f16, which llama.cpp uses when the other operand is a single
    vector (one token), products and sums in f32: four 8-lane accumulators over steps of 32
    elements, summed (s0+s2)+(s1+s3), then t_k = s_k + s_k+4, then (t0+t1)+(t2+t3).
    n must be a multiple of 32 (the caller adds any tail)."""
    return types.float32(a, a_offset, b, b_offset, n), _ggml_vec_dot(_F16)


@intrinsic
def dot_f32_f32_vec(typingctx, a, a_offset, b, b_offset, n):
    """The same for two float32 vectors, in the order of GGML's ggml_vec_dot_f32 (the same
    accumulators and reduction). n must be a multiple of 32."""
    return types.float32(a, a_offset, b, b_offset, n), _ggml_vec_dot(_F32)


@intrinsic
def hsum8(typingctx, x, offset):
    """GGML's 8-lane horizontal sum of x[offset:offset+8] (float32)."""
    sig = types.float32(x, offset)

    def codegen(context, builder, signature, args):
        ptr = builder.gep(_data_ptr(context, builder, signature.args[0], args[0]), [args[1]])
        return _hsum8(builder, _load_at(builder, ptr, ir.Constant(_I64, 0), _F32, _LANES))

    return sig, codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a*b + c with one rounding where the CPU has FMA (float32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return _fmuladd(builder, *args)

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return sig, codegen


@intrinsic
def f32_from_bits(typingctx, x):
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


@intrinsic
def f16_at(typingctx, a, offset):
    """The f16 value (as float32) at element `offset` from the start of a's data (uint16 array of
    f16 bits): addressed like dot_f16_f16_vec, so it reaches a strided 2-D array's rows too."""
    sig = types.float32(a, offset)

    def codegen(context, builder, signature, args):
        ptr = _data_ptr(context, builder, signature.args[0], args[0])
        byte_offset = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), ir.Constant(_I64, 2))
        return builder.fpext(_load_at(builder, ptr, byte_offset, _F16), _F32)

    return sig, codegen


@intrinsic
def round_to_f16(typingctx, x):
    """x rounded to the nearest f16 value (ties to even), as float32."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], _F16), _F32)

    return sig, codegen


@intrinsic
def f16_bits(typingctx, x):
    """The f16 bit pattern (uint16) of float32 x rounded to nearest."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], _F16), _I16)

    return sig, codegen
