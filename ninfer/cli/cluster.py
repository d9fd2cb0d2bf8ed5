"""`ninfer cluster`: replicas on Ray Serve behind one endpoint; `ninfer cluster-sim`: routing
policies compared in virtual time (docs/cluster.md)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ninfer.cli.common import positive_int, positive_int_list
from ninfer.cluster.routing import DEFAULT_ROUTE_PAGES

INSTALL_HINT = ("ninfer cluster needs Ray Serve, an optional extra: pip install 'ninfer[cluster]' "
                "(or: pip install 'ray[serve]==2.60.0')")  # fmt: skip

DESCRIPTION = """\
Run N ninfer engines as Ray Serve replicas behind one HTTP address, with the same OpenAI /
Anthropic / scoring routes as `ninfer serve`. Requests are routed by prefix: the ingress renders
each prompt with the model's chat template and tokenizer and hashes its first --route-pages KV
pages into the prefix cache's own key (with the request's cache_salt), so every turn of a
conversation goes to the replica whose prefix cache holds it, unless that replica has
--spill-threshold requests or more, when the least-loaded replica takes it. KV caches are per
replica. A replica whose engine dies is restarted by Serve. GET /metrics shows every replica's metrics (label replica) and the
router's counters; GET /cluster/replicas lists the replicas."""

EPILOG = """\
examples:
  ninfer cluster --replicas 2 --backend reference      # a local Ray instance, CPU replicas
  ninfer cluster --replicas 8                          # one GPU each (--backend auto finds them)
  ninfer cluster --address auto --min-replicas 2 --max-replicas 16   # an existing Ray cluster
  ninfer cluster --serve-flags "--max-concurrency 16 --api-key KEY"
  ninfer cluster-sim --replicas 8,32,128"""

SIM_DESCRIPTION = """\
Replay a multi-tenant, multi-turn chat trace over 8 / 32 / 128 replicas in virtual time and
compare prefix-aware routing (the policy `ninfer cluster` runs) with round-robin and
least-loaded: prefix-cache hit rate, TTFT p50 / p99 and load imbalance (the busiest replica's
busy time over the mean). Pure Python: no Ray needed. The same seed gives the same table."""


def _threshold(text: str) -> int | None:
    if text.lower() in ("none", "off"):
        return None
    return positive_int(text)


