"""Every kernel against its numpy reference, at a chosen scale (the checks the tests run).

`tiny` shapes run under numba's CUDA simulator on any machine (tests/test_cuda_kernels.py
runs them in a child process with NUMBA_ENABLE_CUDASIM=1); `real` shapes run on a GPU
(tests/cuda/test_kernels_gpu.py), where the paths the simulator cannot take run: warp
shuffles, dp4a, 16-byte loads, mma.sync. Each check draws fresh random inputs, poisons its
outputs and raises AssertionError with the worst error when a kernel disagrees with its
reference.

    python tests/cuda/kernel_checks.py tiny|real [name ...]   # prints {name: "ok" | traceback}
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback

import numpy as np
from numba import cuda

from ninfer.gpu.cuda import pages
from ninfer.gpu.cuda.device_weights import host_weight, upload_weight
from ninfer.gpu.cuda.kernels import (
    act_quant, attn_decode, attn_lp, attn_prefill, dequant, embed, flash, gemm, gemv, gemv_folds, norm, rope, sampler,
    swiglu,
)
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.gpu.cuda.kernels.qdot import SPLIT_QTYPES
from ninfer.gpu.cuda.plan import EPILOGUES, FOLDS, KernelPlan
from ninfer.gpu.cuda.kernels.quant_layout import DEVICE_QTYPES, pack_tensor, random_stored
from ninfer.models.spec import ModelSpec

QUANT = [q for q in DEVICE_QTYPES if q not in gemv.FLOAT_QTYPES]
POISON = np.float32(np.nan)


def _dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def _poisoned(shape, dtype=np.float32):
    fill = POISON if np.dtype(dtype).kind == "f" else np.iinfo(dtype).max
    return cuda.to_device(np.full(shape, fill, dtype))


def _weight(packed):
    return host_weight(packed) if SIMULATOR else upload_weight(packed)


def _close(got, want, rtol, name, atol=0.0):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != {want.shape}")
    if not np.isfinite(got).all():
        raise AssertionError(f"{name}: {int((~np.isfinite(got)).sum())} non-finite (unwritten?) outputs")
    err = np.abs(got - want).max()
    scale = np.abs(want).max() + 1e-30
    if err > rtol * scale + atol:
        raise AssertionError(f"{name}: max error {err:.3g} vs max |ref| {scale:.3g} (rtol {rtol})")


def _cols(qtype, tiny):
    if qtype in ("Q4_K", "Q6_K"):
        return 256 if tiny else 4096
    return 64 if tiny else 4096


# -- weights ----------------------------------------------------------------------------------


def check_dequantize_rows(scale, rng):
    for q in DEVICE_QTYPES:
        t = random_stored(q, 3 if scale == "tiny" else 512, _cols(q, scale == "tiny"), rng)
        out = _poisoned(t.shape)
        dequant.dequantize_rows(_weight(pack_tensor(t)), out)
        _close(out.copy_to_host(), t.dequantize(), 0.0, f"dequantize {q}")


def check_embed(scale, rng):
    for q in DEVICE_QTYPES:
        cols = _cols(q, scale == "tiny")
        t = random_stored(q, 40 if scale == "tiny" else 4096, cols, rng)
        toks = rng.integers(0, t.shape[0], 5 if scale == "tiny" else 300).astype(np.int32)
        fed = rng.integers(0, t.shape[0], toks.size).astype(np.int32)
        toks[1::2] = embed.FED  # these tokens are the sampler's, in fed
        out = _poisoned((toks.size, cols))
        embed.embed(_weight(pack_tensor(t)), _dev(toks), _dev(fed), out, toks.size)
        want = embed.embed_ref(t.dequantize(), toks, fed)
        _close(want[1::2], t.dequantize()[fed[1::2]], 0.0, f"embed_ref {q}: FED rows")
        _close(out.copy_to_host(), want, 0.0, f"embed {q}")


# -- linears ----------------------------------------------------------------------------------


def _gemv_case(q, mode, lanes, num_m, rows, rng, tiny, shape=None, split=None):
    cols = _cols(q, tiny)
    t = random_stored(q, rows, cols, rng)
    x = rng.standard_normal((num_m, cols)).astype(np.float32)
    res = rng.standard_normal((num_m, rows)).astype(np.float32)
    out = _poisoned((num_m, rows))
    w = _weight(pack_tensor(t))
    if mode == "q8":
        xq, xs = act_quant.quantize_q8_ref(x)
        gemv.gemv(w, _dev(xq.view(np.uint32)), _dev(xs), out, _dev(res), num_m, "q8", lanes=lanes, shape=shape,
                  split=split)  # fmt: skip
        want = gemv.gemv_q8_ref(t.dequantize(), xq, xs, res)
    else:
        gemv.gemv(w, _dev(x), _dev(np.zeros((1, 1), np.float32)), out, None, num_m, "f32", lanes=lanes)
        want = gemv.gemv_ref(t.dequantize(), x, None)
    _close(out.copy_to_host(), want, 2e-5, f"gemv {mode} {q} lanes {lanes} m {num_m} shape {shape} split {split}")


def check_gemv_q8(scale, rng):
    tiny = scale == "tiny"
    for i, q in enumerate(QUANT):
        for lanes in (8, 16, 32) if not tiny else ((8, 16, 32)[i % 3],):
            for num_m in (1, 11) if tiny else (1, 4, 8, 64):
                _gemv_case(q, "q8", lanes, num_m, 5 if tiny else 3000, rng, tiny)
        # one activation row, several weight rows per lane group (row count not a multiple)
        for lanes, shape in ((((8, 16, 32)[i % 3], (2, 4)),) if tiny else ((32, (2, 4)), (16, (2, 4)), (32, (4, 2)), (32, (2, 8)))):
            _gemv_case(q, "q8", lanes, 1, 5 if tiny else 3001, rng, tiny, shape)
        if q in SPLIT_QTYPES:  # one weight row per group through the split loop (KernelPlan.one_row_split)
            _gemv_case(q, "q8", 32 if not tiny else (8, 16, 32)[i % 3], 1, 5 if tiny else 3001, rng, tiny, (1, 4), True)


def check_gemv_fused(scale, rng):
    """RMSNorm / SwiGLU + int8 quantization folded into the one-row GEMV, against the separate
    kernels' references chained (an int8 code may differ by one where r's last bit differs).
    Real widths: SmolLM2's 576 / 1536 and the 8B's 4096 / 14336 (several quads a thread,
    several GEMV iterations after the prologue)."""
    tiny = scale == "tiny"
    for i, q in enumerate(("Q4_0", "Q4_1", "Q8_0")):
        for j, prologue in enumerate(("norm", "swiglu")):
            cols = (64, 320)[j] if tiny else ((576, 4096, 576), (1536, 14336, 4096))[j][i]
            rows = 5 if tiny else 961
            t = random_stored(q, rows, cols, rng)
            w = _weight(pack_tensor(t))
            width = cols if prologue == "norm" else 2 * cols
            src = (rng.standard_normal((2, width)) * 3).astype(np.float32)
            nw = (1 + 0.1 * rng.standard_normal((1, cols))).astype(np.float32)
            # as in forward.py: the residual add on the down projection only
            res = rng.standard_normal((1, rows)).astype(np.float32) if prologue == "swiglu" else None
            out = _poisoned((1, rows))
            lanes = (8, 16, 32)[i] if tiny and j == 0 else None  # tiny swiglu: 2 lanes, 2 iterations
            gemv_folds.gemv_fused(w, _dev(src), _dev(nw), 1e-5, out, None if res is None else _dev(res), prologue,
                                  lanes=lanes)  # fmt: skip
            want = gemv_folds.gemv_fused_ref(t.dequantize(), src, nw, 1e-5, res, prologue)
            _close(out.copy_to_host(), want, 2e-3, f"gemv_fused {prologue} {q}")


def check_gemv_epilogue(scale, rng):
    """gemv_swiglu (h = silu(gate) * up from paired rows, quantized) against the q8 GEMV's
    product through swiglu_ref (codes may differ by one on a rounding boundary), and gemv_rope
    (`_check_gemv_rope`, the same); both also with the weights' plain L2 policy
    (KernelPlan.evict_first off)."""
    tiny = scale == "tiny"
    for i, q in enumerate(("Q4_0", "Q4_1", "Q8_0")):
        # tiny Q8_0: rows of WIDE_BLOCKS int8 blocks, so gemv_swiglu takes plan.swiglu_wide_unroll there too
        cols = (64, 64, 32 * gemv.WIDE_BLOCKS)[i] if tiny else (4096, 14336, 4096)[i]
        f = (64, 64, 32)[i] if tiny else 2048
        t = random_stored(q, 2 * f, cols, rng)
        w = _weight(pack_tensor(t))
        for rep in range(2):
            plan = KernelPlan(evict_first=rep == 0)
            x = (rng.standard_normal((2, cols)) * 3).astype(np.float32)
            xq, xs = act_quant.quantize_q8_ref(x[:1])
            hq, hs = _poisoned((1, f), np.int8), _poisoned((1, f // 16))
            gemv_folds.gemv_swiglu(w, _dev(xq.view(np.uint32)), _dev(xs), hq, hs, plan=plan)
            want_q, want_s = gemv_folds.gemv_swiglu_ref(t.dequantize(), xq, xs)
            _check_q8(hq.copy_to_host(), hs.copy_to_host(), want_q, want_s, f"gemv_swiglu {q} ({rep})")
        _check_gemv_rope(q, tiny, rng, has_bias=i == 1, plan=KernelPlan(evict_first=i != 2))


def _check_gemv_rope(q, tiny, rng, has_bias, plan):
    """gemv_rope against the q8 GEMV's product through rope.qkv_post_ref: q, and the pools with
    the token's K / V at (page, slot) and nothing else changed (float32 pools)."""
    from ninfer.gpu.reference import rope_angles

    spec = _spec("tiny" if tiny else "real", num_heads=4 if tiny else 32, num_kv_heads=2 if tiny else 8,
                 head_dim=32 if tiny else 128)  # fmt: skip
    cols = 64 if tiny else 4096
    rows = spec.q_dim + 2 * spec.kv_dim
    t = random_stored(q, rows, cols, rng)
    xq, xs = act_quant.quantize_q8_ref(rng.standard_normal((1, cols)).astype(np.float32))
    bias = rng.standard_normal(rows).astype(np.float32) if has_bias else None
    cos, sin = rope_angles(spec, np.arange(spec.max_context))
    pos, page, slot = np.array([spec.max_context - 3], np.int32), np.array([2], np.int32), np.array([1], np.int32)
    pools = [rng.standard_normal((4, 4, spec.num_kv_heads, spec.head_dim)).astype(np.float32) for _ in range(2)]
    d_k, d_v = _dev(pools[0]), _dev(pools[1])
    q_out = _poisoned((2, spec.q_dim))
    gemv_folds.gemv_rope(spec, _weight(pack_tensor(t)), _dev(xq.view(np.uint32)), _dev(xs),
                         None if bias is None else _dev(bias), _dev(cos), _dev(sin), _dev(pos), _dev(page), _dev(slot),
                         q_out, d_k, d_v, plan=plan)  # fmt: skip
    qkv = gemv.gemv_q8_ref(t.dequantize(), xq, xs, None).astype(np.float32)
    want_q, want_k, want_v = rope.qkv_post_ref(spec, qkv, bias, None, None, cos, sin, pos)
    _close(q_out.copy_to_host()[:1], want_q, 2e-5, f"gemv_rope {q} q")
    for name, got, old, want in (("k", d_k, pools[0], want_k), ("v", d_v, pools[1], want_v)):
        old = old.copy()
        old[page[0], slot[0]] = want[0]
        _close(got.copy_to_host(), old, 2e-5, f"gemv_rope {q} {name} pool")


