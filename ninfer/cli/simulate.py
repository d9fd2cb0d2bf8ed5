"""`ninfer simulate`: replay a synthetic workload through the scheduler in virtual time."""

from __future__ import annotations

import argparse
import sys

from ninfer.cli.common import positive_int_list

DESCRIPTION = """\
Replay a synthetic workload against the real scheduler and a fake runner whose steps cost
what the cost model says, in virtual time, so scheduling policy can be tuned without a GPU.
The same seed always gives the same numbers.

--workload poisson (the default): Poisson arrivals, log-normal prompt and output lengths,
clients that give up. Prints time-to-first-token and inter-token latency percentiles, queue
time, throughput and preemption counts.

--workload burst: --arrivals requests at one instant, all sharing one
--shared-prefix-tokens prefix (a system prompt), each with a --suffix-tokens suffix of its
own, --bursts times (each after the one before finished; the first finds nothing cached).
Every request gets a lane (--max-concurrency defaults to the arrival count) and the KV pool
holds every request unshared, so the figures show the scheduler, not memory pressure. Prints
per burst the prefix tokens computed and served from the prefix cache, TTFT p50 / p95 and the
steps until the last request had its first token; --arrivals 16,64 replays each count."""

EPILOG = """\
examples:
  ninfer simulate --requests 500 --rate 20 --kv-capacity 16384
  ninfer simulate --workload burst --arrivals 16,64 --shared-prefix-tokens 2000 \\
      --suffix-tokens 150 --output-tokens 64
  ninfer simulate --workload burst --arrivals 64 --max-prefill-tokens 512   # no burst budget
  ninfer simulate --workload burst --arrivals 64 --no-prefix-reuse          # compute every prefix"""

WORKLOADS = ("poisson", "burst")

# Flags whose default depends on the workload (None where the burst derives it from the workload).
POISSON_DEFAULTS = dict(requests=200, rate=8.0, prompt_tokens=256.0, output_tokens=128.0, length_sigma=0.6,
                        cancel_fraction=0.05, cancel_after=2.0, kv_bytes_per_token=23040,
                        max_concurrency=8, max_pending=64, max_context=4096, kv_capacity=32768)  # fmt: skip
BURST_DEFAULTS = dict(arrivals=[16, 64], shared_prefix_tokens=2000, suffix_tokens=150, suffix_spread=30,
                      bursts=2, output_tokens=64,
                      max_concurrency=None, max_pending=None, max_context=None, kv_capacity=None)  # fmt: skip
POISSON_ONLY = ("requests", "rate", "prompt_tokens", "length_sigma", "cancel_fraction", "cancel_after",
                "kv_bytes_per_token")  # fmt: skip
BURST_ONLY = ("arrivals", "shared_prefix_tokens", "suffix_tokens", "suffix_spread", "bursts")


