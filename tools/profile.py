"""Where a decode step's time goes: host side versus the captured graph on the GPU.

    python -m tools.profile [MODEL.gguf] --streams 1,64 [--json FILE]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python -m tools.profile --ncu --streams 1        # device time per kernel
    python -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 \
        --streams 1 --remove qkv,attention,o,norm,gate_up,down,head  # in-step cost by removal
    python -m tools.profile ... --variant "default:" --variant "no-pdl:pdl=False"  # A/B of two KernelPlans

For each batch size: the wall time of `runner.step` and the device time of its captured
decode graph alone (CUDA events around replays). Per-kernel times need a profiler: events
around eager launches measure Python's launch latency, not the kernels; and a profiler's
per-kernel time is not what a kernel costs inside the step, where programmatic edges overlap
its start with the kernel before. `--remove KINDS` measures that instead: the graph re-captured
without one kind of launch at a time (the results are wrong, the timings are not), beside the
whole graph, in the same process. `--variant LABEL:FIELDS` times the step under another
`KernelPlan` (FIELDS as plan.parse_plan reads them), in the same process.
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
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

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
    key = _decode_key(runner, _bucket_rows(runner, streams))
    gpu_graph = _graph_time(runner, key) if key is not None else None
    return {"streams": streams, "context": pos, "wall_ms": 1e3 * statistics.median(walls), "graph_gpu_ms": gpu_graph,
            "graph_nodes": _nodes(runner, key) if gpu_graph is not None else None,
            "programmatic_edges": runner._graphs.programmatic.get(key) if gpu_graph is not None else None}  # fmt: skip


def _bucket_rows(runner, streams: int) -> int:
    """The decode graphs' row bucket that `streams` rows fall in."""
    return min(1 << (streams - 1).bit_length(), runner.limits.max_rows)


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


