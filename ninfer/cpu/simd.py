"""Short-vector building blocks for the q8 kernels, written as LLVM vector IR (numba intrinsics).

LLVM's vectorizers do not turn numba's scalar block loops into the code a quantized dot wants:
the loop vectorizer never sees a 16- or 32-step loop (it is unrolled first), and the SLP
vectorizer gives up on any store it cannot prove apart from the loads (numba arrays may
alias), so per-block float accumulators stay scalar. These intrinsics say it in vectors
instead, in target-independent IR that LLVM lowers to whatever the host has (AVX2 here:
`vpmaddwd` for the integer dot, `vcvtdq2ps` + `vfmadd` for the accumulation):

* `Codes` (<32 x i16>): the 32 integer codes of one weight block, built by the `codes_*`
  readers from the stored bytes (`blocks.py` says which bytes each type keeps where);
* `Acc` (<8 x float>): a row's running sum, lane l holding the block-scaled integer partial
  sums of lanes l, l + 8, ... of every block so far; `acc_sum` adds the lanes once per row.

`dot_acc(acc, codes, x, xo, s)` = acc + s * (the 32 products codes_j * x[xo + j], summed in
int32 in pairs then halves): the integer block dot is exact (|code| <= 4096, |x| <= 127), so
the result differs from the scalar dot only by float rounding of the sum over blocks.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

# x86 with AVX2 gets vpmaddwd by name; elsewhere the same sum in generic IR. The choice follows
# the host CPU, which numba's cache index already keys on.
HAS_AVX2 = bool(llvm_binding.get_host_cpu_features().get("avx2", False))
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_CODES = ir.VectorType(_I16, 32)
_ACC = ir.VectorType(_F32, 8)


class _CodesType(types.Type):
    def __init__(self):
        super().__init__(name="Codes32xi16")


class _AccType(types.Type):
    def __init__(self):
        super().__init__(name="Acc8xf32")


codes_type, acc_type = _CodesType(), _AccType()


@register_model(_CodesType)
class _CodesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _CODES)


@register_model(_AccType)
class _AccModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _ACC)


def _const_vec(ty, values):
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def _splat(builder, value, n):
    vec = ir.VectorType(value.type, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), _const_vec(_I32, [0] * n))


def _contiguous(*arrays):
    """Typing guard: the loads read raw memory from the data pointer, so only C arrays."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


def _load(context, builder, aryty, ary, offset, elem, n):
    """<n x elem> from array `ary` (1-D) starting at element `offset` (unaligned)."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.gep(data, [offset])
    return builder.load(builder.bitcast(ptr, ir.VectorType(elem, n).as_pointer()), align=1)


def _halves(builder, vec, n):
    """(first half, second half) of an n-lane vector."""
    undef = ir.Constant(vec.type, ir.Undefined)
    lo = builder.shuffle_vector(vec, undef, _const_vec(_I32, range(n // 2)))
    hi = builder.shuffle_vector(vec, undef, _const_vec(_I32, range(n // 2, n)))
    return lo, hi


def _concat(builder, a, b, n):
    return builder.shuffle_vector(a, b, _const_vec(_I32, range(2 * n)))


@intrinsic
def acc_zero(typingctx):
    """An `Acc` of zeros."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_ACC, [ir.Constant(_F32, 0.0)] * 8)

    return acc_type(), codegen


@intrinsic
def acc_sum(typingctx, acc):
    """The sum of an `Acc`'s lanes (float32)."""

    def codegen(context, builder, sig, args):
        v = args[0]
        for n in (8, 4):
            lo, hi = _halves(builder, v, n)
            v = builder.fadd(lo, hi)
        return builder.fadd(builder.extract_element(v, ir.Constant(_I32, 0)),
                            builder.extract_element(v, ir.Constant(_I32, 1)))  # fmt: skip

    return types.float32(acc_type), codegen


@intrinsic
def codes_nibbles(typingctx, src, at):
    """Codes 0..15 of a 4-bit block whose 16 bytes start at src[at]: byte k holds weight k in
    its low nibble and weight k + 16 in its high one (Q4_0 / Q4_1 / Q5_0 / Q5_1)."""

    if not _contiguous(src):
        return None

    def codegen(context, builder, sig, args):
        b = _load(context, builder, sig.args[0], args[0], args[1], _I8, 16)
        lo = builder.and_(b, _const_vec(_I8, [15] * 16))
        hi = builder.lshr(b, _const_vec(_I8, [4] * 16))
        return builder.zext(_concat(builder, lo, hi, 16), _CODES)

    return codes_type(src, types.intp), codegen


@intrinsic
def codes_shifted(typingctx, src, at, shift):
    """Codes 0..15 of a block whose weight j is the nibble at bit `shift` of byte src[at + j]
    (Q4_K: 32 bytes hold two blocks, low nibbles then high)."""

    if not _contiguous(src):
        return None

    def codegen(context, builder, sig, args):
        b = _load(context, builder, sig.args[0], args[0], args[1], _I8, 32)
        s = _splat(builder, builder.trunc(args[2], _I8), 32)
        return builder.zext(builder.and_(builder.lshr(b, s), _const_vec(_I8, [15] * 32)), _CODES)

    return codes_type(src, types.intp, types.intp), codegen


