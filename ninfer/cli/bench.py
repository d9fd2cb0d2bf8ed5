"""`ninfer bench`: decode and prefill throughput of the runner, next to the bandwidth floor.

Drives the `Runner` directly (no HTTP, no scheduler), greedy, after warm-up runs that compile
kernels and capture the CUDA graphs:

* decode: B streams with 128-token prompts each decode `--decode-tokens` tokens in lock step;
  aggregate tok/s = B * tokens / time. On a pipelined runner (CUDA) each step is submitted fed
  by the step before (its tokens stay on the device) before that step's tokens are collected,
  as the engine's step task does (`--no-lookahead`: each step's tokens are read before the
  next is built); the reference runner computes in `submit`, so there, as in the engine, each
  step's tokens are read before the next (lookahead off);
* prefill: one prompt of L tokens in one step (its first token sampled); tok/s = L / time, and
  time to first token (TTFT) is that step's time;
* GB/s: the bytes one decode step must read (the layers' and the head's weights once, not
  the embedding table a step gathers a few rows of, + the streams' KV) over its time;
* floor (CUDA only): those bytes over the device-to-device copy bandwidth measured on the GPU
  at hand (1 GiB copies), and the fraction of it achieved. The reference backend prints no
  floor: a GPU's copy bandwidth says nothing about the host.

Anchors are printed as ratios when `--anchors llamacpp-h200` is given: llama.cpp on one H200
with the SmolLM2-135M-Instruct Q4_1 GGUF measured 959 / 2,707 / 4,810 / 11,673 tok/s decode at
1 / 4 / 16 / 64 streams and ~51,000 tok/s prefill at 512 tokens (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ninfer.cli.common import add_model_arguments, positive_int, positive_int_list

ANCHORS = {"llamacpp-h200": {"decode": {1: 959, 4: 2707, 16: 4810, 64: 11673}, "prefill": {512: 51000}}}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="measure decode / prefill throughput", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_model_arguments(parser, activations=True)
    parser.add_argument("--streams", type=positive_int_list, default=[1, 4, 16, 64], help="decode batch sizes (1,4,16,64)")
    parser.add_argument("--prompt-lens", type=positive_int_list, default=[512, 4096], help="prefill lengths (512,4096)")
    parser.add_argument("--decode-tokens", type=positive_int, default=128, help="tokens per stream (128)")
    parser.add_argument("--decode-prompt", type=positive_int, default=128, help="prompt tokens per stream (128)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed repeats; the median counts (3)")
    parser.add_argument("--random", metavar="SHAPE", help="random weights of a known shape instead of MODEL "
                        "(smollm2-135m, qwen3-0.6b, llama3-8b)")  # fmt: skip
    parser.add_argument("--random-qtype", default="Q4_1", help="weight type of --random models (Q4_1)")
    parser.add_argument("--no-graphs", action="store_true", help="CUDA: eager launches instead of graphs")
    parser.add_argument("--no-lookahead", action="store_true", help="decode: read each step's tokens before "
                        "submitting the next (default on CUDA: step N + 1 is queued, fed on the device, before "
                        "step N's tokens are read, as the server does; the reference backend never looks ahead)")
    parser.add_argument("--anchors", choices=sorted(ANCHORS), help="print ratios to these reference numbers")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    model, name = _model(args)
    runner, backend = _runner(model, args)
    lookahead = uses_lookahead(runner, args.no_lookahead)
    results = {"model": name, "backend": backend, "weight_bytes": int(runner.step_weight_nbytes),
               "lookahead": lookahead, "decode": [], "prefill": []}  # fmt: skip
    rng = np.random.default_rng(0)
    for streams in args.streams:
        results["decode"].append(bench_decode(runner, streams, args.decode_prompt, args.decode_tokens, args.repeats, rng,
                                              lookahead=lookahead))  # fmt: skip
    for length in args.prompt_lens:
        results["prefill"].append(bench_prefill(runner, length, args.repeats, rng))
    measured = _measured_copy_bandwidth(backend)
    results["copy_gb_s"] = None if measured is None else measured / 1e9
    runner.close()
    _add_floor(results, model.spec if hasattr(model, "spec") else model[0], runner)
    print(format_table(results, ANCHORS.get(args.anchors)))
    if args.json:
        text = json.dumps(results, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


def uses_lookahead(runner, no_lookahead: bool) -> bool:
    """Whether decode submits each step ahead, as the engine decides it: only on a pipelined
    runner (one that computes behind the caller's back), unless --no-lookahead."""
    return not no_lookahead and bool(getattr(runner, "pipelined", False))


def _model(args):
    if args.random:
        from ninfer.gpu.cuda.random_model import random_model, random_spec

        spec = random_spec(args.random)
        # a speed benchmark: layers share each matrix's host copy (drawn once; uploaded apart)
        return random_model(spec, args.random_qtype, reuse_matrices=True), f"random {args.random} {args.random_qtype}"
    from ninfer.runtime import load

    model = load(args.model)
    return model, model.name


def _runner(model, args):
    from ninfer.runtime import build_runner, resolve_backend

    spec = model.spec if hasattr(model, "spec") else model[0]
    backend = resolve_backend(args.backend, spec)
    max_streams = max(args.streams)
    longest = max(max(args.prompt_lens), args.decode_prompt + args.decode_tokens + 2)
    per_seq = -(-longest // args.page_size)
    num_pages = per_seq * max(max_streams, 1) + per_seq
    runner = build_runner(
        model, backend, num_pages=num_pages, page_size=args.page_size, max_batch_rows=max_streams,
        max_tokens_per_step=max(max(args.prompt_lens), args.decode_prompt * max_streams),
        max_context=min(spec.max_context, max(longest, args.max_context or 0)), activations=args.activations,
        kernel_cache=args.kernel_cache, use_graphs=not args.no_graphs, progress=True,
    )  # fmt: skip
    return runner, backend


def _greedy(index):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec

    return SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=index)


def _tables(runner, streams, per_seq):
    return [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(streams)]


def bench_decode(runner, streams: int, prompt_len: int, tokens: int, repeats: int, rng, lookahead: bool = True) -> dict:
    """Median over repeats of the time `streams` rows take to decode `tokens` tokens each.
    lookahead: each step is submitted fed by the one before (its tokens stay on the device)
    before that one's tokens are collected, as the engine's step task does."""
    from ninfer.core.runner import StepRow

    vocab = runner.spec.vocab_size
    per_seq = -(-(prompt_len + tokens + 2) // runner.page_size)
    tables = _tables(runner, streams, per_seq)

    def rows_at(k, last):
        return [StepRow(seq_id=i, token_ids=np.array([last[i] if last else 0], np.int32), start_pos=prompt_len + k,
                        page_table=tables[i], sample=_greedy(k + 1)) for i in range(streams)]  # fmt: skip

    times = []
    for rep in range(repeats + 1):  # the first pass warms up (compiles, captures graphs)
        prompts = rng.integers(0, vocab, (streams, prompt_len)).astype(np.int32)
        rows = [StepRow(seq_id=i, token_ids=prompts[i], start_pos=0, page_table=tables[i], sample=_greedy(0))
                for i in range(streams)]  # fmt: skip
        last = [t.token_id for t in runner.step(rows)]
        t0 = time.perf_counter()
        if lookahead:
            pending = runner.submit(rows_at(0, last))
            for k in range(1, tokens):
                ahead = runner.submit(rows_at(k, None), feed=True)
                last = [t.token_id for t in runner.collect(pending)]
                pending = ahead
            last = [t.token_id for t in runner.collect(pending)]
        else:
            for k in range(tokens):
                last = [t.token_id for t in runner.step(rows_at(k, last))]
        if rep:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"streams": streams, "tokens": tokens, "seconds": t, "tok_s": streams * tokens / t,
            "ms_per_step": 1e3 * t / tokens, "context": prompt_len + tokens, "last_tokens": last}  # fmt: skip


def bench_prefill(runner, length: int, repeats: int, rng) -> dict:
    from ninfer.core.runner import StepRow

    per_seq = -(-(length + 1) // runner.page_size)
    table = np.arange(per_seq, dtype=np.int32)
    times = []
    for rep in range(repeats + 1):
        prompt = rng.integers(0, runner.spec.vocab_size, length).astype(np.int32)
        t0 = time.perf_counter()
        runner.step([StepRow(seq_id=0, token_ids=prompt, start_pos=0, page_table=table, sample=_greedy(0))])
        if rep:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"prompt": length, "seconds": t, "tok_s": length / t, "ttft_ms": 1e3 * t}


def _measured_copy_bandwidth(backend: str) -> float | None:
    """This GPU's copy bandwidth (bytes a second); None without one (then there is no floor)."""
    if backend != "cuda":
        return None
    from ninfer.gpu.cuda.bandwidth import copy_bandwidth

    return copy_bandwidth()


def _add_floor(results: dict, spec, runner) -> None:
    """Bytes per decode step: the weights once, plus each stream's K and V so far and, for
    hybrids, its recurrent state read and written back (float32), over the step's time
    (achieved GB/s) and, when the copy bandwidth was measured (results["copy_gb_s"], CUDA),
    over that bandwidth (the floor)."""
    kv_item = getattr(runner, "kv_dtype", np.dtype(np.float32)).itemsize
    weights = results["weight_bytes"]
    state = 2 * spec.recurrent_state_nbytes(4)  # 0 for dense models
    for d in results["decode"]:
        kv = d["streams"] * (spec.kv_bytes_per_token(kv_item) * (d["context"] - d["tokens"] / 2) + state)
        step_s = d["seconds"] / d["tokens"]
        d["achieved_gb_s"] = (weights + kv) / step_s / 1e9
        if results["copy_gb_s"] is None:
            continue
        floor_s = (weights + kv) / (results["copy_gb_s"] * 1e9)
        d["floor_ms_per_step"] = 1e3 * floor_s
        d["floor_tok_s"] = d["streams"] / floor_s
        d["fraction_of_floor"] = floor_s / step_s


def format_table(results: dict, anchors: dict | None) -> str:
    has_floor = results.get("copy_gb_s") is not None
    floor = f"floor at {results['copy_gb_s']:,.0f} GB/s (copy measured here)" if has_floor else "no floor (CUDA only)"
    lines = [f"model {results['model']}  backend {results['backend']}  weights {results['weight_bytes'] / 1e6:.1f} MB"
             f"  lookahead {'on' if results.get('lookahead') else 'off'}  {floor}"]
    lines.append("decode  streams   tok/s  ms/step" + ("  floor tok/s  of floor" if has_floor else "") + "   GB/s"
                 + ("   vs anchor" if anchors else ""))  # fmt: skip
    for d in results["decode"]:
        line = f"        {d['streams']:7d} {d['tok_s']:7.0f} {d['ms_per_step']:8.3f}"
        if has_floor:
            line += f" {d['floor_tok_s']:12.0f} {100 * d['fraction_of_floor']:8.1f}%"
        line += f" {d.get('achieved_gb_s', 0):6.0f}"
        ref = anchors and anchors["decode"].get(d["streams"])
        lines.append(line + (f"   {d['tok_s'] / ref:5.2f}x of {ref}" if ref else ""))
    lines.append("prefill  prompt   tok/s  TTFT ms" + ("   vs anchor" if anchors else ""))
    for p in results["prefill"]:
        line = f"        {p['prompt']:7d} {p['tok_s']:7.0f} {p['ttft_ms']:8.2f}"
        ref = anchors and anchors["prefill"].get(p["prompt"])
        lines.append(line + (f"   {p['tok_s'] / ref:5.2f}x of {ref}" if ref else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m ninfer.cli.bench ...`: the bench alone (no server dependencies imported);
    errors are reported as under `ninfer bench`."""
    from ninfer.cli.common import run_reporting_errors

    root = argparse.ArgumentParser(prog="ninfer")
    args = add_parser(root.add_subparsers(dest="command", required=True)).parse_args(argv)
    return run_reporting_errors("bench", run, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
