"""`ninfer pull` and `ninfer models`: fetch and list cached models."""

from __future__ import annotations

import argparse


def add_parsers(subparsers) -> None:
    pull = subparsers.add_parser(
        "pull", help="download a known model into the cache",
        description="Download a known model (default: smollm2-135m-instruct) into the user cache "
        "directory ($NINFER_CACHE_DIR overrides it), verifying its sha256.",
    )  # fmt: skip
    pull.add_argument("name", nargs="?", default=None, help="model name (default: the default model)")
    pull.set_defaults(run=run_pull)
    models = subparsers.add_parser("models", help="list cached and known models")
    models.set_defaults(run=run_models)


def run_pull(args: argparse.Namespace) -> int:
    from ninfer.models.registry import DEFAULT_MODEL, pull

    path = pull(args.name or DEFAULT_MODEL, progress=True)
    print(path)
    return 0


def run_models(args: argparse.Namespace) -> int:
    from ninfer.models.registry import KNOWN_MODELS, cache_dir, list_cached

    cached = list_cached()
    print(f"cache: {cache_dir()}")
    for name, path, size in cached:
        print(f"  {name:<28} {size / 1e6:8.1f} MB  {path}")
    if not cached:
        print("  (nothing cached yet; `ninfer pull` fetches the default model)")
    missing = sorted(set(KNOWN_MODELS) - {name for name, _, _ in cached})
    if missing:
        print("known, not cached: " + ", ".join(missing))
    return 0
