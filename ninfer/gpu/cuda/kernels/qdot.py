"""Integer dot products of one weight block with one int8 activation block (`dp4a`).

`QDOT[qtype](qs, d16, aux, sc8, row, blk, xq, xs, m)` (and `WDOT[qtype]`, which takes the
activation block already loaded) is the float32 dot product of 32-element
block `blk` of weight `row` with block `blk` of activation row `m`. Activations are quantized
per 32-element block as in llama.cpp's Q8_1: `xq` holds int8 values (read here as uint32
words [M, cols / 4]) and `xs[m, 2 blk]` / `xs[m, 2 blk + 1]` hold the block scale `dx` and
`sx = dx * sum(xq)`. A block's weights are `scale * q (+ min)` with small integer q, so

    sum(w * x) = d_w * dx * sum(q * xq) (- offset * d_w * sx) (+ m_w * sx)

and the inner sum is eight `dp4a` instructions on packed bytes: a 4-bit weight costs about a
quarter of an integer instruction instead of the ~7 a float unpack-and-multiply needs.

The functions that load weights are built by `fns(evict_first)` (KernelPlan.evict_first: the
weight loads mark their L2 lines evict-first, or not), once per value.
"""

from __future__ import annotations

import functools

import attrs
from numba import float32, int32, uint32

from ninfer.gpu.cuda.kernels.dequant import LOW_NIBBLES, k4_scale_min, spread_bits4
from ninfer.gpu.cuda.kernels.intrinsics import device, dp4a, ld2_f32_pinned, ld4_u32, ld4_u32_pinned, ld4_u32_stream, ld_h2

_L = uint32(LOW_NIBBLES)


@device
def act8(xq, m, blk):
    """The activation block's eight int8x4 words (coherent loads: a predecessor's output, pdl.py)."""
    a0, a1, a2, a3 = ld4_u32_pinned(xq, m, 8 * blk)
    a4, a5, a6, a7 = ld4_u32_pinned(xq, m, 8 * blk + 4)
    return a0, a1, a2, a3, a4, a5, a6, a7


@device
def dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7):
    s = dp4a(w0, a0, 0)
    s = dp4a(w1, a1, s)
    s = dp4a(w2, a2, s)
    s = dp4a(w3, a3, s)
    s = dp4a(w4, a4, s)
    s = dp4a(w5, a5, s)
    s = dp4a(w6, a6, s)
    return dp4a(w7, a7, s)