def add_parsers(subparsers) -> None:
    parser = subparsers.add_parser("cluster", help="serve N replicas behind one endpoint on Ray Serve",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("model", nargs="?", metavar="MODEL", help="as `ninfer serve MODEL` (default model)")
    parser.add_argument("--replicas", type=positive_int, default=2, help="replicas, without autoscaling (2)")
    parser.add_argument("--min-replicas", type=positive_int, help="autoscale from this many replicas ...")
    parser.add_argument("--max-replicas", type=positive_int, help="... up to this many (both needed)")
    parser.add_argument("--target-ongoing-requests", type=float, default=8.0,
                        help="autoscaling target: requests running + queued per replica (8)")  # fmt: skip
    parser.add_argument("--backend", choices=("auto", "cuda", "cpu", "reference"), default="auto",
                        help="auto: one GPU per replica when the Ray cluster has GPUs, else what `ninfer serve` "
                             "picks without one (cpu for llama / qwen2 / qwen3, reference for the rest)")  # fmt: skip
    parser.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves (1)")
    parser.add_argument("--address",
                        help="an existing Ray cluster (`auto`, or ray://HOST:PORT); default: start a local one")  # fmt: skip
    parser.add_argument("--num-cpus", type=positive_int, help="a local Ray instance's CPUs (default: all)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (8000)")
    parser.add_argument("--spill-threshold", type=_threshold, default=8, metavar="N|none",
                        help="a conversation's replica with N requests (running + queued) or more is passed over "
                             "for the least-loaded one; none: never (8)")  # fmt: skip
    parser.add_argument("--route-pages", type=positive_int, default=DEFAULT_ROUTE_PAGES, metavar="N",
                        help="route on the prefix cache's key of the first N KV pages of a conversation's first "
                             f"turn (--page-size tokens each, from --serve-flags; {DEFAULT_ROUTE_PAGES})")  # fmt: skip
    parser.add_argument("--max-ongoing-requests", type=positive_int, default=72,
                        help="requests Serve sends one replica at once (72: serve's 8 lanes + 64 queued)")  # fmt: skip
    parser.add_argument("--serve-flags", default="", metavar="FLAGS",
                        help="more `ninfer serve` flags for every engine, "
                             "one string (e.g. \"--max-concurrency 16\")")  # fmt: skip
    parser.set_defaults(run=run)

    sim = subparsers.add_parser("cluster-sim", help="compare routing policies over many replicas in virtual time",
                                description=SIM_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sim.add_argument("--replicas", type=positive_int_list, default=[8, 32, 128], metavar="N[,N...]",
                     help="cluster sizes (8,32,128)")  # fmt: skip
    sim.add_argument("--conversations-per-replica", type=positive_int, default=40, help="(40)")
    sim.add_argument("--rate-per-replica", type=float, default=0.5, help="new conversations per s per replica (0.5)")
    sim.add_argument("--tenants", type=positive_int, default=16, help="tenants, each its own system prompt (16)")
    sim.add_argument("--turns", type=positive_int, default=4, help="user turns per conversation (4)")
    sim.add_argument("--lanes", type=positive_int, default=8, help="requests a replica runs at once (8)")
    sim.add_argument("--spill-threshold", type=_threshold, default=8, metavar="N|none", help="as for `cluster` (8)")
    sim.add_argument("--seed", type=int, default=0, help="trace seed (0)")
    sim.set_defaults(run=run_sim)


def cluster_options(args: argparse.Namespace):
    from ninfer.cli.common import CliError
    from ninfer.cluster.deployments import ClusterOptions

    if (args.min_replicas is None) != (args.max_replicas is None):
        raise CliError("--min-replicas and --max-replicas go together")
    if args.min_replicas is not None and args.min_replicas > args.max_replicas:
        raise CliError(f"--min-replicas ({args.min_replicas}) must not exceed --max-replicas ({args.max_replicas})")
    flags = tuple(shlex.split(args.serve_flags))
    owned = {"--host", "--port", "--backend"} & {f.split("=", 1)[0] for f in flags}
    if owned:
        raise CliError(f"--serve-flags may not set {', '.join(sorted(owned))}: each replica picks its own")
    from ninfer.cluster.prompt_keys import serve_page_size

    try:  # the ingress keys prompts by the replicas' KV pages
        if serve_page_size(flags) < 1:
            raise ValueError
    except ValueError:
        raise CliError("--serve-flags: --page-size needs a positive number of tokens") from None
    return ClusterOptions(
        model=args.model, serve_flags=flags, backend=args.backend, num_replicas=args.replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, num_cpus_per_replica=args.cpus_per_replica,
        max_ongoing_requests=args.max_ongoing_requests, spill_threshold=args.spill_threshold,
        route_pages=args.route_pages,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        print(f"ninfer cluster: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from ninfer.cluster import launch

    options = cluster_options(args)
    ray_options = launch.RayOptions(address=args.address, num_cpus=args.num_cpus, host=args.host, port=args.port)
    try:
        options, url = launch.start(options, ray_options)
        replicas = (f"{options.min_replicas}-{options.max_replicas} (autoscaling)" if options.min_replicas
                    else str(options.num_replicas))  # fmt: skip
        print(f"serving on {url} ({replicas} replicas, {options.backend} backend); Ctrl-C stops", flush=True)
        _wait_forever()
    finally:
        launch.stop()
    return 0


def _wait_forever() -> None:
    import threading

    threading.Event().wait()


def run_sim(args: argparse.Namespace) -> int:
    from ninfer.cluster.routing import RoutingPolicy
    from ninfer.cluster.simulate import ChatTrace, ReplicaModel, compare, format_table

    trace = ChatTrace(conversations_per_replica=args.conversations_per_replica, rate_per_replica=args.rate_per_replica,
                      num_tenants=args.tenants, turns=args.turns, seed=args.seed)  # fmt: skip
    figures = compare(trace, tuple(args.replicas), model=ReplicaModel(lanes=args.lanes),
                      routing=RoutingPolicy(spill_threshold=args.spill_threshold))  # fmt: skip
    print(format_table(figures))
    return 0
