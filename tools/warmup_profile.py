"""Where a server's warm-up goes: cProfile over `runtime.warm_up` (every decode bucket and
prefill shape compiled and captured), as `ninfer serve` runs it.

    python -m tools.warmup_profile MODEL.gguf [--max-concurrency 64] [--top 30] [--out FILE.prof]
    python -m tools.warmup_profile --random smollm2-135m      # random weights of that shape, no file

Prints the wall times of model load, runner creation and warm-up, the kernel cache's line,
and the functions with the most cumulative and own time. Run it twice on one machine: the
first run fills the kernel cache, the second is what a restart pays.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import types


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--random", metavar="SHAPE", help="random weights of a known shape instead of MODEL")
    ap.add_argument("--random-qtype", default="Q4_1")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--activations", default="q8")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the raw profile here")
    args = ap.parse_args()

    from ninfer import runtime
    from ninfer.sched.config import EngineConfig

    t0 = time.perf_counter()
    if args.random:
        from ninfer.gpu.cuda.random_model import random_model, random_spec

        spec, weights = random_model(random_spec(args.random), args.random_qtype)
        model = types.SimpleNamespace(spec=spec, weights=weights)  # what create_runner reads of a model
    else:
        model = runtime.load(args.model, progress=False)
    t1 = time.perf_counter()
    config = EngineConfig(max_concurrency=args.max_concurrency)
    options = runtime.RuntimeOptions(backend="cuda", activations=args.activations)
    runner, backend, config = runtime.create_runner(model, options, config)
    t2 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    runtime.warm_up(runner, backend, config)
    prof.disable()
    t3 = time.perf_counter()
    print(f"load {t1 - t0:.2f} s, create_runner {t2 - t1:.2f} s, warm_up {t3 - t2:.2f} s; {runtime.kernel_cache_summary()}")
    if args.out:
        prof.dump_stats(args.out)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    runner.close()


if __name__ == "__main__":
    main()
