"""The `ninfer` command: serve, generate, chat, pull, models, bench, simulate, score, export-hidden."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ninfer import __version__
from ninfer.cli.common import CommandParser

DESCRIPTION = """\
ninfer runs LLMs on one GPU (or on the CPU) and serves them over OpenAI- and
Anthropic-compatible HTTP APIs. With no MODEL, every command uses the default model
(SmolLM2-135M-Instruct), downloading it on first use."""

EPILOG = """\
examples:
  ninfer serve                         # OpenAI/Anthropic API on http://127.0.0.1:8080
  ninfer generate -p "What is the capital of France?" --temperature 0
  ninfer chat
  ninfer pull && ninfer models
  ninfer bench serve --url http://127.0.0.1:8080   # load a running server
  ninfer score book.txt                # perplexity of a text (or a .jsonl corpus)
run `ninfer COMMAND --help` for each command's options."""

# Sub-commands by module; each module has add_parser(subparsers) (or add_parsers).
COMMAND_MODULES = (
    "ninfer.cli.serve", "ninfer.cli.generate", "ninfer.cli.chat", "ninfer.cli.models",
    "ninfer.cli.bench", "ninfer.cli.simulate", "ninfer.cli.score", "ninfer.cli.export_hidden",
    "ninfer.cli.cluster",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        adder = getattr(module, "add_parsers", None) or module.add_parser
        parser_or_none = adder(subparsers)
        if parser_or_none is not None and hasattr(module, "run"):
            parser_or_none.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ninfer.cli.common import run_reporting_errors

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "serve"]:  # the serving benchmark: a client of a running server
        from ninfer.cli import bench_serve

        return bench_serve.main(argv[2:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "warning").upper(), format="%(levelname)s %(name)s: %(message)s")
    return run_reporting_errors(args.command, args.run, args)


if __name__ == "__main__":
    sys.exit(main())
