"""`ninfer serve [MODEL]`: the OpenAI / Anthropic compatible HTTP server."""

from __future__ import annotations

import argparse
import functools

import attrs
import math
import os

from ninfer.cli.common import (
    add_model_arguments, default_of, engine_config, non_negative_int, penalty_float, positive_int, repetition_float,
    runtime_options, sampling_params, temperature_float, unit_float,
)  # fmt: skip
from ninfer.core.params import SamplingParams
from ninfer.sched.config import EngineConfig
from ninfer.server.settings import LOG_LEVELS, MIB, RERANK_OPTIONS, ServerSettings

DESCRIPTION = """\
Serve a model over HTTP: OpenAI Chat Completions, Completions and Responses, Anthropic
Messages, scoring (/v1/score, /v1/rerank), embeddings, tokenize / detokenize, /health and
Prometheus /metrics, llama.cpp's /props, /admin/* (stats, memory, quiesce), a dashboard
(/dashboard) and a chat page (/chat). Every option is checked at
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


def _unit_interval_float(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
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
    d = functools.partial(default_of, ServerSettings)
    group = parser.add_argument_group("http")
    group.add_argument("--host", default=d("host"), help=f"address to bind (default: {d('host')})")
    group.add_argument("--port", type=non_negative_int, default=d("port"),
                       help=f"port to bind; 0 = any free port (default: {d('port')})")
    group.add_argument("--model-id", default=None, help="public model name in the APIs (default: the model's own name)")
    group.add_argument("--served-model-name", action="extend", nargs="+", default=[], metavar="NAME",
                       help="more names requests may send for the model (vLLM's flag); /v1/models lists them; "
                            "'default' and the model's own name are always accepted")
    group.add_argument("--no-webui", dest="webui", action="store_false",
                       help="leave out the web pages: the chat page (/chat, /) and the dashboard (/dashboard)")
    group.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require this key (Bearer or x-api-key); repeatable; also $NINFER_API_KEY")
    group.add_argument("--api-key-file", metavar="FILE", help="file with one accepted key per line")
    group.add_argument("--max-request-mib", type=_positive_float, default=d("max_request_mib"), metavar="MIB",
                       help=f"largest request body; bigger ones get 413 before parsing (default: {d('max_request_mib'):g})")
    group.add_argument("--cors", action="append", default=[], nargs="?", const="*", metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; bare --cors allows any origin)")
    group.add_argument("--frame-gap-us", type=_non_negative_float, default=d("frame_gap_us"), metavar="US",
                       help="with more than 4 streams, a stream's next text frame waits this many microseconds per "
                       "stream running (each frame then carries several tokens, which leaves the engine its steps; "
                       f"0 sends every token at once) (default: {d('frame_gap_us'):g})")
    group.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=d("gc_freeze"),
                       help="once the server is warm, freeze the objects alive out of Python's garbage collector and "
                            "collect new ones less often: fewer, shorter pauses of the event loop that feeds the GPU "
                            "(--no-gc-freeze keeps Python's defaults; /metrics reports the pauses either way) "
                            f"(default: {'on' if d('gc_freeze') else 'off'})")
    group.add_argument("--sse-keepalive-s", type=_positive_float, default=d("keepalive_s"), metavar="S",
                       help=f"SSE comment interval while a stream waits or prefills (default: {d('keepalive_s'):g})")
    group.add_argument("--shutdown-grace-s", type=_non_negative_float, default=d("shutdown_grace_s"), metavar="S",
                       help=f"time in-flight requests get after SIGINT / SIGTERM (default: {d('shutdown_grace_s'):g})")
    group.add_argument("--send-timeout-s", type=_positive_float, default=d("send_timeout_s"), metavar="S",
                       help=f"drop a client that takes none of its answer for this long (default: {d('send_timeout_s'):g})")
    group.add_argument("--body-timeout-s", type=_positive_float, default=d("body_timeout_s"), metavar="S",
                       help=f"longest wait for a request body; then 408 (default: {d('body_timeout_s'):g})")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=d("log_level"),
                       help=f"log verbosity; debug also logs every request (default: {d('log_level')})")
    scoring = parser.add_argument_group("scoring (/v1/score, /v1/rerank)")
    scoring.add_argument("--rerank-max-documents", type=positive_int, default=d("rerank_max_documents"), metavar="N",
                         help=f"documents one /v1/rerank call may send (default: {d('rerank_max_documents')})")
    for name, weight in zip(RERANK_OPTIONS, d("rerank_weights")):
        scoring.add_argument(f"--rerank-weight-{name}", type=_unit_interval_float, default=weight, metavar="W",
                             help=f"relevance of a document judged '{name}', 0..1 (default: {weight:g})")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = functools.partial(default_of, EngineConfig)
    timeout_ms = round(d("pending_timeout_s") * 1000)
    host_cache_mib = d("host_cache_bytes") / MIB
    group = parser.add_argument_group("engine")
    group.add_argument("--max-concurrency", type=positive_int, default=d("max_concurrency"), metavar="N",
                       help=f"requests generating at once (execution lanes) (default: {d('max_concurrency')})")
    group.add_argument("--max-pending-requests", type=positive_int, default=d("max_pending"), metavar="N",
                       help=f"queued requests beyond the lanes; more get 429 (default: {d('max_pending')})")
    group.add_argument("--pending-timeout-ms", type=positive_int, default=timeout_ms, metavar="MS",
                       help=f"longest wait in the queue; then 503 (default: {timeout_ms})")
    group.add_argument("--prefill-chunk", type=positive_int, default=d("prefill_chunk"), metavar="TOKENS",
                       help="prompt tokens per engine step, so long prompts never stall streams "
                            f"(default: {d('prefill_chunk')})")
    group.add_argument("--max-prefill-tokens", type=positive_int, default=None, metavar="TOKENS",
                       help="prompt tokens one step may take when a burst of short prompts (or short suffixes "
                            "over a cached prefix) arrives, or others wait on a shared prefix being computed "
                            "(default: 8 x --prefill-chunk)")
    group.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                       help="never reuse the KV of earlier requests' shared prompt prefixes (default: reuse)")
    group.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                       help="read each decode step's tokens before submitting the next (default: on a GPU, "
                            "step N + 1 is queued, fed on the device, before step N's tokens are read)")
    group.add_argument("--reserve-gib", type=_non_negative_float, default=0.0, metavar="GIB",
                       help="with --kv-capacity auto, leave this much device memory free (host memory on the "
                            "reference backend); a start that cannot fit one full context is refused (default: 0)")
    group.add_argument("--host-cache-mib", type=_non_negative_float, default=host_cache_mib, metavar="MIB",
                       help="host memory for prefix-cache pages demoted off the device under pressure; "
                            f"0 = drop them instead (default: {host_cache_mib:g})")


def _add_default_arguments(parser: argparse.ArgumentParser) -> None:
    d = functools.partial(default_of, SamplingParams)
    group = parser.add_argument_group("defaults for requests that omit a field")
    group.add_argument("--default-max-tokens", type=positive_int, default=None, metavar="N",
                       help="answer length limit (default: whatever the context leaves)")
    group.add_argument("--temperature", type=temperature_float, default=d("temperature"),
                       help=f"(default: {d('temperature'):g})")
    group.add_argument("--top-p", type=unit_float, default=d("top_p"), help=f"(default: {d('top_p'):g})")
    group.add_argument("--top-k", type=non_negative_int, default=d("top_k"), help=f"0 = off (default: {d('top_k')})")
    group.add_argument("--min-p", type=unit_float, default=d("min_p"), help=f"(default: {d('min_p'):g})")
    group.add_argument("--repetition-penalty", type=repetition_float, default=d("repetition_penalty"),
                       help=f"1 = off (default: {d('repetition_penalty'):g})")
    group.add_argument("--presence-penalty", type=penalty_float, default=d("presence_penalty"),
                       help=f"(default: {d('presence_penalty'):g})")
    group.add_argument("--frequency-penalty", type=penalty_float, default=d("frequency_penalty"),
                       help=f"(default: {d('frequency_penalty'):g})")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings for the parsed arguments, each option handed to the object that declares
    and validates it (raises SettingsError with one clear line)."""
    from ninfer.server.settings import read_api_key_file

    keys = list(args.api_key)
    if os.environ.get("NINFER_API_KEY"):
        keys.append(os.environ["NINFER_API_KEY"])
    if args.api_key_file:
        keys.extend(read_api_key_file(args.api_key_file))
    engine = engine_config(
        args, max_concurrency=args.max_concurrency, max_pending=args.max_pending_requests,
        pending_timeout_s=args.pending_timeout_ms / 1000.0, prefill_chunk=args.prefill_chunk,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_cache=args.prefix_reuse, host_cache_bytes=int(args.host_cache_mib * MIB), lookahead=args.lookahead,
    )  # fmt: skip
    runtime = attrs.evolve(runtime_options(args), reserve_gib=args.reserve_gib)
    return ServerSettings(
        model=args.model, runtime=runtime, engine=engine, sampling=sampling_params(args),
        default_max_tokens=args.default_max_tokens, host=args.host, port=args.port, model_id=args.model_id,
        served_model_names=tuple(args.served_model_name), webui=args.webui,
        api_keys=tuple(dict.fromkeys(keys)), max_request_mib=args.max_request_mib, log_level=args.log_level,
        cors_origins=tuple(args.cors), keepalive_s=args.sse_keepalive_s, shutdown_grace_s=args.shutdown_grace_s,
        frame_gap_us=args.frame_gap_us, gc_freeze=args.gc_freeze,
        send_timeout_s=args.send_timeout_s, body_timeout_s=args.body_timeout_s,
        rerank_max_documents=args.rerank_max_documents,
        rerank_weights=tuple(getattr(args, f"rerank_weight_{name}") for name in RERANK_OPTIONS),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import trio

    from ninfer.server.serve import serve

    settings = settings_from_args(args)
    trio.run(serve, settings)
    return 0