def _positive(convert, what):
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = _positive(int, "a positive integer"), _positive(float, "a positive number")
    parser.add_argument("--workload", choices=WORKLOADS, default="poisson",
                        help="poisson: arrivals over time (default); burst: many requests at once over "
                             "one shared prefix")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    parser.add_argument("--output-tokens", type=pos_float, default=None,
                        help="poisson: mean max_tokens (128); burst: every request's (64)")  # fmt: skip
    load = parser.add_argument_group("--workload poisson")
    load.add_argument("--requests", type=pos_int, help="requests (200)")
    load.add_argument("--rate", type=pos_float, help="mean arrivals per second (8)")
    load.add_argument("--prompt-tokens", type=pos_float, help="mean prompt length (256)")
    load.add_argument("--length-sigma", type=pos_float, help="log-normal spread of both lengths (0.6)")
    load.add_argument("--cancel-fraction", type=_fraction, help="share of clients that leave early (0.05)")
    load.add_argument("--cancel-after", type=pos_float, help="mean seconds before they leave (2)")
    burst = parser.add_argument_group("--workload burst")
    burst.add_argument("--arrivals", type=positive_int_list, metavar="N[,N...]",
                       help="requests arriving at once; a list replays each count (16,64)")  # fmt: skip
    burst.add_argument("--shared-prefix-tokens", type=pos_int, help="the prefix every request shares (2000)")
    burst.add_argument("--suffix-tokens", type=pos_int, help="mean length of each request's own suffix (150)")
    burst.add_argument("--suffix-spread", type=_non_negative_int,
                       help="suffix lengths are uniform in suffix +- this (30)")  # fmt: skip
    burst.add_argument("--bursts", type=pos_int,
                       help="bursts per arrival count, each after the one before finished; "
                            "the first finds nothing cached (2)")  # fmt: skip
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-concurrency", type=pos_int, help="execution lanes (8; burst: the arrival count)")
    engine.add_argument("--max-pending", type=pos_int, help="FIFO bound (64; burst: the arrival count)")
    engine.add_argument("--pending-timeout", type=pos_float, default=60.0, help="queue deadline, s (60)")
    engine.add_argument("--max-context", type=pos_int,
                        help="tokens per sequence (4096; burst: prefix + longest suffix + output + 1)")  # fmt: skip
    engine.add_argument("--kv-capacity", type=pos_int,
                        help="KV tokens (32768; burst: every request's whole sequence, unshared)")  # fmt: skip
    engine.add_argument("--page-size", type=pos_int, default=16, help="tokens per KV page (16)")
    engine.add_argument("--prefill-chunk", type=pos_int, default=512,
                        help="prefill tokens per step, and per row (512)")  # fmt: skip
    engine.add_argument("--max-prefill-tokens", type=pos_int, default=None,
                        help="prefill tokens per step in a burst of short prefills or for a prefill "
                             "others wait on (default 8 x --prefill-chunk; equal to it: no burst budget)")  # fmt: skip
    engine.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                        help="turn the prefix cache off (every prompt computed in full)")  # fmt: skip
    engine.add_argument("--host-snapshot-mib", type=float, default=1024.0,
                        help="host memory for paused KV, MiB (1024)")  # fmt: skip
    # SmolLM2-135M in fp16: 30 layers x 3 KV heads x 64 dims x (K and V) x 2 bytes.
    engine.add_argument("--kv-bytes-per-token", type=pos_int,
                        help="KV bytes per token, sizes snapshots (poisson only; 23040: SmolLM2-135M, fp16)")  # fmt: skip
    cost = parser.add_argument_group("cost model (virtual time)")
    cost.add_argument("--step-ms", type=float, default=4.0, help="fixed cost of one step, ms (4)")
    cost.add_argument("--token-us", type=float, default=20.0, help="per token fed, us (20)")
    cost.add_argument("--row-us", type=float, default=10.0, help="per row in a step, us (10)")
    cost.add_argument("--page-copy-us", type=float, default=5.0,
                      help="per page snapshotted or restored, us (5)")  # fmt: skip


def _formatter(prog):
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="replay a synthetic workload in virtual time", description=DESCRIPTION,
        epilog=EPILOG, formatter_class=_formatter,
    )  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from ninfer.cli.common import CliError

    try:
        print(report_for_args(args))
    except ValueError as exc:  # a configuration the engine refuses, in one sentence
        raise CliError(str(exc)) from None
    return 0


def resolve_workload_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the workload's defaults; a flag of the other workload is an error (ValueError)."""
    burst = args.workload == "burst"
    for name in BURST_ONLY if not burst else POISSON_ONLY:
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} applies to --workload {'poisson' if burst else 'burst'} only")
    resolved = argparse.Namespace(**vars(args))
    for name, default in (BURST_DEFAULTS if burst else POISSON_DEFAULTS).items():
        if getattr(resolved, name) is None:
            setattr(resolved, name, default)
    return resolved


def report_for_args(args: argparse.Namespace) -> str:
    """Build the configuration from the flags, simulate, and format the report."""
    from ninfer.sched.fake import CostModel

    args = resolve_workload_flags(args)
    cost = CostModel(step_s=args.step_ms / 1e3, token_s=args.token_us / 1e6,
                     row_s=args.row_us / 1e6, page_copy_s=args.page_copy_us / 1e6)  # fmt: skip
    if args.workload == "burst":
        return "\n\n".join(burst_report(args, count, cost) for count in args.arrivals)
    return poisson_report(args, cost)


