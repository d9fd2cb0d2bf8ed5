"""`ninfer generate`: one prompt in, the streamed answer out, a short report on stderr."""

from __future__ import annotations

import argparse
import json
import sys

import trio

from ninfer.cli.common import (
    CliError, add_model_arguments, add_sampling_arguments, engine_config, read_messages, runtime_options,
    sampling_params,
)  # fmt: skip

DESCRIPTION = """\
Generate one answer. The prompt goes through the model's chat template as a user message
(unless --raw); the answer streams to stdout and a report (prompt tokens, generated tokens,
time to first token, tok/s) goes to stderr. --json prints one JSON object instead."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="generate one answer", description=DESCRIPTION)
    add_model_arguments(parser, activations=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", metavar="TEXT", help="the user message (or raw text with --raw)")
    source.add_argument("--messages", metavar="FILE", help="JSON list of chat messages ('-' for stdin)")
    parser.add_argument("--system", metavar="TEXT", help="system message placed before the prompt")
    parser.add_argument("--raw", action="store_true", help="feed --prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_sampling_arguments(parser, max_tokens=256)
    parser.set_defaults(run=run)
    return parser


def input_messages(args: argparse.Namespace) -> list[dict] | None:
    """The chat messages to render (None with --raw); read before the model loads."""
    if args.raw:
        if args.messages:
            raise CliError("--raw takes --prompt, not --messages")
        return None
    messages = read_messages(args.messages) if args.messages else [{"role": "user", "content": args.prompt}]
    if args.system:
        messages = [{"role": "system", "content": args.system}, *messages]
    return messages


def prompt_ids(model, args: argparse.Namespace, messages: list[dict] | None) -> list[int]:
    """Token ids of the prompt: rendered through the chat template unless --raw."""
    if messages is None:
        return model.tokenizer.encode(args.prompt)
    if model.chat_template is None:
        text = "\n".join(str(m.get("content", "")) for m in messages)
    else:
        text = model.chat_template.render(messages, add_generation_prompt=True)
    return model.tokenizer.encode(text)


def build_request(model, args: argparse.Namespace, messages: list[dict] | None):
    from ninfer.sched.request import GenerationRequest

    ids = prompt_ids(model, args, messages)
    if not ids:
        raise CliError("the prompt is empty")
    return GenerationRequest(
        prompt_ids=tuple(ids), max_tokens=args.max_tokens, sampling=sampling_params(args),
        seed=args.seed, stop=tuple(args.stop), request_id="cli",
    )  # fmt: skip


async def generate(args: argparse.Namespace) -> int:
    from ninfer.runtime import load, open_runtime
    from ninfer.sched.request import FinishReason, Finished, TokenDelta

    messages = input_messages(args)
    options, config = runtime_options(args), engine_config(args, max_concurrency=1)
    model = load(args.model, progress=not args.json)
    request = build_request(model, args, messages)
    text_parts: list[str] = []
    token_ids: list[int] = []
    finished = None
    async with open_runtime(model, options, config) as (engine, _, backend):
        async with engine.submit(request) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    token_ids.extend(event.token_ids)
                    text_parts.append(event.text)
                    if not args.json:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                elif isinstance(event, Finished):
                    finished = event
    if finished.reason is FinishReason.ERROR:
        raise CliError(f"generation failed: {finished.error}")
    if args.json:
        print(json.dumps(result_json(finished, "".join(text_parts), token_ids, backend)))
    else:
        sys.stdout.write("\n")
        print(report_line(finished, backend), file=sys.stderr)
    return 0


def decode_rate(finished) -> float:
    """Tokens per second after the first token (the decode rate)."""
    t = finished.timings
    n = finished.usage.completion_tokens - 1
    return n / (t.total_s - t.ttft_s) if n > 0 and t.total_s > t.ttft_s else 0.0


def report_line(finished, backend: str) -> str:
    u, t = finished.usage, finished.timings
    return (
        f"[{backend}] prompt {u.prompt_tokens} tokens, generated {u.completion_tokens} tokens "
        f"({finished.reason.value}), time to first token {t.ttft_s * 1000:.0f} ms, "
        f"{decode_rate(finished):.1f} tok/s"
    )


def result_json(finished, text: str, token_ids: list[int], backend: str) -> dict:
    u, t = finished.usage, finished.timings
    return {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finished.reason.value,
        "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                  "total_tokens": u.prompt_tokens + u.completion_tokens},
        "timings": {"queue_s": t.queue_s, "ttft_s": t.ttft_s, "total_s": t.total_s,
                    "decode_tokens_per_s": decode_rate(finished)},
        "backend": backend,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return trio.run(generate, args)
