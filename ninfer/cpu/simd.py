"""Short-vector building blocks for the q8 kernels, written as LLVM vector IR (numba intrinsics).

LLVM's vectorizers do not turn numba's scalar block loops into the code a quantized dot wants:
the loop vectorizer never sees a 16- or 32-step loop (it is unrolled first), and the SLP
vectorizer gives up on any store it cannot prove apart from the loads (numba arrays may
alias), so per-block float accumulators stay scalar. These intrinsics say it in vectors
instead, in target-independent IR that LLVM lowers to whatever the host has; on AVX2 the
integer dot is llama.cpp's CPU sequence, named: `vpmaddubsw` (unsigned bytes x signed bytes,
pairs summed to int16), `vpmaddwd` (pairs to int32), `vcvtdq2ps` + `vfmadd`.

* `Codes` (<32 x i8>): the 32 integer codes of one weight block, built by the `codes_*`
  readers from the stored bytes (`blocks.py` says which bytes each type keeps where).
  Unsigned for the 4- and 5-bit types (0 .. 31: Q4_0 / Q5_0's offset goes into the block's
  additive term), signed for Q8_0 and Q6_K (-128 .. 127; Q6_K's q - 32).
* `Acc` (<8 x float>): a row's running sum; lanes 0-3 gather weights 0-15 of every block,
  lanes 4-7 weights 16-31 (so a block may scale its halves apart: Q6_K's per-16 scales).
  `acc_sum` adds the lanes once per row.

`dot_u8` / `dot_s8`(acc, codes, x, xo, s_lo, s_hi) = acc + the 32 products codes_j x[xo + j]
(x: int8 activation codes), summed in integers within each half-block, the first half scaled
by s_lo and the second by s_hi. The integer sums are exact (|code x| <= 128 x 127, pairs fit
int16), so the result differs from the scalar dot only by float rounding of the sums over
blocks. `half` reads a stored fp16 scale with the host's conversion (F16C), else a table.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

# x86 with AVX2 gets vpmaddubsw / vpmaddwd / vpsignb by name; elsewhere the same sums in
# generic IR. fp16 -> float32 through `fpext half` needs the F16C instructions (else LLVM emits
# a library call numba's JIT may not link). Both follow the host CPU, which numba's cache
# index already keys on.
_FEATURES = llvm_binding.get_host_cpu_features()
HAS_AVX2 = bool(_FEATURES.get("avx2", False))
HAS_F16C = bool(_FEATURES.get("f16c", False))
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_CODES = ir.VectorType(_I8, 32)
_ACC = ir.VectorType(_F32, 8)


class _CodesType(types.Type):
    def __init__(self):
        super().__init__(name="Codes32xi8")


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


def _pair(builder, lo, hi, n):
    """<n x float>: lo in the first half of the lanes, hi in the second."""
    vec = ir.VectorType(_F32, n)
    two = builder.insert_element(ir.Constant(vec, ir.Undefined), lo, ir.Constant(_I32, 0))
    two = builder.insert_element(two, hi, ir.Constant(_I32, 1))
    return builder.shuffle_vector(two, ir.Constant(vec, ir.Undefined), _const_vec(_I32, [0] * (n // 2) + [1] * (n // 2)))


def _contiguous(*arrays):
    """Typing guard: the loads read raw memory from the data pointer, so only C arrays."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


def _pointer(context, builder, aryty, ary, offset, elem):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), elem.as_pointer())


def _load(context, builder, aryty, ary, offset, elem, n):
    """<n x elem> from array `ary` (1-D) starting at element `offset` (unaligned)."""
    return builder.load(_pointer(context, builder, aryty, ary, offset, ir.VectorType(elem, n)), align=1)