def poisson_report(args: argparse.Namespace, cost) -> str:
    from ninfer.cache.pages import pages_for_tokens
    from ninfer.sched.config import EngineConfig
    from ninfer.sched.simulate import Workload, format_report, simulate

    config = EngineConfig(
        max_concurrency=args.max_concurrency, max_pending=args.max_pending,
        pending_timeout_s=args.pending_timeout, max_context=args.max_context,
        page_size=args.page_size, prefill_chunk=args.prefill_chunk,
        max_prefill_tokens=args.max_prefill_tokens, prefix_cache=args.prefix_reuse,
        host_snapshot_bytes=int(args.host_snapshot_mib * (1 << 20)), kv_capacity=args.kv_capacity,
    )  # fmt: skip
    workload = Workload(
        num_requests=args.requests, arrival_rate_per_s=args.rate,
        mean_prompt_tokens=args.prompt_tokens, mean_output_tokens=args.output_tokens,
        length_sigma=args.length_sigma, cancel_fraction=args.cancel_fraction,
        mean_cancel_after_s=args.cancel_after, seed=args.seed,
    )  # fmt: skip
    report = simulate(
        config, workload, cost=cost, max_context=args.max_context,
        num_pages=pages_for_tokens(args.kv_capacity, args.page_size),
        page_nbytes=args.kv_bytes_per_token * args.page_size,
    )  # fmt: skip
    return format_report(report)


def burst_report(args: argparse.Namespace, num_arrivals: int, cost) -> str:
    """`simulate_burst` for one arrival count: a lane per request unless the flags say otherwise."""
    from ninfer.cache.pages import pages_for_tokens
    from ninfer.sched.simulate import PrefixBurst, burst_config, format_burst_report, simulate_burst

    output_tokens = int(args.output_tokens)
    if output_tokens != args.output_tokens:
        raise ValueError(f"--output-tokens must be a whole number for --workload burst, got {args.output_tokens}")
    workload = PrefixBurst(
        num_requests=num_arrivals, prefix_tokens=args.shared_prefix_tokens, suffix_tokens=args.suffix_tokens,
        suffix_spread=args.suffix_spread, output_tokens=output_tokens, num_bursts=args.bursts, seed=args.seed,
    )  # fmt: skip
    overrides = dict(
        pending_timeout_s=args.pending_timeout, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
        max_prefill_tokens=args.max_prefill_tokens, prefix_cache=args.prefix_reuse,
        host_snapshot_bytes=int(args.host_snapshot_mib * (1 << 20)), kv_capacity=args.kv_capacity,
    )  # fmt: skip
    for name in ("max_concurrency", "max_pending", "max_context"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    config = burst_config(workload, **overrides)
    # What the engine would refuse at submission, said before the replay in flag terms.
    num_longest = workload.prefix_tokens + max(1, workload.suffix_tokens + workload.suffix_spread) + output_tokens
    if num_longest > config.max_context:
        raise ValueError(f"--max-context ({config.max_context}) must hold the longest request "
                         f"(prefix + suffix + spread + output = {num_longest} tokens)")  # fmt: skip
    if num_arrivals > config.max_concurrency + config.max_pending:
        raise ValueError(f"{num_arrivals} arrivals overflow --max-concurrency ({config.max_concurrency}) + "
                         f"--max-pending ({config.max_pending}): the rest would be rejected")  # fmt: skip
    num_pages = None if args.kv_capacity is None else pages_for_tokens(args.kv_capacity, args.page_size)
    return format_burst_report(simulate_burst(workload, config, cost=cost, num_pages=num_pages))


def main(argv: list[str] | None = None) -> int:
    """`python -m ninfer.cli.simulate` / `scripts/simulate.py` without the `ninfer` front end."""
    from ninfer.cli.common import CliError

    parser = argparse.ArgumentParser(prog="ninfer simulate", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_formatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CliError as exc:
        print(f"ninfer simulate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
