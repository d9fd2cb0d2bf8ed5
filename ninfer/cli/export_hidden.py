"""`ninfer export-hidden FILE -o OUT`: the hidden rows of chosen layers for every token."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ninfer.cli import offline
from ninfer.cli.common import CliError, add_model_arguments, engine_config, runtime_options
from ninfer.cli.score import add_corpus_arguments

DESCRIPTION = """\
Write the hidden rows (the residual stream) of chosen layers at every token of every document.
FILE is one text document, or (with --jsonl or a .jsonl name) one JSON object with a "text"
field per line; '-' reads stdin. The model's special tokens (a BOS where the model asks for
one) are added as when it is prompted.

--layers picks the rows: layer k (0 .. layers - 1) is the residual stream after decoder block k
(the input of block k + 1); -1 is the final hidden row, rmsnorm(x) * final_norm after the last
block (the LM head's input: what /v1/embeddings pools). Row t of every array is the row at
token t, which has seen tokens 0 .. t.

Output (float32; d = the model's hidden size, n = a document's tokens):
  a .safetensors name (or --format safetensors): one file with, per document i,
    doc{i}.tokens  int32 [n]     the token ids
    doc{i}.layer{k} float32 [n, d] for each layer k >= 0 of --layers
    doc{i}.final   float32 [n, d] for -1
  and the model, layers and window in its metadata;
  any other name (or --format npy): a directory of .npy files with the same names
  (doc0.tokens.npy, doc0.layer5.npy, doc0.final.npy, ...) and manifest.json listing the
  documents, their token counts and files.

Documents longer than the window (--max-context) are cut into windows as `ninfer score` does
(--stride): each token's rows come from the first window that holds it with at least
window - stride tokens of context before it. Windows run batched through the engine's runner,
on the reference backend (CPU) or CUDA (where a layer other than -1 runs that step without
its CUDA graph)."""

EPILOG = """\
examples:
  ninfer export-hidden notes.txt -o hidden.safetensors
  ninfer export-hidden corpus.jsonl --layers 0,15,-1 -o hidden/   # doc0.layer0.npy, ...
  python -c "from safetensors.numpy import load_file; print(load_file('hidden.safetensors')['doc0.final'].shape)\""""


def _layers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices (e.g. 0,5,-1), got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one layer index, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"layer indices repeat in {text!r}")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export-hidden", help="write the hidden rows of chosen layers (.npy / safetensors)",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("file", metavar="FILE", help="a text file, a .jsonl file ({\"text\": ...} a line), or '-' for stdin")
    add_model_arguments(parser, activations=True)
    group = parser.add_argument_group("output")
    group.add_argument("--output", "-o", required=True, metavar="PATH",
                       help="a .safetensors file, or a directory for .npy files (created if missing)")
    group.add_argument("--format", choices=("npy", "safetensors"), default=None,
                       help="override the format the --output name implies")
    group.add_argument("--layers", type=_layers, default=(-1,), metavar="K,K,...",
                       help="layers to export: 0 .. layers - 1 (after that decoder block), -1 (after the final "
                       "norm); default: -1")  # fmt: skip
    add_corpus_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def layer_name(k: int) -> str:
    return "final" if k == -1 else f"layer{k}"


def run(args: argparse.Namespace) -> int:
    from ninfer.runtime import create_runner, load

    docs = offline.read_documents(args.file, jsonl=args.jsonl)
    fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "npy")
    out = Path(args.output)
    if fmt == "safetensors":
        offline.open_for_write(args.output)
    elif out.exists() and not out.is_dir():
        raise CliError(f"cannot write .npy files into {args.output}: it is a file (name it *.safetensors, or pick a directory)")
    model = load(args.model, progress=not args.no_progress)
    num_layers = model.spec.num_layers
    bad = [k for k in args.layers if not (k == -1 or 0 <= k < num_layers)]
    if bad:
        raise CliError(f"layer {bad[0]} is out of range: {model.name} has layers 0 .. {num_layers - 1} (and -1, the final norm)")
    token_docs = offline.tokenize(model.tokenizer, docs)
    runner, backend, config = create_runner(model, runtime_options(args), engine_config(args))
    meta = {"model": model.name, "backend": backend, "layers": ",".join(map(str, args.layers)),
            "window": str(config.max_context), "d_model": str(model.spec.d_model)}  # fmt: skip
    try:
        started = time.perf_counter()
        stride = export(runner, token_docs, args.layers, output=args.output, fmt=fmt, window=config.max_context,
                        stride=args.stride, chunk=args.chunk, batch_tokens=args.batch_tokens,
                        progress=not args.no_progress, metadata=meta)  # fmt: skip
        seconds = time.perf_counter() - started
    finally:
        runner.close()
    total = sum(len(t) for t in token_docs)
    print(f"wrote layers {','.join(map(str, args.layers))} of {len(token_docs)} document"
          f"{'s' if len(token_docs) != 1 else ''} ({total} tokens, d = {model.spec.d_model}) to {args.output} ({fmt}); "
          f"{backend}, window {config.max_context}, stride {stride}, {seconds:.2f} s", file=sys.stderr)  # fmt: skip
    return 0


