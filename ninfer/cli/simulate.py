"""`ninfer simulate`: replay a synthetic workload through the scheduler in virtual time."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Replay a synthetic workload (Poisson arrivals, log-normal prompt and output lengths, clients
that give up) against the real scheduler and a fake runner whose steps cost what the cost
model says, in virtual time. Prints time-to-first-token and inter-token latency percentiles,
queue time, throughput and preemption counts, so scheduling policy can be tuned without a
GPU. The same seed always gives the same numbers."""


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


def _fraction(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = _positive(int, "a positive integer"), _positive(float, "a positive number")
    load = parser.add_argument_group("workload")
    load.add_argument("--requests", type=pos_int, default=200, help="requests (default 200)")
    load.add_argument("--rate", type=pos_float, default=8.0, help="mean arrivals per second (8)")
    load.add_argument("--prompt-tokens", type=pos_float, default=256.0, help="mean prompt length (256)")
    load.add_argument("--output-tokens", type=pos_float, default=128.0, help="mean max_tokens (128)")
    load.add_argument("--length-sigma", type=pos_float, default=0.6,
                      help="log-normal spread of both lengths (0.6)")  # fmt: skip
    load.add_argument("--cancel-fraction", type=_fraction, default=0.05,
                      help="share of clients that leave early (0.05)")  # fmt: skip
    load.add_argument("--cancel-after", type=pos_float, default=2.0,
                      help="mean seconds before they leave (2)")  # fmt: skip
    load.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-concurrency", type=pos_int, default=8, help="execution lanes (8)")
    engine.add_argument("--max-pending", type=pos_int, default=64, help="FIFO bound (64)")
    engine.add_argument("--pending-timeout", type=pos_float, default=60.0, help="queue deadline, s (60)")
    engine.add_argument("--max-context", type=pos_int, default=4096, help="tokens per sequence (4096)")
    engine.add_argument("--kv-capacity", type=pos_int, default=32768, help="KV tokens (32768)")
    engine.add_argument("--page-size", type=pos_int, default=16, help="tokens per KV page (16)")
    engine.add_argument("--prefill-chunk", type=pos_int, default=512, help="prefill tokens per step (512)")
    engine.add_argument("--host-snapshot-mib", type=float, default=1024.0,
                        help="host memory for paused KV, MiB (1024)")  # fmt: skip
    # SmolLM2-135M in fp16: 30 layers x 3 KV heads x 64 dims x (K and V) x 2 bytes.
    engine.add_argument("--kv-bytes-per-token", type=pos_int, default=23040,
                        help="KV bytes per token, sizes snapshots (23040: SmolLM2-135M, fp16)")  # fmt: skip
    cost = parser.add_argument_group("cost model (virtual time)")
    cost.add_argument("--step-ms", type=float, default=4.0, help="fixed cost of one step, ms (4)")
    cost.add_argument("--token-us", type=float, default=20.0, help="per token fed, us (20)")
    cost.add_argument("--row-us", type=float, default=10.0, help="per row in a step, us (10)")
    cost.add_argument("--page-copy-us", type=float, default=5.0,
                      help="per page snapshotted or restored, us (5)")  # fmt: skip


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="replay a synthetic workload in virtual time", description=DESCRIPTION
    )
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


def report_for_args(args: argparse.Namespace) -> str:
    """Build the configuration from the flags, simulate, and format the report."""
    from ninfer.cache.pages import pages_for_tokens
    from ninfer.sched.config import EngineConfig
    from ninfer.sched.fake import CostModel
    from ninfer.sched.simulate import Workload, format_report, simulate

    config = EngineConfig(
        max_concurrency=args.max_concurrency, max_pending=args.max_pending,
        pending_timeout_s=args.pending_timeout, max_context=args.max_context,
        page_size=args.page_size, prefill_chunk=args.prefill_chunk,
        host_snapshot_bytes=int(args.host_snapshot_mib * (1 << 20)), kv_capacity=args.kv_capacity,
    )  # fmt: skip
    workload = Workload(
        num_requests=args.requests, arrival_rate_per_s=args.rate,
        mean_prompt_tokens=args.prompt_tokens, mean_output_tokens=args.output_tokens,
        length_sigma=args.length_sigma, cancel_fraction=args.cancel_fraction,
        mean_cancel_after_s=args.cancel_after, seed=args.seed,
    )  # fmt: skip
    cost = CostModel(step_s=args.step_ms / 1e3, token_s=args.token_us / 1e6,
                     row_s=args.row_us / 1e6, page_copy_s=args.page_copy_us / 1e6)  # fmt: skip
    report = simulate(
        config, workload, cost=cost, max_context=args.max_context,
        num_pages=pages_for_tokens(args.kv_capacity, args.page_size),
        page_nbytes=args.kv_bytes_per_token * args.page_size,
    )  # fmt: skip
    return format_report(report)


def main(argv: list[str] | None = None) -> int:
    """`python -m ninfer.cli.simulate` / `scripts/simulate.py` without the `ninfer` front end."""
    from ninfer.cli.common import CliError

    parser = argparse.ArgumentParser(prog="ninfer simulate", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CliError as exc:
        print(f"ninfer simulate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
