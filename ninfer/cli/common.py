"""Arguments and error handling shared by every command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import attrs

from ninfer.runtime import ACTIVATIONS, BACKENDS, DEFAULT_CONTEXT_CAP, RuntimeOptions, parse_kv_capacity
from ninfer.sched.config import MIN_CONTEXT, EngineConfig


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser: arguments it does not know are its own error.

    argparse hands a sub-command's unknown arguments up to the top-level parser, whose error
    shows `ninfer`'s usage; `ninfer serve --bad-flag` should show `ninfer serve`'s usage and
    `ninfer serve: error: unrecognized arguments: --bad-flag` (exit status 2).
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _typed(convert: Callable, check: Callable[[object], bool], what: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = _typed(int, lambda v: v > 0, "a positive integer")


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. `1,4,16,64` (argparse type)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
context_tokens = _typed(int, lambda v: v >= MIN_CONTEXT, f"an integer >= {MIN_CONTEXT}")
non_negative_int = _typed(int, lambda v: v >= 0, "an integer >= 0")
unit_float = _typed(float, lambda v: 0.0 <= v <= 1.0, "a number between 0 and 1")
temperature_float = _typed(float, lambda v: 0.0 <= v <= 100.0, "a temperature between 0 and 100")
penalty_float = _typed(float, lambda v: -2.0 <= v <= 2.0, "a penalty between -2 and 2")
repetition_float = _typed(float, lambda v: 0.01 <= v <= 10.0, "a repetition penalty between 0.01 and 10")


def _kv(text: str):
    try:
        return parse_kv_capacity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_of(cls, name: str):
    """The default of field `name` of attrs class `cls`: flags take their defaults from the
    class that declares the option, so each default is written once."""
    return attrs.fields_dict(cls)[name].default


def add_model_arguments(parser: argparse.ArgumentParser, *, activations: bool = False) -> None:
    """MODEL and the runtime group; `activations` adds --activations (commands whose options
    reach `RuntimeOptions.activations` through `runtime_options`)."""
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="a .gguf file, a Hugging Face style directory (config.json + *.safetensors), or a "
        "known model name (default: smollm2-135m-instruct, pulled on first use)",
    )  # fmt: skip
    backend, page_size = default_of(RuntimeOptions, "backend"), default_of(EngineConfig, "page_size")
    group = parser.add_argument_group("runtime")
    group.add_argument("--backend", choices=BACKENDS, default=backend,
                       help="compute backend; auto picks CUDA when a GPU is present, else cpu (numba kernels over the "
                       "stored, quantized weights; compiled on the first start, minutes) for llama / qwen2 / qwen3 "
                       f"models and reference (numpy, float32) for the rest (default: {backend})")
    group.add_argument("--kv-capacity", type=_kv, default="auto", metavar="TOKENS",
                       help="KV cache size in tokens, or 'auto' to fit free memory (default: auto)")
    group.add_argument("--max-context", type=context_tokens, default=None, metavar="TOKENS",
                       help=f"longest prompt + answer in tokens (default: the model's, at most {DEFAULT_CONTEXT_CAP})")
    group.add_argument("--page-size", type=positive_int, default=page_size, metavar="TOKENS",
                       help=f"tokens per KV page (default: {page_size})")
    group.add_argument("--kernel-cache", action=argparse.BooleanOptionalAction,
                       default=default_of(RuntimeOptions, "kernel_cache"),
                       help="CUDA: keep compiled kernels in the user cache directory ($NINFER_CACHE_DIR/kernels "
                       "when set), so a restart on the same GPU and version loads them in seconds instead of "
                       "compiling for a minute (default: on)")
    if activations:
        default = default_of(RuntimeOptions, "activations")
        group.add_argument("--activations", choices=ACTIVATIONS, default=default,
                           help="CUDA decode activations: q8 (int8 blocks and dp4a, llama.cpp's scheme: the "
                           "fast path, perplexity within 1%% of f32) or f32 (float32 activations: logits within "
                           "about 1e-3 of the CPU reference backend's); the reference backend (also what "
                           f"--backend auto picks without a GPU) ignores it (default: {default})")


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    """The runtime group's backend and activations (--activations only where the command has it)."""
    return RuntimeOptions(
        backend=args.backend, activations=getattr(args, "activations", default_of(RuntimeOptions, "activations")),
        kernel_cache=args.kernel_cache,
    )


def engine_config(args: argparse.Namespace, **fields) -> EngineConfig:
    """The runtime group's page size, context and KV capacity, plus the command's own engine
    `fields` (raises ConfigError, e.g. for a --kv-capacity below --max-context)."""
    return EngineConfig(page_size=args.page_size, max_context=args.max_context, kv_capacity=args.kv_capacity, **fields)


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens,
                       help=f"most tokens to generate (default: {max_tokens})")
    group.add_argument("--temperature", type=temperature_float, default=0.7,
                       help="0 is greedy (default: 0.7)")
    group.add_argument("--top-p", type=unit_float, default=1.0, help="nucleus sampling mass (default: 1)")
    group.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k likeliest tokens; 0 = off")
    group.add_argument("--min-p", type=unit_float, default=0.0, help="drop tokens below min_p * p_max")
    group.add_argument("--repetition-penalty", type=repetition_float, default=1.0,
                       help="divide logits of seen tokens (1 = off)")
    group.add_argument("--presence-penalty", type=penalty_float, default=0.0)
    group.add_argument("--frequency-penalty", type=penalty_float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop string (repeatable); never printed")


def sampling_params(args: argparse.Namespace):
    from ninfer.core.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )  # fmt: skip


def read_messages(path: str) -> list[dict]:
    """A JSON file holding a list of {"role", "content"} messages ('-' reads stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read messages file {path}: {e.strerror}") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"messages file {path} is not valid JSON: {e}") from None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise CliError(f"messages file {path} must hold a JSON list of objects with a 'role'")
    return messages


def run_reporting_errors(command: str, run, args) -> int:
    """`run(args)` as command `command`: errors that are the user's to fix print one line and
    exit 2, Ctrl-C exits 130; anything else is a bug and keeps its traceback."""
    try:
        return run(args) or 0
    except user_errors() as e:
        print(f"ninfer {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ninfer {command}: interrupted", file=sys.stderr)
        return 130


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: printed as one line, never a traceback."""
    from ninfer.models.errors import ModelLoadError
    from ninfer.runtime import ConfigError
    from ninfer.sched.request import EngineError

    errors: list[type[BaseException]] = [CliError, ModelLoadError, ConfigError, EngineError]
    try:
        from ninfer.models.chat_template import ChatTemplateError

        errors.append(ChatTemplateError)
    except ImportError:
        pass
    return tuple(errors)
