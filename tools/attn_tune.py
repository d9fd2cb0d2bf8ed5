"""Decode attention on the GPU: split + combine, lanes over positions (+ combine), one launch.

    python -m tools.attn_tune [--shapes smollm2-135m,llama3-8b] [--rows 1,4,16,64]
        [--contexts 128,512,2048] [--variants 8x4,8x2,4x4,16x1] [--mode q8] [--json FILE]

For each model shape, rows bucket and context (every row that long, float16 KV in pages of
16, splits of 32 positions as the runner uses): one CUDA graph per path holding one launch
per layer, each layer reading its own K/V pool (enough pools that a replay does not find the
previous layer's K/V in L2, as in a decode step). Prints us per layer (median of replays) for
`split` (and `split chN`: N positions per warp loaded together, twice attn_decode.decode_chunk),
`lp` (attn_lp.attn_decode_lp, then the combine), each one-launch variant (warps x chunk), and
whether `attn_decode.use_one_launch` picks one launch for that (rows, context) bucket, so its
limits can be set from the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

PAGE = 16
SPLIT = 32
MIN_BYTES = 200 << 20  # K/V bytes cycled through per replay (4x the H200's 50 MB L2)


def _replay_ms(graphs, key, stream, reps: int) -> float:
    from numba import cuda

    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(reps + 2):
        start.record(stream)
        graphs.replay(key)
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times[2:])


def time_case(spec, rows: int, context: int, variants, mode: str, stream, rng, reps: int = 20) -> list[dict]:
    from numba import cuda

    from ninfer.gpu.cuda.graphs import GraphCache
    from ninfer.gpu.cuda.kernels import attn_decode, attn_lp

    pages_per = -(-context // PAGE)
    kv_shape = (rows * pages_per + 1, PAGE, spec.num_kv_heads, spec.head_dim)
    pool_bytes = 2 * int(np.prod(kv_shape)) * 2
    layers = max(2, min(spec.num_layers, -(-MIN_BYTES // pool_bytes)))
    host = rng.standard_normal(kv_shape, dtype=np.float32).astype(np.float16)
    vhost = host[::-1].copy()
    pools = [(cuda.to_device(host, stream=stream), cuda.to_device(vhost, stream=stream)) for _ in range(layers)]
    tables = cuda.to_device(np.arange(rows * pages_per, dtype=np.int32).reshape(rows, pages_per), stream=stream)
    lens = cuda.to_device(np.full(rows, context, np.int32), stream=stream)
    q = cuda.to_device(rng.standard_normal((rows, spec.q_dim)).astype(np.float32), stream=stream)
    splits = -(-context // SPLIT)
    o_part = cuda.device_array((rows, spec.num_heads, splits, spec.head_dim), np.float32, stream=stream)
    ml = cuda.device_array((rows, spec.num_heads, splits, 2), np.float32, stream=stream)
    out = cuda.device_array((rows, spec.q_dim), np.int8 if mode == "q8" else np.float32, stream=stream)
    xs = cuda.device_array((rows, 2 * spec.q_dim // 32), np.float32, stream=stream)

    def split_launch(ch: int = 0):
        def launch():
            for k, v in pools:
                attn_decode.attn_decode(spec, q, k, v, tables, lens, o_part, ml, out, xs, rows, SPLIT, mode, stream, splits,
                                        ch=ch)  # fmt: skip

        return launch

    def one_launch(warps, ch):
        def launch():
            for k, v in pools:
                attn_decode.attn_decode_one(spec, q, k, v, tables, lens, out, xs, rows, mode, stream, warps=warps, ch=ch)

        return launch

    def lp_launch():
        for k, v in pools:
            attn_lp.attn_decode_lp(spec, q, k, v, tables, lens, o_part, ml, out, xs, rows, mode, stream, splits)

    ch2 = 2 * attn_decode.decode_chunk(spec.head_dim)
    cases = [("split", split_launch()), ("lp", lp_launch), (f"split ch{ch2}", split_launch(ch2))]
    cases += [(f"one {w}x{c}", one_launch(w, c)) for w, c in variants]
    graphs = GraphCache(stream)
    results = []
    picks = attn_decode.use_one_launch(spec.head_dim, spec.num_kv_heads, rows, splits * SPLIT)
    for name, launch in cases:
        launch()  # compile and warm up eagerly
        stream.synchronize()
        graphs.capture(name, launch)
        us = 1e3 * _replay_ms(graphs, name, stream, reps) / layers
        results.append({"path": name, "rows": rows, "context": context, "us": round(us, 2), "rule_one": picks})
        print(json.dumps(results[-1]), flush=True)
    graphs.close()
    return results


def _variants(text: str):
    out = []
    for item in text.split(","):
        w, c = item.lower().split("x")
        out.append((int(w), int(c)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.attn_tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--variants", default="8x4,8x2,4x4,16x1", help="one-launch warps x chunk, comma separated")
    p.add_argument("--mode", default="q8", choices=("q8", "f32"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)

    from numba import cuda

    from ninfer.gpu.cuda.kernels import attn_decode
    from ninfer.gpu.cuda.random_model import random_spec

    stream = cuda.stream()
    rng = np.random.default_rng(0)
    variants = _variants(args.variants)
    results = []
    for shape in args.shapes.split(","):
        spec = random_spec(shape)
        for rows in map(int, args.rows.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                case = time_case(spec, rows, ctx, variants, args.mode, stream, rng, args.reps)
                results += [dict(r, shape=shape) for r in case]
                best = min(case[2:], key=lambda r: r["us"])
                print(json.dumps({"shape": shape, "rows": rows, "context": ctx, "split_us": case[0]["us"],
                                  "lp_us": case[1]["us"],
                                  "best_other": best["path"], "best_other_us": best["us"],
                                  "speedup": round(case[0]["us"] / best["us"], 2),
                                  "one_chunks": -(-ctx // attn_decode.one_launch_chunk(spec.head_dim)),
                                  "rule_one": case[0]["rule_one"]}), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