def check_gemv_f32(scale, rng):
    tiny = scale == "tiny"
    for i, q in enumerate(DEVICE_QTYPES):
        for lanes in ((8, 32)[i % 2],) if tiny else (8, 32):
            for num_m in (2,) if tiny else (1, 5):
                _gemv_case(q, "f32", lanes, num_m, 3 if tiny else 2000, rng, tiny)


def check_gemm(scale, rng):
    tiny = scale == "tiny"
    kinds = ("Q4_1", "Q6_K", "BF16") if tiny else DEVICE_QTYPES
    for q in kinds:
        m, n = (3, 70) if tiny else (300, 1000)
        t = random_stored(q, n, _cols(q, tiny), rng)
        x = rng.standard_normal((m, t.shape[1])).astype(np.float32)
        res = rng.standard_normal((m, n)).astype(np.float32)
        out = _dev(res)
        gemm.gemm(_weight(pack_tensor(t)), _dev(x), out, out, m)
        _close(out.copy_to_host(), gemm.gemm_ref(t.dequantize(), x, res), 1e-4, f"gemm {q}")
    # every tile: M and N not multiples of the tile, an odd number of K
    # blocks (the pipelined kernels' half-empty last step), res aliasing out or none; rows past
    # num_m of x are NaN (must not be read) and of out must stay as they were
    m, n, k = (37, 70, 96) if tiny else (300, 1000, 4000)
    t = random_stored("Q4_1", n, k, rng)
    w = _weight(pack_tensor(t))
    x = rng.standard_normal((m + 3, k)).astype(np.float32)
    x[m:] = np.nan
    for i, tile in enumerate(gemm.TILES):
        with_res = i % 2 == 0
        res = rng.standard_normal((m + 3, n)).astype(np.float32)
        out = _dev(res)
        gemm.gemm(w, _dev(x), out, out if with_res else None, m, tile=tile)
        got = out.copy_to_host()
        want = gemm.gemm_ref(t.dequantize(), x[:m], res[:m] if with_res else None)
        _close(got[:m], want, 1e-4, f"gemm tile {tile} res {with_res}")
        if not np.array_equal(got[m:], res[m:]):
            raise AssertionError(f"gemm tile {tile}: rows past num_m written")


# -- elementwise and norms ------------------------------------------------------------------------


def check_rmsnorm(scale, rng):
    for d in (96, 320) if scale == "tiny" else (576, 4096, 8192):  # one and two column chunks per thread
        _rmsnorm_case(3 if scale == "tiny" else 200, d, rng)


