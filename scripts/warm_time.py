"""Lab: the CUDA runner's start-up without a model file, for A/B runs of two trees.

Builds a random-weight model of a known shape, creates the runner as `ninfer serve` does and
runs its warm-up (every decode bucket and prefill shape compiled and captured), printing the
wall times and the kernel cache's line. It imports `ninfer` from PYTHONPATH, so one copy of
this script times any tree:

    PYTHONPATH=path/to/tree python scripts/warm_time.py [--shape smollm2-135m] [--max-concurrency 64]

Run it twice per tree on one machine: the first run fills the kernel cache, the second is
what a restart pays. `--capture-once on|off` sets the plan's graph recording for an A/B
within one tree.
"""

from __future__ import annotations

import argparse
import time
import types


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--qtype", default="Q4_1")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--capture-once", choices=("on", "off"), help="KernelPlan.capture_once (default: the plan's)")
    args = ap.parse_args()

    from ninfer import runtime
    from ninfer.gpu.cuda.random_model import random_model, random_spec
    from ninfer.sched.config import EngineConfig

    t0 = time.perf_counter()
    spec, weights = random_model(random_spec(args.shape), args.qtype)
    model = types.SimpleNamespace(spec=spec, weights=weights)  # what create_runner reads of a model
    t1 = time.perf_counter()
    options = runtime.RuntimeOptions(backend="cuda")
    runner, backend, config = runtime.create_runner(model, options, EngineConfig(max_concurrency=args.max_concurrency))
    if args.capture_once:
        import attrs

        runner.set_plan(attrs.evolve(runner.plan, capture_once=args.capture_once == "on"))
    t2 = time.perf_counter()
    runtime.warm_up(runner, backend, config)
    t3 = time.perf_counter()
    print(f"capture_once {runner.plan.capture_once}: draw {t1 - t0:.2f} s, create_runner {t2 - t1:.2f} s, warm_up {t3 - t2:.2f} s; "
          f"{runtime.kernel_cache_summary()}")  # fmt: skip
    runner.close()


if __name__ == "__main__":
    main()