@intrinsic
def codes_int8(typingctx, src, at):
    """Codes of 32 int8 weights starting at src[at] (Q8_0)."""

    if not _contiguous(src):
        return None

    def codegen(context, builder, sig, args):
        return builder.sext(_load(context, builder, sig.args[0], args[0], args[1], _I8, 32), _CODES)

    return codes_type(src, types.intp), codegen


@intrinsic
def codes_fifth_bits(typingctx, codes, high):
    """Codes with bit j of the 32-bit `high` set as bit 4 of code j (Q5_0 / Q5_1)."""

    def codegen(context, builder, sig, args):
        h = _splat(builder, builder.trunc(args[1], _I32), 32)
        bits = builder.and_(builder.lshr(h, _const_vec(_I32, range(32))), _const_vec(_I32, [1] * 32))
        return builder.or_(args[0], builder.trunc(builder.shl(bits, _const_vec(_I32, [4] * 32)), _CODES))

    return codes_type(codes_type, types.int64), codegen


@intrinsic
def codes_q6k(typingctx, src, low_at, low_shift, high_at, high_shift, scale0, scale1):
    """Q6_K codes: weight j is ((low nibble | 2 high bits << 4) - 32) * scale, the low nibble at
    bit `low_shift` of byte src[low_at + j], the high bits at bit `high_shift` of byte
    src[high_at + j], scale0 for j < 16 and scale1 above (|code| <= 4096)."""

    if not _contiguous(src):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        low = _load(context, builder, aryty, args[0], args[1], _I8, 32)
        low = builder.and_(builder.lshr(low, _splat(builder, builder.trunc(args[2], _I8), 32)),
                           _const_vec(_I8, [15] * 32))  # fmt: skip
        high = _load(context, builder, aryty, args[0], args[3], _I8, 32)
        high = builder.and_(builder.lshr(high, _splat(builder, builder.trunc(args[4], _I8), 32)),
                            _const_vec(_I8, [3] * 32))  # fmt: skip
        q = builder.or_(builder.zext(low, _CODES), builder.shl(builder.zext(high, _CODES), _const_vec(_I16, [4] * 32)))
        q = builder.sub(q, _const_vec(_I16, [32] * 32))
        s0 = _splat(builder, builder.trunc(args[5], _I16), 16)
        s1 = _splat(builder, builder.trunc(args[6], _I16), 16)
        return builder.mul(q, _concat(builder, s0, s1, 16))

    return codes_type(src, types.intp, types.intp, types.intp, types.intp, types.int64, types.int64), codegen


@intrinsic
def codes_load(typingctx, buf, at):
    """Codes stored by `codes_store` at buf[at] (int16 buffer)."""

    if not _contiguous(buf):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], _I16, 32)

    return codes_type(buf, types.intp), codegen


@intrinsic
def codes_store(typingctx, buf, at, codes):
    """Codes into buf[at .. at + 31] (int16 buffer)."""

    if not _contiguous(buf):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), _CODES.as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.none(buf, types.intp, codes_type), codegen


@intrinsic
def dot_acc(typingctx, acc, codes, x, xo, scale):
    """acc + scale * (codes . x[xo .. xo + 31]) spread over 8 lanes; x int16 activation codes."""

    if not _contiguous(x):
        return None

    def codegen(context, builder, sig, args):
        acc_v, codes_v, scale_v = args[0], args[1], args[4]
        xv = _load(context, builder, sig.args[2], args[2], args[3], _I16, 32)
        if HAS_AVX2:  # vpmaddwd on each half, named: LLVM's own match of it is poor here
            wd = ir.VectorType(_I16, 16)
            pmadd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VectorType(_I32, 8), [wd, wd]), "llvm.x86.avx2.pmadd.wd"
            )
            (c0, c1), (x0, x1) = _halves(builder, codes_v, 32), _halves(builder, xv, 32)
            total = builder.add(builder.call(pmadd, [c0, x0]), builder.call(pmadd, [c1, x1]))
        else:
            even, odd = _const_vec(_I32, range(0, 32, 2)), _const_vec(_I32, range(1, 32, 2))
            wide = ir.VectorType(_I32, 16)

            def half(idx):
                c = builder.sext(builder.shuffle_vector(codes_v, codes_v, idx), wide)
                y = builder.sext(builder.shuffle_vector(xv, xv, idx), wide)
                return builder.mul(c, y)

            lo, hi = _halves(builder, builder.add(half(even), half(odd)), 16)
            total = builder.add(lo, hi)
        total = builder.sitofp(total, _ACC)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_ACC, [_ACC] * 3), "llvm.fmuladd.v8f32")
        return builder.call(fmuladd, [total, _splat(builder, scale_v, 8), acc_v])

    return acc_type(acc_type, codes_type, x, types.intp, types.float32), codegen



@intrinsic
def codes_dequantize(typingctx, out, at, codes, scale, low):
    """out[at .. at + 31] = scale * codes + low (float32 buffer)."""
    if not _contiguous(out):
        return None

    def codegen(context, builder, sig, args):
        wide = ir.VectorType(_F32, 32)
        values = builder.sitofp(args[2], wide)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(wide, [wide] * 3), "llvm.fmuladd.v32f32")
        values = builder.call(fmuladd, [values, _splat(builder, args[3], 32), _splat(builder, args[4], 32)])
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.store(values, builder.bitcast(builder.gep(data, [args[1]]), wide.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(out, types.intp, codes_type, types.float32, types.float32), codegen