def _rmsnorm_case(t_rows, d, rng):
    x = rng.standard_normal((t_rows, d)).astype(np.float32) * 3
    res = rng.standard_normal((t_rows, d)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    rows = np.array([2, 0], np.int32)
    for mode in ("f32", "q8"):
        for with_res, with_rows in ((True, False), (False, True)):
            dx = _dev(x)
            n = rows.size if with_rows else t_rows
            out = _poisoned((n, d), np.float32 if mode == "f32" else np.int8)
            xs = _poisoned((n, 2 * d // 32))
            norm.rmsnorm(dx, _dev(res), _dev(w), 1e-5, _dev(rows), out, xs, n, mode, with_res, with_rows)
            ref = norm.rmsnorm_ref(x, res if with_res else None, w, 1e-5, rows if with_rows else None, mode)
            _close(dx.copy_to_host(), ref[0], 1e-6, "rmsnorm residual")
            if mode == "f32":
                _close(out.copy_to_host(), ref[1], 1e-5, "rmsnorm f32")
            else:
                _check_q8(out.copy_to_host(), xs.copy_to_host(), ref[1], ref[2], "rmsnorm q8")


def _check_q8(xq, xs, want_q, want_s, name):
    """int8 codes may differ by one where x / dx sits on a rounding boundary."""
    diff = np.abs(xq.astype(np.int32) - want_q.astype(np.int32))
    if diff.max() > 1 or (diff > 0).mean() > 0.01:
        raise AssertionError(f"{name}: {int((diff > 0).sum())} codes differ, max {diff.max()}")
    _close(xs[:, 0::2], want_s[:, 0::2], 1e-5, f"{name} scales")


def check_quantize_rows(scale, rng):
    m, d = (2, 96) if scale == "tiny" else (100, 14336)
    x = (rng.standard_normal((m, d)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    xq, xs = _poisoned((m, d), np.int8), _poisoned((m, 2 * d // 32))
    act_quant.quantize_rows(_dev(x), xq, xs, m, d)
    _check_q8(xq.copy_to_host(), xs.copy_to_host(), *act_quant.quantize_q8_ref(x), "quantize_rows")


def check_swiglu(scale, rng):
    t_rows, f = (2, 64) if scale == "tiny" else (100, 14336)
    gu = (rng.standard_normal((t_rows, 2 * f)) * 4).astype(np.float32)
    out = _poisoned((t_rows, f))
    swiglu.swiglu(_dev(gu), out, _poisoned((1, 1)), t_rows, "f32")
    _close(out.copy_to_host(), swiglu.swiglu_ref(gu, "f32"), 1e-5, "swiglu f32")
    xq, xs = _poisoned((t_rows, f), np.int8), _poisoned((t_rows, 2 * f // 32))
    swiglu.swiglu(_dev(gu), xq, xs, t_rows, "q8")
    _check_q8(xq.copy_to_host(), xs.copy_to_host(), *swiglu.swiglu_ref(gu, "q8"), "swiglu q8")


# -- attention ----------------------------------------------------------------------------------


def _spec(scale, **kw):
    base = dict(arch="llama", num_layers=1, d_model=64, d_ffn=64, num_heads=4, num_kv_heads=2, head_dim=32,
                vocab_size=64, max_context=64)  # fmt: skip
    if scale != "tiny":
        base.update(d_model=1024, num_heads=16, num_kv_heads=8, head_dim=128, max_context=8192)
    base.update(kw)
    return ModelSpec(**base)


def check_qkv_post(scale, rng):
    from ninfer.gpu.reference import rope_angles

    for arch, kw, kv_t, inter in (
        ("llama", {}, np.float16, False),
        ("qwen2", dict(has_qkv_bias=True), np.float32, False),
        ("qwen3", dict(has_qk_norm=True), np.float16, False),
        ("llama", {}, np.float32, True),
    ):
        spec = _spec(scale, arch=arch, **kw)
        t_rows = 3 if scale == "tiny" else 64
        qkv = rng.standard_normal((t_rows, spec.q_dim + 2 * spec.kv_dim)).astype(np.float32)
        bias = rng.standard_normal(qkv.shape[1]).astype(np.float32) if spec.has_qkv_bias else None
        qn, kn = ((1 + 0.1 * rng.standard_normal((2, spec.head_dim))).astype(np.float32) if spec.has_qk_norm else (None, None))
        pos = rng.integers(0, spec.max_context, t_rows).astype(np.int32)
        num_pages = 2 * t_rows + 2
        page = rng.permutation(num_pages)[:t_rows].astype(np.int32)
        slot = rng.integers(0, 4, t_rows).astype(np.int32)
        cos, sin = rope_angles(spec, np.arange(spec.max_context))
        kc = _dev(np.zeros((num_pages, 4, spec.num_kv_heads, spec.head_dim), kv_t))
        vc = _dev(np.zeros((num_pages, 4, spec.num_kv_heads, spec.head_dim), kv_t))
        q_out = _poisoned((t_rows, spec.q_dim))
        f1 = np.zeros(1, np.float32)
        rope.qkv_post(spec, _dev(qkv), _dev(bias if bias is not None else f1), _dev(qn if qn is not None else f1),
                      _dev(kn if kn is not None else f1), _dev(cos), _dev(sin), _dev(pos), _dev(page), _dev(slot), q_out,
                      kc, vc, t_rows, bias is not None, qn is not None, interleaved=inter)  # fmt: skip
        q, k, v = rope.qkv_post_ref(spec, qkv, bias, qn, kn, cos, sin, pos, inter)
        tol = 1e-5 if kv_t == np.float32 else 2e-3
        _close(q_out.copy_to_host(), q, 1e-5, f"qkv_post q {arch}")
        _close(kc.copy_to_host()[page, slot], k, tol, f"qkv_post k {arch}")
        _close(vc.copy_to_host()[page, slot], v, tol, f"qkv_post v {arch}")


def _paged_case(spec, scale, rng, lengths, kv_t, page_size):
    """Random K/V for rows of given context lengths, scattered over shuffled pages. Table entries
    past a row's pages hold a page id far past the pool (as stale entries may in the runner's
    buffers): a kernel that loads through them without masking faults (the simulator raises)."""
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + 2
    ids = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((len(lengths), max(pages_per) + 1), 1 << 24, np.int32)
    o = 0
    for r, n in enumerate(pages_per):
        tables[r, :n] = ids[o : o + n]
        o += n
    shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    kc = rng.standard_normal(shape).astype(kv_t)
    vc = rng.standard_normal(shape).astype(kv_t)

    def context(r):
        flat = lambda c: c[tables[r, : pages_per[r]]].reshape(-1, spec.num_kv_heads, spec.head_dim)[: lengths[r]]  # noqa: E731
        return flat(kc), flat(vc)

    return tables, kc, vc, context


def check_attn_decode(scale, rng):
    """Split + combine, and the one-launch kernel (both output modes, a few warp / chunk shapes:
    several chunks per row, lane groups of 4 (head_dim 32), 8 (64) and 16 (128) lanes), then
    lanes over positions (`_check_decode_lp`)."""
    tiny = scale == "tiny"
    for group, kv_t, mode, hd in ((2, np.float32, "f32", 32 if tiny else 128), (3, np.float16, "q8", 64)):
        spec = _spec(scale, num_heads=2 * group if tiny else 8 * group, num_kv_heads=2 if tiny else 8, head_dim=hd)
        split = 8 if tiny else 256
        lengths = [1, 13, 21, 40] if tiny else [1, 300, 4000, 8192]
        tables, kc, vc, context = _paged_case(spec, scale, rng, lengths, kv_t, 4 if tiny else 16)
        q = rng.standard_normal((len(lengths), spec.q_dim)).astype(np.float32)
        max_splits = -(-max(lengths) // split)
        o_part = _poisoned((len(lengths), spec.num_heads, max_splits, spec.head_dim))
        ml = _poisoned((len(lengths), spec.num_heads, max_splits, 2))
        args = (_dev(q), _dev(kc), _dev(vc), _dev(tables), _dev(np.array(lengths, np.int32)))
        want = np.concatenate([
            attn_decode.attention_ref(q[r : r + 1], *context(r), [n - 1], group, spec.head_dim)
            for r, n in enumerate(lengths)
        ])  # fmt: skip
        out, xs = _attn_out(spec, len(lengths), mode)
        attn_decode.attn_decode(spec, *args, o_part, ml, out, xs, len(lengths), split, mode)
        _check_attn(out, xs, want, mode, f"attn_decode g{group}")
        _check_decode_lp(spec, q, args, want, len(lengths), max(lengths), group)
        for warps, ch in ((2, 1), (4, 2)) if tiny else ((None, None), (16, 1), (4, 4)):
            for m in ("f32", "q8"):
                out, xs = _attn_out(spec, len(lengths), m)
                attn_decode.attn_decode_one(spec, *args, out, xs, len(lengths), m, warps=warps, ch=ch)
                _check_attn(out, xs, want, m, f"attn_decode_one g{group} hd{hd} warps {warps} ch {ch}")
    # lanes over positions at head_dim 128 (two warps a split, columns split between them),
    # several splits whose positions span several pages; at the real scale also the 8B's
    # shape over short contexts
    cases = [(2, [70, 5, 33] if tiny else [1, 300, 4000, 8192])] + ([] if tiny else [(8, [1, 100, 200, 256])])
    for kv_heads, lengths in cases:
        spec = _spec(scale, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=128)
        tables, kc, vc, context = _paged_case(spec, scale, rng, lengths, np.float16, 4 if tiny else 16)
        q = rng.standard_normal((len(lengths), spec.q_dim)).astype(np.float32)
        args = (_dev(q), _dev(kc), _dev(vc), _dev(tables), _dev(np.array(lengths, np.int32)))
        want = np.concatenate([attn_decode.attention_ref(q[r : r + 1], *context(r), [n - 1], 4, 128)
                               for r, n in enumerate(lengths)])  # fmt: skip
        _check_decode_lp(spec, q, args, want, len(lengths), max(lengths), 4)


def _check_decode_lp(spec, q, args, want, rows, longest, group):
    """attn_lp.attn_decode_lp (splits of 32, one position a lane) in both output modes, with
    and without the K / V loads before the grid dependency wait, and once with the page size
    read at run time (divisions) instead of compiled in (shifts and masks)."""
    splits = -(-longest // attn_lp.LP_SPLIT)
    for m, pre, const in (("f32", False, True), ("q8", False, True), ("f32", True, True), ("q8", True, True),
                          ("q8", True, False)):  # fmt: skip
        plan = KernelPlan(lp_preload=pre, lp_const_page=const)  # K / V before the PDL wait, the newest position after
        o_part = _poisoned((rows, spec.num_heads, splits, spec.head_dim))
        ml = _poisoned((rows, spec.num_heads, splits, 2))
        out, xs = _attn_out(spec, rows, m)
        attn_lp.attn_decode_lp(spec, *args, o_part, ml, out, xs, rows, m, plan=plan)
        _check_attn(out, xs, want, m, f"attn_decode_lp g{group} hd{spec.head_dim} {m} preload {pre} "
                                      f"page size compiled in {const}")  # fmt: skip


def _attn_out(spec, rows, mode):
    out = _poisoned((rows, spec.q_dim), np.float32 if mode == "f32" else np.int8)
    return out, _poisoned((rows, 2 * spec.q_dim // 32))


def _check_attn(out, xs, want, mode, name):
    if mode == "f32":
        _close(out.copy_to_host(), want, 1e-5, name)
    else:
        got = act_quant.dequantize_q8_ref(out.copy_to_host(), xs.copy_to_host())
        _close(got, want, 1e-2, f"{name} q8")


def check_attn_prefill(scale, rng):
    tiny = scale == "tiny"
    spec = _spec(scale)
    counts = [20, 1, 5] if tiny else [700, 1, 64, 1000]
    starts = [6, 9, 0] if tiny else [3000, 5000, 0, 17]
    lengths = [s + c for s, c in zip(starts, counts)]
    tables, kc, vc, context = _paged_case(spec, scale, rng, lengths, np.float16, 4 if tiny else 16)
    q = rng.standard_normal((sum(counts), spec.q_dim)).astype(np.float32)
    tiles = [_dev(a) for a in attn_prefill.plan_tiles(counts, starts)]
    out = _poisoned(q.shape)
    attn_prefill.attn_prefill(spec, _dev(q), _dev(kc), _dev(vc), _dev(tables), tiles, out, int(tiles[0].shape[0]))
    o = 0
    wants = []
    for r, (s, c) in enumerate(zip(starts, counts)):
        wants.append(attn_decode.attention_ref(q[o : o + c], *context(r), np.arange(s, s + c), spec.group_size, spec.head_dim))
        o += c
    _close(out.copy_to_host(), np.concatenate(wants), 1e-4, "attn_prefill")


def check_flash_prefill(scale, rng):
    """The tensor-core prefill attention (float16 pools): tiles of 64 queries, keys in tiles of
    64, rows that start mid-page and mid-tile; f16 Q and P, so a looser tolerance."""
    tiny = scale == "tiny"
    cases = [
        (_spec(scale, num_heads=2, num_kv_heads=1), [70, 1, 5], [6, 9, 60]),
        (_spec(scale, num_heads=2, num_kv_heads=1, head_dim=128), [40, 3], [30, 0]),  # 32-key tiles, 2 buffers
    ] if tiny else [
        (_spec(scale), [700, 1, 64, 1000], [3000, 5000, 0, 17]),
        (_spec(scale, num_heads=9, num_kv_heads=3, head_dim=64), [512, 3, 130], [0, 40, 4000]),
    ]  # fmt: skip
    for spec, counts, starts in cases:
        lengths = [s + c for s, c in zip(starts, counts)]
        tables, kc, vc, context = _paged_case(spec, scale, rng, lengths, np.float16, 4 if tiny else 16)
        q = rng.standard_normal((sum(counts), spec.q_dim)).astype(np.float32)
        plan = attn_prefill.plan_tiles(counts, starts)
        n_tiles = int(plan[0].shape[0]) + 1  # one padding tile, as a graph bucket launches
        padded = [np.concatenate([a, [0]]).astype(np.int32) for a in plan[:3]]
        tiles = [_dev(a) for a in (*padded, *plan[3:])]
        out = _poisoned(q.shape)
        words = flash.words
        flash.flash_prefill(spec, _dev(q), words(_dev(kc)), words(_dev(vc)), _dev(tables), tiles, out, n_tiles,
                            kc.shape[1])  # fmt: skip
        o = 0
        wants = []
        for r, (s, c) in enumerate(zip(starts, counts)):
            wants.append(attn_decode.attention_ref(q[o : o + c], *context(r), np.arange(s, s + c), spec.group_size,
                                                 spec.head_dim))  # fmt: skip
            o += c
        _close(out.copy_to_host(), np.concatenate(wants), 3e-3, f"flash_prefill hd{spec.head_dim}")


# -- sampling and pages ------------------------------------------------------------------------------


def _sample_specs(vocab, rng):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec

    out = rng.integers(0, vocab, 12)
    prompt = rng.integers(0, vocab, 20)
    allowed = rng.random(vocab) < 0.3
    P = SamplingParams
    cases = [
        (P(temperature=0.0), {}),
        (P(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3), {}),
        (P(temperature=0.8), {"num_top_logprobs": 5}),
        (P(temperature=1.0, top_k=7), {}),
        (P(temperature=1.3, top_p=0.6), {}),
        (P(temperature=0.7, min_p=0.05), {}),
        (P(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, frequency_penalty=0.4), {"num_top_logprobs": 3}),
        (P(temperature=0.9), {"allowed": allowed}),
        (P(temperature=0.0), {"allowed": allowed, "num_top_logprobs": 2}),
    ]
    specs = []
    for i, (params, extra) in enumerate(cases):
        seed = int(rng.integers(0, 2**63)) * 2 + 1
        specs.append(SampleSpec(params=params, seed=seed, token_index=int(rng.integers(0, 1000)),
                                prompt_ids=prompt, output_ids=out, **extra))  # fmt: skip
    return specs


def check_sampler(scale, rng):
    from ninfer.core.params import MAX_TOP_LOGPROBS

    # tiny: 1,200 logits take the quad pass's unrolled loads past one round of the block and a
    # partial last round; 201 (not a multiple of 4) the scalar pass. The statistics pass over
    # one block a row and split (3; 32 of 201: empty splits past the end).
    cases = ([(201, 32), (1200, 3), (1200, 1), (201, 1)] if scale == "tiny"
             else [(49152, None), (128256, None), (49152, 1), (128256, 1)])  # fmt: skip
    threads = 64 if scale == "tiny" else sampler.THREADS
    rounds = 1 if scale == "tiny" else 10
    off_exact = total = 0
    # one scratch for every case: the split launches must leave it reset for the next (each
    # case's logits lower than the one's before, so a stale best key would win)
    scratch = None
    for c, (vocab, splits) in enumerate(cases):
        specs = _sample_specs(vocab, rng)
        scratch = scratch or sampler.scratch(len(specs))
        off_exact += _check_sampler_vocab(specs, vocab, rounds, threads, rng, splits, scratch, shift=-20.0 * c)
        total += len(specs) * rounds
    # A draw that lands within float rounding of a boundary may go either way: one in 1000.
    if off_exact > total // 1000:
        raise AssertionError(f"sampler: {off_exact} of {total} tokens differ from the reference")
    assert MAX_TOP_LOGPROBS >= 5


def _check_sampler_vocab(specs, vocab, rounds, threads, rng, splits=None, scratch=None, shift=0.0) -> int:
    """Rows of `vocab` random logits through the device sampler against the reference; the
    number of draws that differ (logprobs and top lists must match)."""
    from ninfer.gpu import sampling

    off_exact = 0
    for _ in range(rounds):
        logits = (rng.standard_normal((len(specs), vocab)) * 3 + shift).astype(np.float32)
        got = _run_sampler(logits, specs, threads, splits, scratch)
        for r, s in enumerate(specs):
            want = sampling.sample(logits[r], s)
            tok, lp, top_ids, top_lp = (g[r] for g in got)
            if tok != want.token_id and tok != _exact_draw(logits[r], s):
                off_exact += 1
            if abs(lp - float(sampling.log_softmax(logits[r])[tok])) > 1e-4:
                raise AssertionError(f"sampler row {r}: logprob {lp} of token {tok} is wrong")
            k = s.num_top_logprobs
            if k and (list(top_ids[:k]) != list(want.top_ids) or np.abs(top_lp[:k] - want.top_logprobs).max() > 1e-4):
                raise AssertionError(f"sampler row {r}: top logprobs {top_ids[:k]} != {want.top_ids}")
    return off_exact


def _exact_draw(logits, spec):
    """The reference's filters and draw with float64 running sums instead of float32.

    Over thousands of candidates a float32 running sum drifts by more than one small token's
    weight, which moves the top-p cut and the draw by a token or two; the device sums
    weights exactly (integers), so a token is right if it is the reference's or this one's.
    """
    from ninfer.gpu import sampling

    scores = sampling.apply_mask(sampling.apply_penalties(logits, spec), spec.allowed)
    p = spec.params
    if p.is_greedy:
        return int(np.argmax(scores))
    z = scores / np.float32(p.temperature)
    w = np.exp(z - z.max()).astype(np.float64)
    ids = np.flatnonzero(w > 0)
    ids = ids[np.lexsort((ids, -z[ids]))]  # z descending, id ascending
    if 0 < p.top_k < ids.size:
        ids = ids[: p.top_k]
    n = ids.size
    cum = np.cumsum(w[ids])
    if p.top_p < 1.0:
        n = min(n, int(np.searchsorted(cum, p.top_p * cum[-1], side="left")) + 1)
    if p.min_p > 0:
        below = w[ids] < np.float32(p.min_p)
        if below.any():
            n = min(n, int(np.argmax(below)))
    cum = cum[:n]
    u = sampling.uniform(spec.seed, spec.token_index)
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), n - 1)])


def _run_sampler(logits, specs, threads, splits=None, scratch=None):
    from ninfer.core.params import MAX_TOP_LOGPROBS

    n, vocab = logits.shape
    fpar = np.zeros((n, sampler.NUM_FPAR), np.float32)
    ipar = np.zeros((n, sampler.NUM_IPAR), np.int32)
    seeds = np.zeros((n, 2), np.uint64)
    masks = np.zeros((n, (vocab + 31) // 32), np.uint32)
    pen_ids, pen_counts = [], []
    for j, s in enumerate(specs):
        p = s.params
        ids, cnt = sampler.penalty_entries(s)
        start = sum(a.size for a in pen_ids)
        pen_ids.append(ids)
        pen_counts.append(cnt)
        if s.allowed is not None:
            masks[j] = sampler.pack_mask(s.allowed, masks.shape[1])
        fpar[j, :6] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        ipar[j, :5] = (p.top_k, s.num_top_logprobs, int(s.allowed is not None), start, start + ids.size)
        seeds[j] = (s.seed % 2**64, s.token_index)
    pid = np.concatenate(pen_ids + [np.zeros(1, np.int32)])
    pcn = np.concatenate(pen_counts + [np.zeros(1, np.int32)])
    out_tok, out_lp = _poisoned(n, np.int32), _poisoned(n)
    top_ids, top_lp = _poisoned((n, MAX_TOP_LOGPROBS), np.int32), _poisoned((n, MAX_TOP_LOGPROBS))
    args = (_dev(logits), _poisoned(logits.shape), _dev(fpar), _dev(ipar), _dev(seeds), _dev(pid), _dev(pcn),
            _dev(masks), out_tok, out_lp, top_ids, top_lp, *(scratch or sampler.scratch(n)))  # fmt: skip
    sampler.sample(args, n, threads=threads, splits=splits)
    return out_tok.copy_to_host(), out_lp.copy_to_host(), top_ids.copy_to_host(), top_lp.copy_to_host()


def check_pages(scale, rng):
    layers, num_pages, elems = (2, 6, 40) if scale == "tiny" else (30, 500, 3072)
    pool = rng.standard_normal((layers, num_pages, elems)).astype(np.float16)
    src, dst = np.array([1, 4], np.int32), np.array([3, 0], np.int32)
    d = _dev(pool)
    pages.page_copy(d, _dev(src), _dev(dst), 2)
    want = pool.copy()
    pages.page_copy_ref(want, src, dst)
    _close(d.copy_to_host(), want, 0.0, "page_copy")
    stage = _dev(np.zeros((layers, 2, elems), np.float16))
    pages.page_gather(d, _dev(src), stage, 2)
    _close(stage.copy_to_host(), want[:, src], 0.0, "page_gather")
    pages.page_scatter(stage, _dev(np.array([5, 2], np.int32)), d, 2)
    _close(d.copy_to_host()[:, [5, 2]], want[:, src], 0.0, "page_scatter")


# -- the whole runner --------------------------------------------------------------------------------


def runner_rows(steps, spec, rng, page_size):
    """Scripted rows: a long prompt (split into sub-steps), a short one, then decode steps."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    greedy = SamplingParams(temperature=0.0)
    prompts = [rng.integers(0, spec.vocab_size, n).astype(np.int32) for n in (20, 3)]
    tables = [np.arange(8, dtype=np.int32) + 8 * r for r in range(2)]
    spec_of = lambda r, i: SampleSpec(params=greedy, seed=r, token_index=i, want_logits=True, num_top_logprobs=2)  # noqa: E731
    yield [StepRow(seq_id=r, token_ids=p, start_pos=0, page_table=tables[r], sample=spec_of(r, 0)) for r, p in enumerate(prompts)]
    pos = [p.size for p in prompts]
    for i in range(1, steps):
        toks = yield None
        yield [StepRow(seq_id=r, token_ids=np.array([toks[r]], np.int32), start_pos=pos[r], page_table=tables[r],
                       sample=spec_of(r, i)) for r in range(2)]  # fmt: skip
        pos = [p + 1 for p in pos]


def _compare_runners(cuda_runner, ref_runner, spec, rng, steps, rtol):
    script = runner_rows(steps, spec, rng, cuda_runner.page_size)
    rows = next(script)
    for i in range(steps):
        got, want = cuda_runner.step(rows), ref_runner.step(rows)
        for g, w in zip(got, want, strict=True):
            _close(g.logits, w.logits, rtol, f"runner step {i} logits")
            if g.token_id != w.token_id:
                raise AssertionError(f"runner step {i}: token {g.token_id} != {w.token_id}")
            if list(g.top_ids) != list(w.top_ids):
                raise AssertionError(f"runner step {i}: top ids {g.top_ids} != {w.top_ids}")
        if i + 1 < steps:
            next(script)
            rows = script.send([g.token_id for g in got])


def check_runner(scale, rng):
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    configs = (("llama", "Q4_1", "f32", np.float32, 2e-3, 16), ("qwen3", "Q8_0", "q8", np.float16, 3e-2, 8))
    for arch, qt, acts, kv_t, rtol, max_tokens in configs:
        extra = dict(arch=arch, has_qk_norm=arch == "qwen3")
        spec = random_spec("tiny", **extra)
        model = random_model(spec, qt, seed=int(rng.integers(1 << 30)))
        cr = CudaRunner(model, num_pages=16, page_size=4, max_batch_rows=4, max_tokens_per_step=max_tokens, activations=acts,
                        kv_dtype=kv_t, split_len=8, use_graphs=acts == "q8")  # fmt: skip
        rr = ReferenceRunner(model, num_pages=16, page_size=4)
        _compare_runners(cr, rr, spec, rng, 2 if scale == "tiny" else 8, rtol)
        snap = cr.snapshot_pages([0, 1, 2])
        ref_snap = rr.snapshot_pages([0, 1, 2])
        _close(snap.arrays[0], ref_snap.arrays[0], 1e-2, "snapshot k", atol=1e-2)
        cr.restore_pages([5, 6, 7], snap)
        cr.copy_pages([0], [9])
        after = cr.snapshot_pages([5, 6, 7, 9])
        _close(after.arrays[1][:, :3], snap.arrays[1], 0.0, "restore_pages")
        _close(after.arrays[1][:, 3], snap.arrays[1][:, 0], 0.0, "copy_pages")
        cr.close()
        if acts == "q8":  # one stream: RMSNorm / SwiGLU folded into the GEMVs (gemv_fused)
            # then the 8B path: no prologue fold, the epilogue folds instead (gemv_swiglu, and
            # gemv_rope where there is no q/k norm: the llama model below)
            def every_fold(runner):
                if runner.forward.folds != frozenset(FOLDS):
                    raise AssertionError(f"the tiny q8 model should take every fold, takes {sorted(runner.forward.folds)}")

            _compare_one_row_plans(model, spec, kv_t, rng, rtol, split_len=8,
                                   plans=[(KernelPlan(), every_fold), (KernelPlan(folds=()), _epilogues_taken)])  # fmt: skip
            # attn_decode_lp (splits of 32; chosen over the one-launch kernel the tiny shape would
            # take), K / V loads after and before the PDL wait (in the replayed graph: racing the
            # K / V write)
            _compare_one_row_plans(model, spec, kv_t, rng, rtol, split_len=None, count_lp=True,
                                   plans=[(KernelPlan(lp_over_one=True, lp_preload=pre), None) for pre in (False, True)])  # fmt: skip
            llama = random_spec("tiny", arch="llama")
            l_model = random_model(llama, "Q4_1", seed=int(rng.integers(1 << 30)))
            _compare_one_row_plans(l_model, llama, kv_t, rng, rtol, split_len=8,
                                   plans=[(KernelPlan(folds=()), _epilogues_taken)])  # fmt: skip


def _epilogues_taken(runner) -> None:
    spec = runner.spec
    want = set(EPILOGUES) - ({"qkv_rope"} if spec.has_qk_norm else set())
    if runner.forward.folds or runner.forward.epilogues != want:
        raise AssertionError(f"{spec.arch}: epilogues {sorted(runner.forward.epilogues)}, not {sorted(want)}")


def check_positions(scale, rng):
    """Outputs at every position (SampleSpec.want_all_logits, hidden_layers) against the
    reference: a row split over sub-steps (max_tokens_per_step) beside a row that asks for
    nothing more, layers 0, the last and -1 (eager, hooked after those layers); then a decode
    step on a q8 runner (the head's q8 path)."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    greedy = SamplingParams(temperature=0.0)
    spec = random_spec("tiny", arch="llama")
    model = random_model(spec, "Q4_1", seed=int(rng.integers(1 << 30)))
    layers = (0, spec.num_layers - 1, -1)
    asks = SampleSpec(params=greedy, seed=0, token_index=0, want_all_logits=True, hidden_layers=layers)
    plain = SampleSpec(params=greedy, seed=0, token_index=0, want_logits=True)
    tables = [np.arange(4, dtype=np.int32) + 4 * r for r in range(3)]
    # sub-steps of 4 tokens: row 0's 5 in two (4, then 1 beside row 1's 3); the simulator's
    # GEMV cost grows with a sub-step's token bucket (4 here)
    prompts = [rng.integers(0, spec.vocab_size, n).astype(np.int32) for n in (5, 3)]
    rows = [StepRow(seq_id=r, token_ids=p, start_pos=0, page_table=tables[r], sample=s)
            for r, (p, s) in enumerate(zip(prompts, (asks, plain)))]  # fmt: skip
    cr = CudaRunner(model, num_pages=16, page_size=4, max_batch_rows=4, max_tokens_per_step=4, activations="f32",
                    kv_dtype=np.float32, split_len=8)  # fmt: skip
    rr = ReferenceRunner(model, num_pages=16, page_size=4)
    (g0, g1), (w0, w1) = cr.step(rows), rr.step(rows)
    cr.close()
    _close(g0.all_logits, w0.all_logits, 2e-3, "all_logits of a row over two sub-steps")
    _close(g0.layer_hidden, w0.layer_hidden, 2e-3, "layer_hidden (0, last, -1)")
    _close(g1.logits, w1.logits, 2e-3, "the plain row's logits")
    if g1.all_logits is not None or g1.layer_hidden is not None or g0.token_id != w0.token_id:
        raise AssertionError("a row that asks for nothing got every-position outputs, or the tokens differ")
    # a one-token row on a q8 runner (the head's q8 path), beside a row that asks for nothing
    spec1 = random_spec("tiny", arch="llama", num_layers=1)  # the simulator is slow: one layer will do
    model1 = random_model(spec1, "Q4_1", seed=int(rng.integers(1 << 30)))
    one = SampleSpec(params=greedy, seed=0, token_index=0, want_all_logits=True)
    rows = [StepRow(seq_id=r, token_ids=prompts[0][r : r + 1], start_pos=0, page_table=tables[r],
                    sample=one if r == 1 else plain) for r in range(2)]  # fmt: skip
    q8 = CudaRunner(model1, num_pages=16, page_size=4, max_batch_rows=2, activations="q8", kv_dtype=np.float32,
                    split_len=8)  # fmt: skip
    got, want = q8.step(rows), ReferenceRunner(model1, num_pages=16, page_size=4).step(rows)
    q8.close()
    if got[1].all_logits.shape != (1, spec1.vocab_size) or got[0].all_logits is not None:
        raise AssertionError("q8: all_logits on the wrong rows of a decode step")
    _close(got[1].all_logits, want[1].all_logits, 3e-2, "q8: all_logits of a decode row (the head's q8 path)")


def check_lookahead(scale, rng):
    """Steps submitted one ahead with `feed` (tokens = the step before's samples, which embed
    reads on the device) give exactly the tokens, log-probabilities and top lists of steps
    fed through the host: greedy and seeded rows, top logprobs, on the GPU three streams in a
    bucket of four (a padding row); and with fewer rows a step than streams, the batch in
    sub-steps (the host path). The simulator (~10 s a step) takes three streams and one fed
    step; at one row a step that is three sub-steps, so a host mirror set is reused within one
    submit (its first owner's outputs fetched before it is overwritten)."""
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.gpu.cuda.runner import CudaRunner

    spec = random_spec("tiny", arch="llama")
    model = random_model(spec, "Q8_0", seed=int(rng.integers(1 << 30)))
    tiny = scale == "tiny"
    prompts = [rng.integers(0, spec.vocab_size, n).astype(np.int32) for n in ((5, 3, 4) if tiny else (5, 3, 7))]
    steps = 1 if tiny else 12
    host_fed = {}
    for max_rows in (2, 1) if tiny else (4, 2, 1):
        runs, graphs = [], []
        for ahead in (False, True):
            runner = CudaRunner(model, num_pages=32, page_size=4, max_batch_rows=max_rows, activations="q8",
                                split_len=8)  # fmt: skip
            overlapped = []
            runs.append(_decode_streams(runner, spec, prompts, steps, ahead, overlapped))
            graphs.append(set(runner._graphs.keys()) if runner._graphs is not None else set())
            runner.close()
            if ahead and graphs[1] != graphs[0]:  # a fed step replays the graph of a host-fed one
                raise AssertionError(f"fed steps captured graphs of their own: {graphs[1] - graphs[0]}")
            if ahead and max_rows == 4 and not SIMULATOR and not overlapped:
                raise AssertionError("no fed step was staged while the step before ran")
        _same_results(*runs, max_rows)
        host_fed[max_rows] = runs[0]
    # and the batch split differently gives the same tokens (a sub-step's kernels and sums may
    # differ with its row count, so log-probabilities to 1e-3): with one row a step, a host
    # mirror set is reused within one submit, which both runs above would get equally wrong
    one = host_fed.pop(1)
    for max_rows, other in host_fed.items():
        for i, (want, got) in enumerate(zip(other, one, strict=True)):
            for j, (w, g) in enumerate(zip(want, got, strict=True)):
                if g.token_id != w.token_id or abs(g.logprob - w.logprob) > 1e-3:
                    raise AssertionError(f"one row a step vs {max_rows}, step {i}, stream {j}: "
                                         f"({g.token_id}, {g.logprob}) != ({w.token_id}, {w.logprob})")  # fmt: skip


def _same_results(want_steps, got_steps, max_rows):
    for i, (want, got) in enumerate(zip(want_steps, got_steps, strict=True)):
        for j, (w, g) in enumerate(zip(want, got, strict=True)):
            where = f"max_rows {max_rows}, step {i}, stream {j}"
            if g.token_id != w.token_id or g.logprob != w.logprob:
                raise AssertionError(f"{where}: ({g.token_id}, {g.logprob}) != ({w.token_id}, {w.logprob})")
            if (g.top_ids is None) != (w.top_ids is None) or (w.top_ids is not None and (
                    list(g.top_ids) != list(w.top_ids) or list(g.top_logprobs) != list(w.top_logprobs))):  # fmt: skip
                raise AssertionError(f"{where}: top lists {g.top_ids} != {w.top_ids}")


def _decode_streams(runner, spec, prompts, steps: int, ahead: bool, overlapped: list) -> list:
    """Each step's results for len(prompts) streams: the prompts, then `steps` decode steps fed
    through the host (step) or one ahead on the device (submit feed=True, collect behind);
    `overlapped` gets the fed steps staged while the step before ran (on the GPU: `_hold`)."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    kinds = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0))
    tops = (0, 3, 2)

    def rows_at(k, tokens):
        return [StepRow(seq_id=i, token_ids=np.asarray(tokens[i] if tokens else [0], np.int32).reshape(-1),
                        start_pos=0 if k < 0 else len(p) + k, page_table=np.arange(8, dtype=np.int32) + 8 * i,
                        sample=SampleSpec(params=kinds[i], seed=7 + i, token_index=k + 1, num_top_logprobs=tops[i]))
                for i, p in enumerate(prompts)]  # fmt: skip

    out = []
    if ahead:
        _hold(runner)
        since = _num_graphs(runner)  # the graphs there were when `pending` was submitted
        pending = runner.submit(rows_at(-1, prompts))
        for k in range(steps):
            _hold(runner)
            before = _num_graphs(runner)
            nxt = runner.submit(rows_at(k, None), feed=True)
            # fed on the device (one sub-step each), and no capture since `pending` was
            # submitted: a capture (eager run, then one per mirror set) outlasts the hold, so
            # the step queued before it, or during it, has ended by the time it returns
            if len(pending.state) == len(nxt.state) == 1 and _num_graphs(runner) == since:
                _still_running(runner, pending, k)
                overlapped.append(k)
            out.append(runner.collect(pending))
            pending, since = nxt, before
        out.append(runner.collect(pending))
        return out
    out.append(runner.step(rows_at(-1, prompts)))
    for k in range(steps):
        out.append(runner.step(rows_at(k, [[t.token_id] for t in out[-1]])))
    return out


# On the GPU a tiny model's step ends before Python has staged the next one, so without help
# the fed steps would never be staged while the step before runs. A spin kernel queued before
# each submit holds the stream (a few ms), and after each fed submit the step before must
# still be running: its staging and launch overlapped that step, as in the engine on a large
# model. Steps submitted in or before a capture are not asked (the eleventh session's first GPU
# run asked the step submitted with the capture, which had ended during it).
HOLD_ITERS = 1 << 22


@functools.cache
def _spin_kernel():
    """The spin kernel and its output (allocated once: a free can synchronise the device)."""

    def spin(out, n):
        acc = np.uint32(1)
        for _ in range(n):
            acc = acc * np.uint32(1664525) + np.uint32(1013904223)
        out[0] = acc

    return cuda.jit(spin), cuda.device_array(1, np.uint32)


def _hold(runner) -> None:
    if not SIMULATOR:  # the simulator runs each launch to its end before returning
        kernel, out = _spin_kernel()
        kernel[1, 1, runner.stream](out, HOLD_ITERS)


def _num_graphs(runner) -> int:
    return 0 if runner._graphs is None else len(runner._graphs.keys())


def _still_running(runner, pending, k) -> None:
    if not SIMULATOR and runner._events[pending.state[0].mirror].query():
        raise AssertionError(f"fed step {k}: the step before had ended when this one was staged")


def _compare_one_row_plans(model, spec, kv_t, rng, rtol, plans, split_len, count_lp=False):
    """One row on one q8 runner (max_batch_rows 1): a 5-token prompt under the first of
    `plans`, then decode steps under each plan in turn (`set_plan` between steps, so each
    plan's kernels read the K / V the ones before wrote), every step's logits against the
    reference's. `plans`: (KernelPlan, check(runner) or None, run once the plan is set).
    `count_lp`: each plan's decode steps must take attn_lp.attn_decode_lp (counted).
    A plan takes two decode steps on a GPU (its graph captured, then replayed); one under the
    simulator, which captures no graphs (a second would run the same kernels again)."""
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    decodes = 1 if SIMULATOR else 2
    runner = CudaRunner(model, num_pages=8, page_size=4, max_batch_rows=1, activations="q8", kv_dtype=kv_t,
                        split_len=split_len, plan=plans[0][0])  # fmt: skip
    steps = _one_row_steps(runner, ReferenceRunner(model, num_pages=8, page_size=4), spec, rng, rtol)
    calls = []
    fn = attn_lp.attn_decode_lp
    if count_lp:
        attn_lp.attn_decode_lp = lambda *a, **kw: calls.append(1) or fn(*a, **kw)
    try:
        next(steps)  # the prompt
        for k, (plan, check) in enumerate(plans):
            if k:
                runner.set_plan(plan)
            if check is not None:
                check(runner)
            before = len(calls)
            for _ in range(decodes):
                next(steps)
            if count_lp and len(calls) == before:
                raise AssertionError(f"the decode attention attn_decode_lp was not taken under {plan}")
    finally:
        attn_lp.attn_decode_lp = fn
        runner.close()


def _one_row_steps(cuda_runner, ref_runner, spec, rng, rtol):
    """A generator: each next() runs one step of one greedy row on both runners and compares
    the logits (a 5-token prompt first, then a decode step a call)."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    table = np.arange(8, dtype=np.int32)
    ids = rng.integers(0, spec.vocab_size, 5).astype(np.int32)
    pos = 0
    for i in range(table.size * 4 - ids.size):
        sample = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=i, want_logits=True)
        rows = [StepRow(seq_id=0, token_ids=ids, start_pos=pos, page_table=table, sample=sample)]
        (got,), (want,) = cuda_runner.step(rows), ref_runner.step(rows)
        _close(got.logits, want.logits, rtol, f"one-row step {i} logits ({cuda_runner.plan})")
        pos += ids.size
        ids = np.array([want.token_id], np.int32)
        yield


# -- Gated DeltaNet (kernels/gdn.py) --------------------------------------------------------------
# Real shapes: transformers' Qwen3_5TextConfig defaults (16 k-heads, 32 v-heads, 128 x 128 heads,
# conv kernel 4); decode batches 1 / 16 / 64 and a 512-token prefill chunk, each timed on the GPU
# with its achieved bandwidth over the bytes it must move (state read + written, inputs, outputs).

from ninfer.gpu.cuda.kernels import gdn  # noqa: E402

GDN_REAL = dict(num_k=16, num_v=32, dk=128, dv=128, kernel_size=4)
GDN_TINY = dict(num_k=2, num_v=4, dk=16, dv=8, kernel_size=4)


def _gdn_shape(scale):
    shape = GDN_TINY if scale == "tiny" else GDN_REAL
    return shape, 2 * shape["num_k"] * shape["dk"] + shape["num_v"] * shape["dv"]


def _gdn_inputs(rng, num_tokens, shape, conv_dim):
    """The conv output (q, k, v), raw a / b projections and the per-head parameters."""
    nv = shape["num_v"]
    qkv = rng.standard_normal((num_tokens, conv_dim)).astype(np.float32)
    a = rng.standard_normal((num_tokens, nv)).astype(np.float32)
    b = rng.standard_normal((num_tokens, nv)).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 4.0, nv)).astype(np.float32)
    dt_bias = rng.uniform(-1.0, 1.0, nv).astype(np.float32)
    return qkv, a, b, a_log, dt_bias


def _gdn_state(rng, num_slots, shape):
    return (0.3 * rng.standard_normal((num_slots, shape["num_v"], shape["dk"], shape["dv"]))).astype(np.float32)


def _gdn_time(label, launch, num_bytes, reps=20):
    """Warm up, then the mean GPU time of `reps` launches and the bandwidth it achieves (GPU
    only). The spin kernel holds the stream while Python queues them: a launch from Python
    (~25 us) outlasts a small kernel, and the events would time the launches instead."""
    if SIMULATOR:
        return
    launch()
    cuda.synchronize()
    spin, spun = _spin_kernel()
    spin[1, 1](spun, HOLD_ITERS)
    start, end = cuda.event(), cuda.event()
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    ms = cuda.event_elapsed_time(start, end) / reps
    print(f"{label}: {ms * 1e3:.1f} us, {num_bytes / 1e9:.4f} GB moved, {num_bytes / ms / 1e6:.0f} GB/s", flush=True)


def check_gdn_conv(scale, rng):
    """The conv decode (rows in permuted slots, the rest of the pool untouched) and the conv
    prefill (ragged sequences: shorter than the window, over several token tiles, fresh)."""
    tiny = scale == "tiny"
    ks = GDN_TINY["kernel_size"]
    conv_dim = 40 if tiny else _gdn_shape(scale)[1]  # tiny: a partial channel tile
    w = rng.standard_normal((ks, conv_dim)).astype(np.float32)
    for rows in (3,) if tiny else (1, 16, 64):
        slots = rng.permutation(rows + 1)[:rows].astype(np.int32)
        state = rng.standard_normal((rows + 1, ks - 1, conv_dim)).astype(np.float32)
        x = rng.standard_normal((rows, conv_dim)).astype(np.float32)
        want, want_state = gdn.conv_ref(x, w, np.arange(rows + 1), slots, np.zeros(rows, np.int32), state)
        out, d_state = _poisoned(x.shape), _dev(state)
        args = (_dev(x), _dev(w), _dev(slots), d_state, out, rows)
        launch = lambda: gdn.conv_decode(*args)  # noqa: E731
        launch()
        _close(out.copy_to_host(), want, 1e-5, f"conv decode rows {rows}")
        _close(d_state.copy_to_host(), want_state, 0.0, f"conv decode state rows {rows}")
        _gdn_time(f"gdn conv decode B={rows}", launch, 4 * rows * conv_dim * (2 + 2 * (ks - 1)))
    lens = (9, 1, 2, 0) if tiny else (512,)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(len(lens) + 1)[: len(lens)].astype(np.int32)
    fresh = np.array([1, 0, 0, 1], np.int32) if tiny else np.zeros(1, np.int32)  # an empty fresh one: zeroed
    state = rng.standard_normal((len(lens) + 1, ks - 1, conv_dim)).astype(np.float32)
    x = rng.standard_normal((starts[-1], conv_dim)).astype(np.float32)
    want, want_state = gdn.conv_ref(x, w, starts, slots, fresh, state)
    out, d_state = _poisoned(x.shape), _dev(state)
    args = (_dev(x), _dev(w), _dev(starts), _dev(slots), _dev(fresh), d_state, out, len(lens), max(lens))
    gdn.conv_prefill(*args)
    _close(out.copy_to_host(), want, 1e-5, "conv prefill")
    _close(d_state.copy_to_host(), want_state, 0.0, "conv prefill state")
    _gdn_time(f"gdn conv prefill {lens} tokens", lambda: gdn.conv_prefill(*args), 4 * x.size * 2)


def _gdn_plans(scale):
    """((cols, groups) of the GDN blocks, tiled k-heads): the default, and others (tiny: two
    column tiles a head, HF's grouped k-heads; real: alternatives timed beside the default)."""
    return ((None, True), ((4, 4), False)) if scale == "tiny" else ((None, True), ((32, 8), True), ((16, 8), True))


def check_gdn_decode(scale, rng):
    """One step for rows in permuted slots of a pool: outputs and the whole pool (the spare
    slot untouched), for each block plan."""
    shape, conv_dim = _gdn_shape(scale)
    dk, dv, nv = shape["dk"], shape["dv"], shape["num_v"]
    for rows in (3,) if scale == "tiny" else (1, 16, 64):
        qkv, a, b, a_log, dt_bias = _gdn_inputs(rng, rows, shape, conv_dim)
        slots = rng.permutation(rows + 1)[:rows].astype(np.int32)
        state = _gdn_state(rng, rows + 1, shape)
        steps = np.arange(rows + 1, dtype=np.int32)
        ins = [_dev(v) for v in (qkv, a, b, a_log, dt_bias, slots)]
        for plan, tiled in _gdn_plans(scale):
            no = np.zeros(rows, np.int32)
            want, want_state = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, steps, slots, no, state, tiled)
            out, d_state = _poisoned((rows, nv * dv)), _dev(state)
            launch = lambda: gdn.gdn_decode(*ins, d_state, out, rows, plan, tiled)  # noqa: E731
            launch()
            _close(out.copy_to_host(), want, 2e-5, f"gdn decode rows {rows} plan {plan}")
            _close(d_state.copy_to_host(), want_state, 2e-5, f"gdn decode state rows {rows} plan {plan}")
            state_bytes = 4 * rows * nv * dk * dv * 2
            io_bytes = 4 * rows * (conv_dim + 2 * nv + nv * dv)
            _gdn_time(f"gdn decode B={rows} plan {plan} (bytes: state r+w + io)", launch, state_bytes + io_bytes)


def check_gdn_prefill(scale, rng):
    """Ragged sequences (fresh, and continuing from a pooled state), then prefill in two chunks
    == decode token by token, on the outputs and on the state itself."""
    tiny = scale == "tiny"
    shape, conv_dim = _gdn_shape(scale)
    dv, nv = shape["dv"], shape["num_v"]
    lens = (5, 1, 3, 0) if tiny else (512,)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    fresh = np.array([1, 0, 0, 1], np.int32) if tiny else np.zeros(1, np.int32)  # an empty fresh one: zeroed
    slots = rng.permutation(len(lens) + 1)[: len(lens)].astype(np.int32)
    qkv, a, b, a_log, dt_bias = _gdn_inputs(rng, starts[-1], shape, conv_dim)
    state = _gdn_state(rng, len(lens) + 1, shape)
    ins = [_dev(v) for v in (qkv, a, b, a_log, dt_bias, starts, slots, fresh)]
    tol = 2e-5 if tiny else 1e-4  # 512 steps of float32 rounding
    for plan, tiled in _gdn_plans(scale)[:2]:
        want, want_state = gdn.gdn_ref(qkv, a, b, a_log, dt_bias, starts, slots, fresh, state, tiled)
        out, d_state = _poisoned((starts[-1], nv * dv)), _dev(state)
        launch = lambda: gdn.gdn_prefill(*ins, d_state, out, len(lens), plan, tiled)  # noqa: E731
        launch()
        _close(out.copy_to_host(), want, tol, f"gdn prefill {lens} plan {plan}")
        _close(d_state.copy_to_host(), want_state, tol, f"gdn prefill state {lens} plan {plan}")
        state_bytes = 4 * len(lens) * nv * shape["dk"] * dv * 2
        _gdn_time(f"gdn prefill {lens} tokens plan {plan}", launch, state_bytes + 4 * qkv.size + 4 * out.size)
    # one sequence: a chunk, then the rest as a second chunk; against one token a step
    n = 6 if tiny else 64
    qkv, a, b, a_log, dt_bias = _gdn_inputs(rng, n, shape, conv_dim)
    one = _gdn_state(rng, 1, shape)
    params = [_dev(v) for v in (a_log, dt_bias)]
    zero = _dev(np.zeros(1, np.int32))  # slot 0, not fresh
    chunked, stepped = _dev(one), _dev(one)
    out_c, out_s = _poisoned((n, nv * dv)), _poisoned((1, nv * dv))
    cut = n // 3
    for lo, hi in ((0, cut), (cut, n)):
        part = [_dev(v[lo:hi]) for v in (qkv, a, b)]
        o = _poisoned((hi - lo, nv * dv))
        gdn.gdn_prefill(*part, *params, _dev(np.array([0, hi - lo], np.int32)), zero, zero, chunked, o, 1)
        out_c[lo:hi] = o
    step_out = np.zeros((n, nv * dv), np.float32)
    for t in range(n):
        part = [_dev(v[t : t + 1]) for v in (qkv, a, b)]
        gdn.gdn_decode(*part, *params, zero, stepped, out_s, 1)
        step_out[t] = out_s.copy_to_host()[0]
    _close(out_c.copy_to_host(), step_out, 1e-6, "prefill in two chunks vs decode a token a step: outputs")
    _close(chunked.copy_to_host(), stepped.copy_to_host(), 1e-6, "prefill in two chunks vs decode: the state")


def check_gdn_gated_rmsnorm(scale, rng):
    shape, _ = _gdn_shape(scale)
    dv, nv = shape["dv"], shape["num_v"]
    tokens = 3 if scale == "tiny" else 512
    o = rng.standard_normal((tokens, nv * dv)).astype(np.float32)
    z = rng.standard_normal((tokens, nv * dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    out = _poisoned(o.shape)
    args = (_dev(o), _dev(z), _dev(w), 1e-6, out, tokens)
    gdn.gated_rmsnorm(*args)
    _close(out.copy_to_host(), gdn.gated_rmsnorm_ref(o, z, w, 1e-6), 1e-5, "gated rmsnorm")
    _gdn_time(f"gdn gated rmsnorm {tokens} tokens", lambda: gdn.gated_rmsnorm(*args), 4 * o.size * 3)


CHECKS = {
    name[len("check_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("check_") and callable(fn)
}


def run(names, scale: str, seed: int = 0) -> dict[str, str]:
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            CHECKS[name](scale, np.random.default_rng([seed, len(name)]))
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=6)
        print(f"check {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return results


def main(argv) -> int:
    scale = argv[0] if argv else "tiny"
    names = argv[1:] or list(CHECKS)
    results = run(names, scale)
    print(json.dumps(results))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    if SIMULATOR:
        from simfast import speed_up_simulator  # beside this file

        speed_up_simulator()
    raise SystemExit(main(sys.argv[1:]))