def export(runner, token_docs, layers, *, output: str, fmt: str, window: int, stride: int | None, chunk: int = 512,
           batch_tokens: int = 1024, progress: bool = False, metadata: dict | None = None, max_rows: int = 64) -> int:  # fmt: skip
    """Write the rows (module doc of `run`); returns the stride used."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec

    stride = offline.check_stride(window, stride)
    d_model = runner.spec.d_model
    sink = _Safetensors(output, token_docs, layers, d_model, metadata) if fmt == "safetensors" else _NpyDir(output, layers)
    buffers: dict[int, np.ndarray] = {}  # doc -> float32 [layers, n, d], while its windows run
    remaining = [0] * len(token_docs)
    jobs = []
    for d, tokens in enumerate(token_docs):
        for w in offline.windows(d, len(tokens), window, stride):
            jobs.append(offline.Job(seq_id=len(jobs), window=w, tokens=tokens[w.start : w.end],
                                    want_from=w.new_from - w.start, want_to=w.end - w.start))  # fmt: skip
            remaining[d] += 1
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, hidden_layers=tuple(layers))

    def on_result(job: offline.Job, pos: int, n: int, result) -> None:
        d = job.window.doc
        lo, hi = max(pos, job.want_from), min(pos + n, job.want_to)
        if d not in buffers:
            buffers[d] = np.zeros((len(layers), len(token_docs[d]), d_model), np.float32)
        buffers[d][:, job.window.start + lo : job.window.start + hi] = result.layer_hidden[:, lo - pos : hi - pos]
        if hi == job.want_to:  # this window's last wanted rows
            remaining[d] -= 1
            if remaining[d] == 0:
                sink.write(d, token_docs[d], buffers.pop(d))

    bar = offline.progress_bar(sum(len(j.tokens) for j in jobs), "exporting", progress)
    try:
        offline.drive(runner, jobs, lambda job, n: spec, on_result, chunk=chunk, batch_tokens=batch_tokens,
                      max_rows=max_rows, progress=bar)  # fmt: skip
    finally:
        bar.close()
    sink.close(token_docs)
    return stride


class _Safetensors:
    def __init__(self, path, token_docs, layers, d_model: int, metadata):
        tensors = {}
        for d, tokens in enumerate(token_docs):
            tensors[f"doc{d}.tokens"] = (np.int32, (len(tokens),))
            for k in layers:
                tensors[f"doc{d}.{layer_name(k)}"] = (np.float32, (len(tokens), d_model))
        self.layers = layers
        self.file = offline.SafetensorsWriter(path, tensors, {k: str(v) for k, v in (metadata or {}).items()})

    def write(self, d: int, tokens, rows: np.ndarray) -> None:
        self.file.write(f"doc{d}.tokens", tokens)
        for j, k in enumerate(self.layers):
            self.file.write(f"doc{d}.{layer_name(k)}", rows[j])

    def close(self, token_docs) -> None:
        pass


class _NpyDir:
    def __init__(self, path, layers):
        self.dir = Path(path)
        self.layers = layers
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"cannot create {path}: {e.strerror}") from None

    def write(self, d: int, tokens, rows: np.ndarray) -> None:
        np.save(self.dir / f"doc{d}.tokens.npy", np.asarray(tokens, np.int32))
        for j, k in enumerate(self.layers):
            np.save(self.dir / f"doc{d}.{layer_name(k)}.npy", rows[j])

    def close(self, token_docs) -> None:
        manifest = {
            "layers": list(self.layers),
            "documents": [{"index": d, "tokens": len(t), "files": [f"doc{d}.tokens.npy"]
                           + [f"doc{d}.{layer_name(k)}.npy" for k in self.layers]} for d, t in enumerate(token_docs)],
        }  # fmt: skip
        (self.dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