@device
def act_block(xq, xs, m, blk):
    """Activation block `blk` of row m: eight int8x4 words, its scale dx and dx * sum(xq)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = act8(xq, m, blk)
    dx, sx = ld2_f32_pinned(xs, m, 2 * blk)
    return a0, a1, a2, a3, a4, a5, a6, a7, dx, sx


@device
def sub32(q):
    """Bytewise q - 32 (q bytes in 0..63) as signed bytes, without borrows between bytes."""
    h = uint32(0x80808080)
    return ((q | h) - uint32(0x20202020)) ^ h


@device
def q6_word(ql, qh, shift_l, shift_h):
    lo = (ql >> shift_l) & _L
    hi = (qh >> shift_h) & uint32(0x03030303)
    return sub32(lo | (hi << uint32(4)))


# -- loads first, arithmetic after: the one-row GEMV's split of a block dot product -------------
#
# `WLOAD[qtype](qs, d16, row, blk, W, S, i)` stores block `blk` of weight `row` in slot i of the
# register arrays W (quant words, WORDS[qtype] per slot) and S (two scales per slot); then
# `WCOMP[qtype](W, S, i, A, X, u)` is its dot product with activation slot u (A: eight words
# per slot, X: dx, sx per slot). The GEMV issues every load of an iteration before the first
# dp4a, so they are all in flight together. (WLOAD is `fns(evict_first).wload`.)

@device
def _nib_isum(W, i, A, u):
    four = uint32(4)
    w0, w1, w2, w3 = W[4 * i], W[4 * i + 1], W[4 * i + 2], W[4 * i + 3]
    return dot8(
        w0 & _L, w1 & _L, w2 & _L, w3 & _L,
        (w0 >> four) & _L, (w1 >> four) & _L, (w2 >> four) & _L, (w3 >> four) & _L,
        A[8 * u], A[8 * u + 1], A[8 * u + 2], A[8 * u + 3], A[8 * u + 4], A[8 * u + 5], A[8 * u + 6], A[8 * u + 7],
    )  # fmt: skip


@device
def wcomp_q4_0(W, S, i, A, X, u):
    return S[2 * i] * (X[2 * u] * float32(_nib_isum(W, i, A, u)) - float32(8.0) * X[2 * u + 1])


@device
def wcomp_q4_1(W, S, i, A, X, u):
    return S[2 * i] * X[2 * u] * float32(_nib_isum(W, i, A, u)) + S[2 * i + 1] * X[2 * u + 1]


@device
def wcomp_q8_0(W, S, i, A, X, u):
    s = dot8(
        W[8 * i], W[8 * i + 1], W[8 * i + 2], W[8 * i + 3], W[8 * i + 4], W[8 * i + 5], W[8 * i + 6], W[8 * i + 7],
        A[8 * u], A[8 * u + 1], A[8 * u + 2], A[8 * u + 3], A[8 * u + 4], A[8 * u + 5], A[8 * u + 6], A[8 * u + 7],
    )  # fmt: skip
    return S[2 * i] * X[2 * u] * float32(s)


WORDS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
WCOMP = {"Q4_0": wcomp_q4_0, "Q4_1": wcomp_q4_1, "Q8_0": wcomp_q8_0}
SPLIT_QTYPES = tuple(WORDS)  # the types with a split (loads first) path: WLOAD / WCOMP


@attrs.frozen
class Qdot:
    """The weight-loading device functions of one load flavour, by qtype: `wdot` (an activation
    block in registers), `qdot` (loads its activation block), `wload` (SPLIT_QTYPES only)."""

    wdot: dict
    qdot: dict
    wload: dict


@functools.cache
def fns(evict_first: bool = True) -> Qdot:
    """The weight-loading device functions, their 16-byte weight loads evict-first or plain."""
    ld4_w = ld4_u32_stream if evict_first else ld4_u32  # a weight load (16 bytes)

    @device
    def nib_words(qs, row, blk):
        """A 16-byte nibble block as eight words of bytes 0..15 (low nibbles first)."""
        w0, w1, w2, w3 = ld4_w(qs, row, 4 * blk)
        four = uint32(4)
        return (w0 & _L, w1 & _L, w2 & _L, w3 & _L,
                (w0 >> four) & _L, (w1 >> four) & _L, (w2 >> four) & _L, (w3 >> four) & _L)  # fmt: skip

    @device
    def q5_words(qs, aux, row, blk):
        """A Q5 block's eight words: nibbles plus the fifth bits from `aux`."""
        w0, w1, w2, w3 = ld4_w(qs, row, 4 * blk)
        h = uint32(aux[row, blk])
        four = uint32(4)
        f = uint32(0xF)
        return (
            (w0 & _L) | spread_bits4(h & f),
            (w1 & _L) | spread_bits4((h >> uint32(4)) & f),
            (w2 & _L) | spread_bits4((h >> uint32(8)) & f),
            (w3 & _L) | spread_bits4((h >> uint32(12)) & f),
            ((w0 >> four) & _L) | spread_bits4((h >> uint32(16)) & f),
            ((w1 >> four) & _L) | spread_bits4((h >> uint32(20)) & f),
            ((w2 >> four) & _L) | spread_bits4((h >> uint32(24)) & f),
            ((w3 >> four) & _L) | spread_bits4((h >> uint32(28)) & f),
        )

    # `wdot_*(qs, d16, aux, sc8, row, blk, a0..a7, dx, sx)`: the block's dot product with an
    # activation block already in registers (act_block), so one load serves several weight rows.

    @device
    def wdot_q4_0(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        w0, w1, w2, w3, w4, w5, w6, w7 = nib_words(qs, row, blk)
        s = dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7)
        return float32(d16[row, blk]) * (dx * float32(s) - float32(8.0) * sx)

    @device
    def wdot_q4_1(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        w0, w1, w2, w3, w4, w5, w6, w7 = nib_words(qs, row, blk)
        s = dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7)
        d, mn = ld_h2(d16, row, 2 * blk)
        return d * dx * float32(s) + mn * sx

    @device
    def wdot_q5_0(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        w0, w1, w2, w3, w4, w5, w6, w7 = q5_words(qs, aux, row, blk)
        s = dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7)
        return float32(d16[row, blk]) * (dx * float32(s) - float32(16.0) * sx)

    @device
    def wdot_q5_1(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        w0, w1, w2, w3, w4, w5, w6, w7 = q5_words(qs, aux, row, blk)
        s = dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7)
        d, mn = ld_h2(d16, row, 2 * blk)
        return d * dx * float32(s) + mn * sx

    @device
    def wdot_q8_0(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        w0, w1, w2, w3 = ld4_w(qs, row, 8 * blk)
        w4, w5, w6, w7 = ld4_w(qs, row, 8 * blk + 4)
        s = dot8(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7)
        return float32(d16[row, blk]) * dx * float32(s)

    @device
    def wdot_q4_k(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        sb = blk >> 3
        s = blk & 7
        base = 32 * sb + 8 * (s >> 1)
        shift = uint32(4 * (s & 1))
        w0, w1, w2, w3 = ld4_w(qs, row, base)
        w4, w5, w6, w7 = ld4_w(qs, row, base + 4)
        isum = dot8(
            (w0 >> shift) & _L, (w1 >> shift) & _L, (w2 >> shift) & _L, (w3 >> shift) & _L,
            (w4 >> shift) & _L, (w5 >> shift) & _L, (w6 >> shift) & _L, (w7 >> shift) & _L,
            a0, a1, a2, a3, a4, a5, a6, a7,
        )  # fmt: skip
        sc, mn = k4_scale_min(aux, row, sb, s)
        dk, mk = ld_h2(d16, row, 2 * sb)
        return dk * float32(sc) * dx * float32(isum) - mk * float32(mn) * sx

    @device
    def wdot_q6_k(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx):
        sb = blk >> 3
        s = blk & 7
        n = s >> 2
        g = s & 3
        l0, l1, l2, l3 = ld4_w(qs, row, 32 * sb + 16 * n + 8 * (g & 1))
        l4, l5, l6, l7 = ld4_w(qs, row, 32 * sb + 16 * n + 8 * (g & 1) + 4)
        h0, h1, h2, h3 = ld4_w(aux, row, 16 * sb + 8 * n)
        h4, h5, h6, h7 = ld4_w(aux, row, 16 * sb + 8 * n + 4)
        sl = uint32(4 * (g >> 1))
        sh = uint32(2 * g)
        lo = dp4a(q6_word(l0, h0, sl, sh), a0, 0)
        lo = dp4a(q6_word(l1, h1, sl, sh), a1, lo)
        lo = dp4a(q6_word(l2, h2, sl, sh), a2, lo)
        lo = dp4a(q6_word(l3, h3, sl, sh), a3, lo)
        hi = dp4a(q6_word(l4, h4, sl, sh), a4, 0)
        hi = dp4a(q6_word(l5, h5, sl, sh), a5, hi)
        hi = dp4a(q6_word(l6, h6, sl, sh), a6, hi)
        hi = dp4a(q6_word(l7, h7, sl, sh), a7, hi)
        isum = int32(sc8[row, 16 * sb + 2 * s]) * lo + int32(sc8[row, 16 * sb + 2 * s + 1]) * hi
        return float32(d16[row, sb]) * dx * float32(isum)

    wdot = {
        "Q4_0": wdot_q4_0, "Q4_1": wdot_q4_1, "Q5_0": wdot_q5_0, "Q5_1": wdot_q5_1,
        "Q8_0": wdot_q8_0, "Q4_K": wdot_q4_k, "Q6_K": wdot_q6_k,
    }  # fmt: skip

    def _make_qdot(wdot):
        @device
        def qdot(qs, d16, aux, sc8, row, blk, xq, xs, m):
            a0, a1, a2, a3, a4, a5, a6, a7, dx, sx = act_block(xq, xs, m, blk)
            return wdot(qs, d16, aux, sc8, row, blk, a0, a1, a2, a3, a4, a5, a6, a7, dx, sx)

        return qdot

    qdot = {q: _make_qdot(f) for q, f in wdot.items()}

    @device
    def wload_q4_0(qs, d16, row, blk, W, S, i):
        W[4 * i], W[4 * i + 1], W[4 * i + 2], W[4 * i + 3] = ld4_w(qs, row, 4 * blk)
        S[2 * i] = float32(d16[row, blk])

    @device
    def wload_q4_1(qs, d16, row, blk, W, S, i):
        W[4 * i], W[4 * i + 1], W[4 * i + 2], W[4 * i + 3] = ld4_w(qs, row, 4 * blk)
        S[2 * i], S[2 * i + 1] = ld_h2(d16, row, 2 * blk)

    @device
    def wload_q8_0(qs, d16, row, blk, W, S, i):
        W[8 * i], W[8 * i + 1], W[8 * i + 2], W[8 * i + 3] = ld4_w(qs, row, 8 * blk)
        W[8 * i + 4], W[8 * i + 5], W[8 * i + 6], W[8 * i + 7] = ld4_w(qs, row, 8 * blk + 4)
        S[2 * i] = float32(d16[row, blk])

    return Qdot(wdot=wdot, qdot=qdot, wload={"Q4_0": wload_q4_0, "Q4_1": wload_q4_1, "Q8_0": wload_q8_0})
