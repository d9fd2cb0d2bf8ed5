"""`ninfer serve [MODEL]`: the OpenAI / Anthropic compatible HTTP server."""

from __future__ import annotations

import argparse
import math
import os

from ninfer.cli.common import (
    add_model_arguments, non_negative_int, penalty_float, positive_int, repetition_float, temperature_float,
    unit_float,
)  # fmt: skip

DESCRIPTION = """\
Serve a model over HTTP: OpenAI Chat Completions, Completions and Responses, Anthropic
Messages, tokenize / detokenize, /health and Prometheus /metrics. Every option is checked at
start-up; SIGINT / SIGTERM stop accepting connections, answer queued requests 503, give
in-flight streams --shutdown-grace-s seconds, then end them with an error event saying the
server is shutting down. See docs/serving.md."""

EPILOG = """\
examples:
  ninfer serve                                   # the default model on http://127.0.0.1:8080
  ninfer serve model.gguf --port 9000 --api-key sk-local
  ninfer serve --kv-capacity 65536 --max-concurrency 32 --cors https://app.example"""


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve OpenAI / Anthropic compatible HTTP APIs",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_model_arguments(parser, activations=True)
    _add_http_arguments(parser)
    _add_engine_arguments(parser)
    _add_default_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("http")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=non_negative_int, default=8080, help="port to bind; 0 = any free port (default: 8080)")
    group.add_argument("--model-id", default=None, help="public model name in the APIs (default: the model's own name)")
    group.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require this key (Bearer or x-api-key); repeatable; also $NINFER_API_KEY")
    group.add_argument("--api-key-file", metavar="FILE", help="file with one accepted key per line")
    group.add_argument("--max-request-mib", type=_positive_float, default=8.0, metavar="MIB",
                       help="largest request body; bigger ones get 413 before parsing (default: 8)")
    group.add_argument("--cors", action="append", default=[], nargs="?", const="*", metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; bare --cors allows any origin)")
    group.add_argument("--sse-keepalive-s", type=_positive_float, default=10.0, metavar="S",
                       help="SSE comment interval while a stream waits or prefills (default: 10)")
    group.add_argument("--shutdown-grace-s", type=_non_negative_float, default=10.0, metavar="S",
                       help="time in-flight requests get after SIGINT / SIGTERM (default: 10)")
    group.add_argument("--send-timeout-s", type=_positive_float, default=30.0, metavar="S",
                       help="drop a client that takes none of its answer for this long (default: 30)")
    group.add_argument("--body-timeout-s", type=_positive_float, default=60.0, metavar="S",
                       help="longest wait for a request body; then 408 (default: 60)")
    group.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                       help="log verbosity; debug also logs every request (default: info)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--max-concurrency", type=positive_int, default=8, metavar="N",
                       help="requests generating at once (execution lanes) (default: 8)")
    group.add_argument("--max-pending-requests", type=positive_int, default=64, metavar="N",
                       help="queued requests beyond the lanes; more get 429 (default: 64)")
    group.add_argument("--pending-timeout-ms", type=positive_int, default=60_000, metavar="MS",
                       help="longest wait in the queue; then 503 (default: 60000)")
    group.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="TOKENS",
                       help="prompt tokens per engine step, so long prompts never stall streams (default: 512)")
    group.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                       help="never reuse the KV of earlier requests' shared prompt prefixes (default: reuse)")
    group.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                       help="read each decode step's tokens before submitting the next (default: on a GPU, "
                            "step N + 1 is queued, fed on the device, before step N's tokens are read)")
    group.add_argument("--host-cache-mib", type=_non_negative_float, default=1024.0, metavar="MIB",
                       help="host memory for prefix-cache pages demoted off the device under pressure; "
                            "0 = drop them instead (default: 1024)")


def _add_default_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("defaults for requests that omit a field")
    group.add_argument("--default-max-tokens", type=positive_int, default=None, metavar="N",
                       help="answer length limit (default: whatever the context leaves)")
    group.add_argument("--temperature", type=temperature_float, default=1.0, help="(default: 1)")
    group.add_argument("--top-p", type=unit_float, default=1.0, help="(default: 1)")
    group.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off (default: 0)")
    group.add_argument("--min-p", type=unit_float, default=0.0, help="(default: 0)")
    group.add_argument("--repetition-penalty", type=repetition_float, default=1.0, help="1 = off (default: 1)")
    group.add_argument("--presence-penalty", type=penalty_float, default=0.0, help="(default: 0)")
    group.add_argument("--frequency-penalty", type=penalty_float, default=0.0, help="(default: 0)")


def settings_from_args(args: argparse.Namespace):
    """ServerSettings for the parsed arguments (raises SettingsError with one clear line)."""
    from ninfer.server.settings import ServerSettings, read_api_key_file

    keys = list(args.api_key)
    if os.environ.get("NINFER_API_KEY"):
        keys.append(os.environ["NINFER_API_KEY"])
    if args.api_key_file:
        keys.extend(read_api_key_file(args.api_key_file))
    return ServerSettings(
        model=args.model, host=args.host, port=args.port, model_id=args.model_id, backend=args.backend,
        max_context=args.max_context, kv_capacity=args.kv_capacity, page_size=args.page_size,
        activations=args.activations,
        max_concurrency=args.max_concurrency, max_pending_requests=args.max_pending_requests,
        pending_timeout_ms=args.pending_timeout_ms, prefill_chunk=args.prefill_chunk,
        prefix_reuse=args.prefix_reuse, lookahead=args.lookahead, host_cache_mib=args.host_cache_mib,
        api_keys=tuple(dict.fromkeys(keys)),
        default_max_tokens=args.default_max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_request_mib=args.max_request_mib, log_level=args.log_level,
        cors_origins=tuple(args.cors), keepalive_s=args.sse_keepalive_s, shutdown_grace_s=args.shutdown_grace_s,
        send_timeout_s=args.send_timeout_s, body_timeout_s=args.body_timeout_s,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import trio

    from ninfer.server.serve import serve

    settings = settings_from_args(args)
    trio.run(serve, settings)
    return 0
