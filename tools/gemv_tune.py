"""Device time of single kernels at model shapes, replayed from CUDA graphs (GPU only).

    python -m tools.gemv_tune [--shapes llama3-8b,smollm2-135m] [--json FILE]
    python -m tools.gemv_tune --gemm [--tokens 512,4096] [--tiles auto,64x64,32x64,32x32]

For each linear of a decode layer (fused QKV, O, gate+up, down) and the LM head: the q8 GEMV
with one activation row in several shapes (rows per lane group, unroll, split loop), each
timed over a graph of launches that cycle through enough distinct weight copies that no
launch finds its matrix in L2 (GB/s counts the weight planes only). Then RMSNorm (q8) and
decode attention at the same model shape. Times are medians of CUDA-event-timed replays.

`--gemm` times the prefill GEMM (gemm.gemm) instead, at the same linears (QKV, O, gate+up,
down) for each token count, once per tile ("auto" = gemm.pick_tile's choice), each as a graph of back-to-back launches on one weight (TFLOP/s = 2 M N K /
time; O and down add the residual in place, as the forward pass does).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import numpy as np
from numba import cuda

from ninfer.gpu.cuda.kernels import attn_decode, gemm, gemv, norm
from ninfer.gpu.cuda.device_weights import upload_weight
from ninfer.gpu.cuda.graphs import GraphCache
from ninfer.gpu.cuda.kernels.quant_layout import pack_tensor, random_stored
from ninfer.gpu.cuda.random_model import random_spec

VARIANTS = [(1, 4, False), (1, 4, True), (2, 4, False), (2, 2, False), (4, 2, False), (1, 8, True)]
# (rows per lane group, unroll, split loop: one row per group) at gemv.lanes_for's width, or --variants "l8r2u4,..."
MIN_BYTES = 400 << 20  # weight bytes cycled through per graph (8x the H200's 50 MB L2)


def _time_graph(stream, launch, reps: int = 20) -> float:
    """Median ms of one replay of the graph `launch()` records."""
    graphs = GraphCache(stream)
    launch()  # compile
    stream.synchronize()
    graphs.capture("g", launch)
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(reps + 2):
        start.record(stream)
        graphs.replay("g")
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    graphs.close()
    return statistics.median(times[2:])


def parse_variants(text: str) -> list[tuple[int | None, int, int, bool]]:
    """'l8r2u4,r1u4s' -> [(lanes, rows per group, unroll, split)]; lanes None = lanes_for."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"(?:l(8|16|32))?r(\d)u(\d)(s?)", item.strip())
        if not m:
            raise SystemExit(f"bad variant {item!r}: expected e.g. l16r2u4 (lanes, rows per group, unroll, s = split loop)")
        out.append((int(m[1]) if m[1] else None, int(m[2]), int(m[3]), m[4] == "s"))
    return out