def _halves(builder, vec, n):
    """(first half, second half) of an n-lane vector."""
    undef = ir.Constant(vec.type, ir.Undefined)
    lo = builder.shuffle_vector(vec, undef, _const_vec(_I32, range(n // 2)))
    hi = builder.shuffle_vector(vec, undef, _const_vec(_I32, range(n // 2, n)))
    return lo, hi


def _concat(builder, a, b, n):
    return builder.shuffle_vector(a, b, _const_vec(_I32, range(2 * n)))


def _x86(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def _pairs_summed(builder, v, n):
    """<n/2 x i32>: lane k = v[2k] + v[2k + 1] (v <n x i32>)."""
    even = builder.shuffle_vector(v, v, _const_vec(_I32, range(0, n, 2)))
    odd = builder.shuffle_vector(v, v, _const_vec(_I32, range(1, n, 2)))
    return builder.add(even, odd)


@intrinsic
def acc_zero(typingctx):
    """An `Acc` of zeros."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_ACC, [ir.Constant(_F32, 0.0)] * 8)

    return acc_type(), codegen


@intrinsic
def acc_add(typingctx, a, b):
    """a + b, lane by lane."""

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return acc_type(acc_type, acc_type), codegen


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
def half(typingctx, src, at, table):
    """The fp16 value whose two bytes start at src[at] (uint8 array), as float32: F16C's
    conversion where the host has it, else table[bits] (a 65,536-entry float32 table)."""

    if not _contiguous(src, table):
        return None

    def codegen(context, builder, sig, args):
        if HAS_F16C:
            bits = builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], ir.HalfType()), align=1)
            return builder.fpext(bits, _F32)
        bits = builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], _I16), align=1)
        return builder.load(builder.gep(context.make_array(sig.args[2])(context, builder, args[2]).data,
                                        [builder.zext(bits, ir.IntType(64))]))  # fmt: skip

    return types.float32(src, types.intp, table), codegen


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
        return _concat(builder, lo, hi, 16)

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
        return builder.and_(builder.lshr(b, s), _const_vec(_I8, [15] * 32))

    return codes_type(src, types.intp, types.intp), codegen


@intrinsic
def codes_int8(typingctx, src, at):
    """Codes of 32 int8 weights starting at src[at] (Q8_0)."""

    if not _contiguous(src):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], _I8, 32)

    return codes_type(src, types.intp), codegen


@intrinsic
def codes_fifth_bits(typingctx, codes, high):
    """Codes with bit j of the 32-bit `high` set as bit 4 of code j (Q5_0 / Q5_1): byte j / 8
    of `high` spread to lanes 8 (j / 8) .. + 7, each lane testing its own bit."""

    def codegen(context, builder, sig, args):
        four = builder.bitcast(builder.trunc(args[1], _I32), ir.VectorType(_I8, 4))
        spread = builder.shuffle_vector(four, ir.Constant(four.type, ir.Undefined), _const_vec(_I32, [j // 8 for j in range(32)]))
        bit = builder.and_(spread, _const_vec(_I8, [1 << (j % 8) for j in range(32)]))
        set_ = builder.icmp_unsigned("!=", bit, ir.Constant(_CODES, [ir.Constant(_I8, 0)] * 32))
        return builder.or_(args[0], builder.select(set_, _const_vec(_I8, [16] * 32), _const_vec(_I8, [0] * 32)))

    return codes_type(codes_type, types.int64), codegen


@intrinsic
def codes_q6k(typingctx, src, low_at, low_shift, high_at, high_shift):
    """Q6_K codes q - 32 (signed): q = low nibble | 2 high bits << 4, the low nibble at bit
    `low_shift` of byte src[low_at + j], the high bits at bit `high_shift` of src[high_at + j]."""

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
        q = builder.or_(low, builder.shl(high, _const_vec(_I8, [4] * 32)))
        return builder.sub(q, _const_vec(_I8, [32] * 32))

    return codes_type(src, types.intp, types.intp, types.intp, types.intp), codegen


@intrinsic
def codes_load(typingctx, buf, at):
    """Codes stored by `codes_store` at buf[at] (int8 or uint8 buffer)."""

    if not _contiguous(buf):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], _I8, 32)

    return codes_type(buf, types.intp), codegen


@intrinsic
def codes_store(typingctx, buf, at, codes):
    """Codes into buf[at .. at + 31] (int8 or uint8 buffer)."""

    if not _contiguous(buf):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _pointer(context, builder, sig.args[0], args[0], args[1], _CODES), align=1)
        return context.get_dummy_value()

    return types.none(buf, types.intp, codes_type), codegen


def _block_dot(builder, codes, x, signed):
    """<8 x i32>: lane k = codes . x over weights 4k .. 4k + 3 (codes <32 x i8>, signed or
    not; x <32 x i8> signed)."""
    if HAS_AVX2:
        if signed:  # vpmaddubsw wants its first operand unsigned: |w| . (x with w's sign)
            x = _x86(builder, "llvm.x86.avx2.psign.b", _CODES, x, codes)
            codes = _x86(builder, "llvm.x86.avx2.psign.b", _CODES, codes, codes)
        pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), codes, x)
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), pairs, _const_vec(_I16, [1] * 16))
    wide = ir.VectorType(_I32, 32)
    c = builder.sext(codes, wide) if signed else builder.zext(codes, wide)
    products = builder.mul(c, builder.sext(x, wide))
    return _pairs_summed(builder, _pairs_summed(builder, products, 32), 16)


def _make_dot(signed):
    def dot(typingctx, acc, codes, x, xo, s_lo, s_hi):
        if not _contiguous(x):
            return None

        def codegen(context, builder, sig, args):
            xv = _load(context, builder, sig.args[2], args[2], args[3], _I8, 32)
            total = builder.sitofp(_block_dot(builder, args[1], xv, signed), _ACC)
            fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_ACC, [_ACC] * 3), "llvm.fmuladd.v8f32")
            return builder.call(fmuladd, [total, _pair(builder, args[4], args[5], 8), args[0]])

        return acc_type(acc_type, codes_type, x, types.intp, types.float32, types.float32), codegen

    dot.__doc__ = f"acc + the block dot of ({'signed' if signed else 'unsigned'}) codes with x[xo .. xo + 31] (int8)."
    return intrinsic(dot)


dot_u8, dot_s8 = _make_dot(False), _make_dot(True)


def _make_dequantize(signed):
    def dequantize(typingctx, out, at, codes, s_lo, s_hi, low):
        if not _contiguous(out):
            return None

        def codegen(context, builder, sig, args):
            wide = ir.VectorType(_F32, 32)
            values = (builder.sitofp if signed else builder.uitofp)(args[2], wide)
            values = builder.fmul(values, _pair(builder, args[3], args[4], 32))
            values = builder.fadd(values, _splat(builder, args[5], 32))
            builder.store(values, _pointer(context, builder, sig.args[0], args[0], args[1], wide), align=1)
            return context.get_dummy_value()

        return types.none(out, types.intp, codes_type, types.float32, types.float32, types.float32), codegen

    dequantize.__doc__ = "out[at .. at + 31] = codes * (s_lo for the first 16, s_hi for the rest) + low."
    return intrinsic(dequantize)


dequantize_u8, dequantize_s8 = _make_dequantize(False), _make_dequantize(True)
