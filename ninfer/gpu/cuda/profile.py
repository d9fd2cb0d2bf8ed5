"""Where a decode step's time goes: host side versus the captured graph on the GPU.

    python -m ninfer.gpu.cuda.profile [MODEL.gguf] --streams 1,64 [--json FILE]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python -m ninfer.gpu.cuda.profile --ncu --streams 1        # device time per kernel

For each batch size: the wall time of `runner.step` and the device time of its captured
decode graph alone (CUDA events around replays). Per-kernel times need a profiler: events
around eager launches measure Python's launch latency, not the kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from numba import cuda

PAGES_PER_ROW = 64  # 1,024 positions per stream (the max_context below)


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
    key = _decode_key(runner, rows)
    gpu_graph = _graph_time(runner, key) if key is not None else None
    return {"streams": streams, "context": pos, "wall_ms": 1e3 * statistics.median(walls), "graph_gpu_ms": gpu_graph,
            "graph_nodes": _nodes(runner, key) if gpu_graph is not None else None,
            "programmatic_edges": runner._graphs.programmatic.get(key) if gpu_graph is not None else None}  # fmt: skip


def _nodes(runner, key):
    try:
        return runner._graphs.num_nodes(key)
    except Exception:  # a diagnostic only
        return None


def _decode_key(runner, rows):
    """The most recently captured decode graph of this row bucket."""
    if runner._graphs is None:
        return None
    keys = [k for k in runner._graphs.keys() if k[0] == "decode" and k[1] == rows]
    return keys[-1] if keys else None


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


def _ncu_replays(runner, streams, prompt_len) -> int:
    from cuda.bindings import driver

    rng = np.random.default_rng(0)
    for s in streams:
        last = [rng.integers(0, runner.spec.vocab_size, prompt_len) for _ in range(s)]
        toks = [t.token_id for t in runner.step(_rows(runner, s, 0, last))]
        for k in range(3):  # compile, capture, replay once
            toks = [t.token_id for t in runner.step(_rows(runner, s, prompt_len + k, toks))]
        rows = min(1 << (s - 1).bit_length(), runner.limits.max_rows)
        runner.stream.synchronize()
        driver.cuProfilerStart()
        runner._graphs.replay(_decode_key(runner, rows))
        runner.stream.synchronize()
        driver.cuProfilerStop()
    return 0


def _ncu_prefill(runner, prompt_len) -> int:
    """One prefill step of `prompt_len` tokens (one sequence) between cuProfilerStart / Stop."""
    from cuda.bindings import driver

    rng = np.random.default_rng(0)
    prompt = [rng.integers(0, runner.spec.vocab_size, prompt_len)]
    for _ in range(2):  # compile, capture
        runner.step(_rows(runner, 1, 0, prompt))
    runner.stream.synchronize()
    driver.cuProfilerStart()
    runner.step(_rows(runner, 1, 0, prompt))
    runner.stream.synchronize()
    driver.cuProfilerStop()
    return 0


def _variants(runner, variants, streams, prompt_len, steps, rounds) -> list[dict]:
    """Each variant's code runs over the modules' default switches (upper-case globals, restored
    first), then the forward is rebuilt and every graph dropped, so the variant is captured anew."""
    from ninfer.gpu.cuda import attention, forward, gemv, l2_prefetch, pdl, runner as runner_mod, sampler

    mods = {"forward": forward, "gemv": gemv, "attention": attention, "l2_prefetch": l2_prefetch, "sampler": sampler,
            "runner": runner_mod, "pdl": pdl}  # fmt: skip
    defaults = {m: {k: v for k, v in vars(mod).items() if k.isupper()} for m, mod in mods.items()}
    results = []
    for rnd in range(rounds):
        for v in variants:
            label, _, code = v.partition(":")
            for m, mod in mods.items():
                vars(mod).update(defaults[m])
            exec(code, dict(mods))
            runner.forward = runner.forward.rebuilt()
            runner._graphs.close()
            for s in streams:
                results.append({"variant": f"{label} (round {rnd + 1}) ", **profile_streams(runner, s, prompt_len, steps)})
                r = results[-1]
                print(f"{r['variant']}streams {s}: step wall {r['wall_ms']:.4f} ms, graph on GPU {r['graph_gpu_ms']:.4f} ms "
                      f"({r['graph_nodes']} nodes, {r['programmatic_edges']} programmatic edges)", flush=True)  # fmt: skip
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninfer.gpu.cuda.profile")
    p.add_argument("model", nargs="?")
    p.add_argument("--random", default="smollm2-135m")
    p.add_argument("--random-qtype", default="Q4_1")
    p.add_argument("--streams", default="1,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--activations", default="f32")
    p.add_argument("--json")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:PYTHON",
                   help="A/B in one process: run PYTHON (names: forward, gemv, attention, l2_prefetch, sampler, runner, pdl) "
                        "over the default switches, rebuild the forward, re-capture, time; repeatable")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="with --variant: passes over the variants")
    p.add_argument("--ncu", action="store_true", help="under `ncu --profile-from-start off`: after warm-up, "
                   "replay each stream count's decode graph once between cuProfilerStart / Stop")  # fmt: skip
    p.add_argument("--prefill", type=int, default=0, help="with --ncu: profile one prefill of this many tokens "
                   "instead of the decode graphs")  # fmt: skip
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
    if args.ncu and args.prefill:
        return _ncu_prefill(runner, args.prefill)
    if args.ncu:
        return _ncu_replays(runner, streams, args.prompt)
    if args.variant:  # each variant's line is printed as it finishes
        results = _variants(runner, args.variant, streams, args.prompt, args.steps, args.rounds)
    else:
        results = [profile_streams(runner, s, args.prompt, args.steps) for s in streams]
        for r in results:
            print(f"streams {r['streams']}: step wall {r['wall_ms']:.3f} ms, graph on GPU {r['graph_gpu_ms']} ms "
                  f"({r['graph_nodes']} nodes, {r['programmatic_edges']} programmatic edges)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