def trace_decode(runner, streams: int, label: str, reps: int) -> dict:
    """CUPTI's kernel timeline of `reps` replays of the decode graph last captured for `streams`
    (trace.py), printed with one middle stretch of nodes."""
    from tools import trace

    key = _decode_key(runner, _bucket_rows(runner, streams))
    steps = trace.record_replays(lambda: runner._graphs.replay(key), runner.stream.synchronize, reps)
    s = trace.summarize(steps)
    n = len(s["nodes"])
    trace.print_summary(f"{label} streams {streams}", s, (n // 2, n // 2 + 12))
    return s


def _ncu_replays(runner, streams, prompt_len) -> int:
    from cuda.bindings import driver

    rng = np.random.default_rng(0)
    for s in streams:
        last = [rng.integers(0, runner.spec.vocab_size, prompt_len) for _ in range(s)]
        toks = [t.token_id for t in runner.step(_rows(runner, s, 0, last))]
        for k in range(3):  # compile, capture, replay once
            toks = [t.token_id for t in runner.step(_rows(runner, s, prompt_len + k, toks))]
        rows = _bucket_rows(runner, s)
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


# --remove: what each kind of launch is, by the weights it reads (every GEMV flavour takes its
# DeviceWeight first, but gemv_rope second), by the Forward method that issues it, or by its
# module function (combine: the decode attention's split merge; sampler)
REMOVABLE = ("qkv", "attention", "combine", "o", "norm", "gate_up", "down", "head", "sampler")
_GEMV_FNS = (("gemv", "gemv"), ("gemv_folds", "gemv_rope"), ("gemv_folds", "gemv_swiglu"), ("gemv_folds", "gemv_fused"))


def _weights_of(model, kind: str) -> set[int]:
    layers = model.layers
    ws = {"qkv": [w for l in layers for w in l.wqkv], "o": [l.wo for l in layers],
          "gate_up": [w for l in layers for w in l.w_gate_up], "down": [l.w_down for l in layers],
          "head": [model.head]}[kind]  # fmt: skip
    return {id(w) for w in ws}


def _modules():
    from ninfer.gpu.cuda import forward
    from ninfer.gpu.cuda.kernels import attn_decode, attn_lp, gemv, gemv_folds, sampler

    return {"forward": forward, "attn_decode": attn_decode, "attn_lp": attn_lp, "gemv": gemv, "gemv_folds": gemv_folds,
            "sampler": sampler}  # fmt: skip


def _patchable():
    """The functions removals replace, and a function restoring them."""
    m = _modules()
    saved = [(m[mod], n, getattr(m[mod], n)) for mod, n in _GEMV_FNS]
    saved += [(m["forward"].Forward, n, vars(m["forward"].Forward)[n]) for n in ("_attention", "_norm")]
    saved += [(m[mod], "attn_combine_kernel", m[mod].attn_combine_kernel) for mod in ("attn_decode", "attn_lp")]
    saved += [(m["sampler"], "sample", m["sampler"].sample)]

    def restore():
        for owner, name, fn in saved:
            setattr(owner, name, fn)

    return restore


class _NoLaunch:
    """A kernel whose `kernel[grid, block, stream](...)` launches nothing."""

    def __getitem__(self, config):
        return lambda *args: None


def _remove(model, kind: str) -> None:
    """Drop one kind of launch from every step built afterwards. Removing a GEMV that has a
    fold drops the fold with it (QKV: RoPE / K-V write; gate+up: SwiGLU; a prologue fold: its
    RMSNorm)."""
    m = _modules()
    if kind in ("attention", "norm"):
        setattr(m["forward"].Forward, f"_{kind}", lambda *a, **k: None)
        return
    if kind == "combine":  # kernel[grid, block, stream](...) launches nothing (attn_lp's combine too)
        m["attn_decode"].attn_combine_kernel = m["attn_lp"].attn_combine_kernel = lambda *a: _NoLaunch()
        return
    if kind == "sampler":
        m["sampler"].sample = lambda *a, **k: None
        return
    drop = _weights_of(model, kind)
    for mod, name in _GEMV_FNS:
        fn = getattr(m[mod], name)

        def skip(*args, _fn=fn, _w=1 if name == "gemv_rope" else 0, **kw):
            return None if id(args[_w]) in drop else _fn(*args, **kw)

        setattr(m[mod], name, skip)


def removal_variants(kinds: str) -> list[str]:
    """--remove's variants: the whole graph, then one without each kind."""
    names = [k for k in kinds.split(",") if k]
    bad = [k for k in names if k not in REMOVABLE]
    if bad:
        raise SystemExit(f"--remove takes {', '.join(REMOVABLE)}; got {', '.join(bad)}")
    return ["all:"] + [f"no {k}:remove" for k in names]


def _variants(runner, variants, streams, prompt_len, steps, rounds, trace_reps=0) -> list[dict]:
    """Each variant "LABEL:FIELDS" runs under the KernelPlan FIELDS make of the default one
    (plan.parse_plan; removal variants "no KIND:remove" drop a kind of launch instead), every
    graph dropped and captured anew."""
    from ninfer.gpu.cuda.plan import KernelPlan, parse_plan

    results = []
    restore = _patchable()
    for rnd in range(rounds):
        for v in variants:
            label, _, fields = v.partition(":")
            restore()
            if label.startswith("no ") and fields == "remove":
                _remove(runner.forward.model, label[3:])
                plan = KernelPlan()
            else:
                plan = parse_plan(fields)
            runner.set_plan(plan)
            for s in streams:
                r = {"variant": label, "round": rnd + 1, **profile_streams(runner, s, prompt_len, steps)}
                results.append(r)
                print(f"{label} (round {rnd + 1}) streams {s}: step wall {r['wall_ms']:.4f} ms, graph on GPU "
                      f"{_ms(r['graph_gpu_ms'])} ({r['graph_nodes']} nodes, {r['programmatic_edges']} programmatic edges)",
                      flush=True)  # fmt: skip
                if trace_reps:
                    r["trace"] = trace_decode(runner, s, label, trace_reps)
    restore()
    _print_removals(results)
    return results


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4f} ms"


def _print_removals(results) -> None:
    """Each removal variant's graph time against the whole graph's of the same round and batch."""
    whole = {(r["round"], r["streams"]): r["graph_gpu_ms"] for r in results if r["variant"] == "all"}
    for r in results:
        base = whole.get((r["round"], r["streams"]))
        if r["variant"].startswith("no ") and base is not None and r["graph_gpu_ms"] is not None:
            print(f"{r['variant']:>14} (round {r['round']}) streams {r['streams']}: "
                  f"{1e3 * (base - r['graph_gpu_ms']):8.1f} us a step in the graph")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profile")
    p.add_argument("model", nargs="?")
    p.add_argument("--random", default="smollm2-135m")
    p.add_argument("--random-qtype", default="Q4_1")
    p.add_argument("--streams", default="1,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--activations", default="f32")
    p.add_argument("--plan", default="", metavar="FIELDS", help="the KernelPlan of a plain run (as --variant's FIELDS)")
    p.add_argument("--json")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:FIELDS",
                   help="A/B in one process: the default KernelPlan with FIELDS changed ('field=value; ...', Python "
                        "literals, e.g. \"pdl=False\"), every graph re-captured, timed; repeatable")  # fmt: skip
    p.add_argument("--remove", default="", metavar="KINDS",
                   help=f"in-step cost by removal: variants without each of these launch kinds ({','.join(REMOVABLE)}) "
                        "beside the whole graph (results wrong, timings not)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="with --variant / --remove: passes over the variants")
    p.add_argument("--ncu", action="store_true", help="under `ncu --profile-from-start off`: after warm-up, "
                   "replay each stream count's decode graph once between cuProfilerStart / Stop")  # fmt: skip
    p.add_argument("--prefill", type=int, default=0, help="with --ncu: profile one prefill of this many tokens "
                   "instead of the decode graphs")  # fmt: skip
    p.add_argument("--trace", type=int, default=0, metavar="REPS",
                   help="after each variant (or the plain run): REPS replays of the decode graph under CUPTI, "
                        "each kernel's end-to-end increment (needs cupti-python)")  # fmt: skip
    args = p.parse_args(argv)
    if args.trace:
        import importlib.util

        if importlib.util.find_spec("cupti") is None:  # before minutes of loading and capture
            p.error("--trace needs cupti-python (and libcupti) matched to the driver's CUDA: "
                    "scripts/device_prepare.sh downloads them into .whl/trace")  # fmt: skip
    variants = (removal_variants(args.remove) if args.remove else []) + args.variant
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.gpu.cuda.runner import CudaRunner

    if args.model:
        from ninfer.models.loader import load_model

        model = load_model(args.model)
    else:
        model = random_model(random_spec(args.random, max_context=1024), args.random_qtype)
    streams = [int(s) for s in args.streams.split(",")]
    from ninfer.gpu.cuda.plan import parse_plan

    for v in args.variant:  # a typo fails before minutes of loading
        if not v.partition(":")[2].endswith("remove"):
            parse_plan(v.partition(":")[2])
    runner = CudaRunner(model, num_pages=PAGES_PER_ROW * (max(streams) + 1), page_size=16, max_batch_rows=max(streams),
                        max_context=1024, activations=args.activations, plan=parse_plan(args.plan))  # fmt: skip
    if args.ncu and args.prefill:
        return _ncu_prefill(runner, args.prefill)
    if args.ncu:
        return _ncu_replays(runner, streams, args.prompt)
    if variants:  # each variant's line is printed as it finishes
        results = _variants(runner, variants, streams, args.prompt, args.steps, args.rounds, args.trace)
    else:
        results = [profile_streams(runner, s, args.prompt, args.steps) for s in streams]
        for r in results:
            print(f"streams {r['streams']}: step wall {r['wall_ms']:.3f} ms, graph on GPU {r['graph_gpu_ms']} ms "
                  f"({r['graph_nodes']} nodes, {r['programmatic_edges']} programmatic edges)")  # fmt: skip
            if args.trace:
                r["trace"] = trace_decode(runner, r["streams"], "default", args.trace)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
