"""Where a decode step's time goes, on the GPU (device time per kernel) and on the host.

    python -m ninfer.gpu.cuda.profile --random smollm2-135m --streams 1,64 [--json FILE]

For each batch size: the wall time of `runner.step`, the device time of the captured graph
alone (CUDA events around replays), and the device time of every kernel of one eager forward
(events around each launch; eager launches leave the GPU idle between kernels, so each
event pair brackets one kernel), summed by kernel family.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import numpy as np
from numba import cuda

from ninfer.gpu.cuda import act_quant, attention, embed, forward, gemm, gemv, norm, rope, sampler, swiglu

PAGES_PER_ROW = 16  # 256 positions per stream

_WRAPPED = [(embed, "embed"), (norm, "rmsnorm"), (gemv, "gemv"), (gemm, "gemm"), (rope, "qkv_post"),
            (attention, "attn_decode"), (attention, "attn_prefill"), (swiglu, "swiglu"), (sampler, "sample"),
            (act_quant, "quantize_rows")]  # fmt: skip


def _rows(runner, streams, pos, last):
    from ninfer.gpu.runner import SampleSpec, SamplingParams, StepRow

    greedy = SamplingParams(temperature=0.0)
    per = PAGES_PER_ROW
    return [StepRow(seq_id=i, token_ids=np.asarray(last[i], np.int32).reshape(-1), start_pos=pos,
                    page_table=np.arange(per, dtype=np.int32) + i * per,
                    sample=SampleSpec(params=greedy, seed=0, token_index=pos)) for i in range(streams)]  # fmt: skip


def profile_streams(runner, streams: int, prompt_len: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    last = [rng.integers(0, runner.spec.vocab_size, prompt_len) for _ in range(streams)]
    toks = [t.token_id for t in runner.step(_rows(runner, streams, 0, last))]
    pos = prompt_len
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        toks = [t.token_id for t in runner.step(_rows(runner, streams, pos, toks))]
        walls.append(time.perf_counter() - t0)
        pos += 1
    rows = min(1 << (streams - 1).bit_length(), runner.limits.max_rows)
    key = ("decode", rows, rows)
    gpu_graph = _graph_time(runner, key) if runner._graphs is not None and key in runner._graphs else None
    kernels = _kernel_times(runner, streams, pos, toks)
    return {
        "streams": streams, "context": pos, "wall_ms": 1e3 * statistics.median(walls),
        "graph_gpu_ms": gpu_graph, "kernels_us": kernels, "kernels_total_us": sum(v["us"] for v in kernels.values()),
    }


def _graph_time(runner, bucket, reps: int = 50) -> float:
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(reps):
        start.record(runner.stream)
        runner._graphs.replay(bucket)
        end.record(runner.stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def _kernel_times(runner, streams, pos, toks) -> dict:
    """Device time per kernel family over one eager forward (two launches per decode attention)."""
    from ninfer.gpu.cuda.staging import plan_pieces, stage_inputs

    rows = _rows(runner, streams, pos, toks)
    (batch,) = plan_pieces(rows, runner.limits, runner.page_size)
    staged = stage_inputs(runner.bufs, rows, batch, runner.page_size, runner.num_pages, runner.stream)
    plan = forward.StepPlan(num_tokens=staged.num_tokens, num_rows=staged.num_rows, num_sampled=staged.num_sampled,
                            decode=True)  # fmt: skip
    records = []
    originals = {}
    for mod, name in _WRAPPED:
        fn = getattr(mod, name)
        originals[(mod, name)] = fn

        def timed(*a, _fn=fn, _name=name, **k):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(runner.stream)
            _fn(*a, **k)
            e1.record(runner.stream)
            label = _name
            if _name in ("gemv", "gemm"):
                label += f" {a[0].qtype} {a[0].rows}x{a[0].cols}"
            records.append((label, e0, e1))

        setattr(mod, name, timed)
    try:
        for _ in range(2):  # the first pass may compile the eager (unbucketed) variants
            records.clear()
            runner.forward.launch(plan, runner.stream)
            runner.stream.synchronize()
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)
    out = collections.defaultdict(lambda: {"calls": 0, "us": 0.0})
    for label, e0, e1 in records:
        out[label]["calls"] += 1
        out[label]["us"] += 1e3 * cuda.event_elapsed_time(e0, e1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninfer.gpu.cuda.profile")
    p.add_argument("model", nargs="?")
    p.add_argument("--random", default="smollm2-135m")
    p.add_argument("--random-qtype", default="Q4_1")
    p.add_argument("--streams", default="1,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--activations", default="q8")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.gpu.cuda.runner import CudaRunner

    if args.model:
        from ninfer.models.loader import load_model

        model = load_model(args.model)
    else:
        model = random_model(random_spec(args.random, max_context=1024), args.random_qtype)
    streams = [int(s) for s in args.streams.split(",")]
    runner = CudaRunner(model, num_pages=PAGES_PER_ROW * (max(streams) + 1), page_size=16, max_batch_rows=max(streams),
                        max_context=1024, activations=args.activations)  # fmt: skip
    results = [profile_streams(runner, s, args.prompt, args.steps) for s in streams]
    for r in results:
        print(f"streams {r['streams']}: step wall {r['wall_ms']:.3f} ms, graph on GPU "
              f"{r['graph_gpu_ms'] if r['graph_gpu_ms'] is None else round(r['graph_gpu_ms'], 3)} ms, "
              f"eager kernels sum {r['kernels_total_us'] / 1e3:.3f} ms")  # fmt: skip
        for label, v in r["kernels_us"].items():
            print(f"    {label:36s} {v['calls']:4d} calls {v['us']:9.1f} us  {v['us'] / v['calls']:7.2f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