def _one_row_case(qtype, rows, cols, stream, rng):
    """(packed weight, its device copies: enough that a graph cycling through them finds none in
    L2, the int8 activation row and its scales, the output row) for a one-row q8 GEMV."""
    from ninfer.gpu.cuda.kernels.act_quant import quantize_q8_ref

    packed = pack_tensor(random_stored(qtype, rows, cols, rng))
    copies = max(2, min(64, -(-MIN_BYTES // packed.nbytes)))
    ws = [upload_weight(packed, stream) for _ in range(copies)]
    xq, xs = quantize_q8_ref(rng.standard_normal((1, cols)).astype(np.float32))
    d_xq, d_xs = cuda.to_device(xq.view(np.uint32), stream=stream), cuda.to_device(xs, stream=stream)
    return packed, ws, d_xq, d_xs, cuda.device_array((1, rows), np.float32)


def tune_linear(name, qtype, rows, cols, stream, rng, variants=None) -> list[dict]:
    packed, ws, d_xq, d_xs, out = _one_row_case(qtype, rows, cols, stream, rng)
    copies = len(ws)
    rows_out = []
    for lanes, rpg, unroll, split in variants or [(None, *v) for v in VARIANTS]:

        def launch():
            for w in ws:
                gemv.gemv(w, d_xq, d_xs, out, None, 1, "q8", stream, lanes=lanes, shape=(rpg, unroll), split=split)

        ms = _time_graph(stream, launch)
        us = 1e3 * ms / copies
        rows_out.append({"linear": name, "qtype": qtype, "rows": rows, "cols": cols,
                         "lanes": lanes or gemv.lanes_for(cols // 32), "rows_per_group": rpg,
                         "unroll": unroll, "split": split, "us": round(us, 2),
                         "GB/s": round(packed.nbytes / us / 1e3, 1)})  # fmt: skip
        print(json.dumps(rows_out[-1]), flush=True)
    del ws
    return rows_out


def tune_small(spec, stream, rng) -> list[dict]:
    out = []
    d = spec.d_model
    x = cuda.to_device(rng.standard_normal((1, d)).astype(np.float32), stream=stream)
    w = cuda.to_device(np.ones(d, np.float32), stream=stream)
    xq = cuda.device_array((1, max(d, spec.d_ffn)), np.int8)
    xs = cuda.device_array((1, 2 * max(d, spec.d_ffn) // 32), np.float32)
    rows = cuda.to_device(np.zeros(1, np.int32), stream=stream)
    n = 20

    def norm_launch():
        for _ in range(n):
            norm.rmsnorm(x, x, w, 1e-5, rows, xq, xs, 1, "q8", False, False, stream)

    out.append({"kernel": "rmsnorm_q8", "d": d, "us": round(1e3 * _time_graph(stream, norm_launch) / n, 2)})
    print(json.dumps(out[-1]), flush=True)
    # decode attention: one row at context 256, fp16 KV, splits of 32
    ctx, page = 256, 16
    kv = (ctx // page + 1, page, spec.num_kv_heads, spec.head_dim)
    kc = cuda.to_device(rng.standard_normal(kv).astype(np.float16), stream=stream)
    vc = cuda.to_device(rng.standard_normal(kv).astype(np.float16), stream=stream)
    q = cuda.to_device(rng.standard_normal((1, spec.q_dim)).astype(np.float32), stream=stream)
    tables = cuda.to_device(np.arange(ctx // page, dtype=np.int32).reshape(1, -1), stream=stream)
    lens = cuda.to_device(np.array([ctx], np.int32), stream=stream)
    split = 32
    o_part = cuda.device_array((1, spec.num_heads, ctx // split, spec.head_dim), np.float32)
    ml = cuda.device_array((1, spec.num_heads, ctx // split, 2), np.float32)
    aq = cuda.device_array((1, spec.q_dim), np.int8)
    axs = cuda.device_array((1, 2 * spec.q_dim // 32), np.float32)

    def attn_launch():
        for _ in range(n):
            attn_decode.attn_decode(spec, q, kc, vc, tables, lens, o_part, ml, aq, axs, 1, split, "q8", stream)

    out.append({"kernel": "attn_decode+combine", "context": ctx, "us": round(1e3 * _time_graph(stream, attn_launch) / n, 2)})
    print(json.dumps(out[-1]), flush=True)
    out.append({"kernel": "sampler, one greedy row", "vocab": spec.vocab_size, "us": _time_sampler(spec, stream, rng, n)})
    print(json.dumps(out[-1]), flush=True)
    return out


def _time_sampler(spec, stream, rng, n) -> float:
    from ninfer.gpu.cuda.kernels import sampler

    v = spec.vocab_size
    zeros = lambda shape, dtype: cuda.to_device(np.zeros(shape, dtype), stream=stream)  # noqa: E731
    logits = cuda.to_device(rng.standard_normal((1, v)).astype(np.float32), stream=stream)
    args = (logits, zeros((1, v), np.float32), zeros((1, sampler.NUM_FPAR), np.float32),
            zeros((1, sampler.NUM_IPAR), np.int32), zeros((1, 2), np.uint64), zeros(1, np.int32), zeros(1, np.int32),
            zeros((1, (v + 31) // 32), np.uint32), zeros(1, np.int32), zeros(1, np.float32), zeros((1, 8), np.int32),
            zeros((1, 8), np.float32), *sampler.scratch(1))  # fmt: skip

    def launch():
        for _ in range(n):
            sampler.sample(args, 1, stream)

    return round(1e3 * _time_graph(stream, launch) / n, 2)


def _tile_arg(text: str):
    if text == "auto":
        return None
    bm, bn = (int(v) for v in text.split("x"))
    return bm, bn


def tune_gemm(name, qtype, rows, cols, tokens, tiles, stream, rng) -> list[dict]:
    packed = pack_tensor(random_stored(qtype, rows, cols, rng, scale=1.0 / np.sqrt(cols)))
    w = upload_weight(packed, stream)
    x = cuda.to_device(rng.standard_normal((tokens, cols)).astype(np.float32), stream=stream)
    out = cuda.to_device(np.zeros((tokens, rows), np.float32), stream=stream)
    res = out if name in ("o", "down") else None
    flop = 2.0 * tokens * rows * cols
    n = max(1, min(20, round(4e9 / flop)))  # launches per graph: about 4 GFLOP
    rows_out = []
    for text in tiles:
        tile = _tile_arg(text)

        def launch():
            for _ in range(n):
                gemm.gemm(w, x, out, res, tokens, stream, tile=tile)

        us = 1e3 * _time_graph(stream, launch, reps=10) / n
        picked = gemm.pick_tile(tokens, rows) if tile is None else tile
        rows_out.append({"linear": name, "qtype": qtype, "tokens": tokens, "rows": rows, "cols": cols,
                         "tile": text, "kernel": "x".join(map(str, picked)),
                         "grid": _grid(picked, tokens, rows), "us": round(us, 2),
                         "TFLOP/s": round(flop / us / 1e6, 2)})  # fmt: skip
        print(json.dumps(rows_out[-1]), flush=True)
    del w, x, out
    return rows_out


def _grid(tile, tokens, rows):
    bm, bn = tile
    return [-(-rows // bn), -(-tokens // bm)]


def run_gemm(args, stream, rng) -> list[dict]:
    results = []
    tiles = args.tiles.split(",")
    for shape in args.shapes.split(","):
        spec = random_spec(shape)
        qkv = spec.q_dim + 2 * spec.kv_dim
        linears = (("qkv", qkv, spec.d_model), ("o", spec.d_model, spec.q_dim),
                   ("gate_up", 2 * spec.d_ffn, spec.d_model), ("down", spec.d_model, spec.d_ffn))  # fmt: skip
        for tokens in (int(t) for t in args.tokens.split(",")):
            for name, rows, cols in linears:
                rows_out = tune_gemm(name, args.qtype, rows, cols, tokens, tiles, stream, rng)
                results += [dict(r, shape=shape) for r in rows_out]
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gemv_tune")
    p.add_argument("--shapes", default="llama3-8b,smollm2-135m")
    p.add_argument("--qtype", default="Q4_1")
    p.add_argument("--json")
    p.add_argument("--variants", help="q8 GEMV shapes to time, e.g. l32r2u4,l8r2u2 (default: the built-in set)")
    p.add_argument("--linears", default="qkv,o,gate_up,down,head", help="which linears to time")
    p.add_argument("--gemm", action="store_true", help="time the prefill GEMM instead of the decode kernels")
    p.add_argument("--tokens", default="512,4096", help="--gemm: token counts (M)")
    p.add_argument("--tiles", default="auto,64x64,32x64,32x32", help="--gemm: tiles, auto = gemm.pick_tile")
    args = p.parse_args(argv)
    variants = parse_variants(args.variants) if args.variants else None
    for text in args.tiles.split(","):
        _tile_arg(text)  # a bad tile fails before the GPU work
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    if args.gemm:
        results = run_gemm(args, stream, rng)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    results = []
    for shape in args.shapes.split(","):
        spec = random_spec(shape)
        qkv = spec.q_dim + 2 * spec.kv_dim
        for name, rows, cols, qt in (("qkv", qkv, spec.d_model, args.qtype), ("o", spec.d_model, spec.q_dim, args.qtype),
                                     ("gate_up", 2 * spec.d_ffn, spec.d_model, args.qtype),
                                     ("down", spec.d_model, spec.d_ffn, args.qtype),
                                     ("head", spec.vocab_size, spec.d_model, "Q8_0")):  # fmt: skip
            if name in args.linears.split(","):
                results += [dict(r, shape=shape) for r in tune_linear(name, qt, rows, cols, stream, rng, variants)]
        results += [dict(r, shape=shape) for r in tune_small(spec, stream, rng)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
