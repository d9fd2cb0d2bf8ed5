"""`ninfer score FILE`: the causal log-likelihood of a text or JSONL corpus under the model."""

from __future__ import annotations

import argparse
import json
import math
import time

import attrs
import numpy as np

from ninfer.cli.common import CliError, add_model_arguments, engine_config, positive_int, runtime_options
from ninfer.cli import offline

DESCRIPTION = """\
Score a text: the log-probability the model gives each token after the ones before it, the
total negative log-likelihood (NLL, nats) and the perplexity exp(NLL / scored tokens), per
document and over the corpus. FILE is one text document, or (with --jsonl or a .jsonl name) one
JSON object with a "text" field per line; '-' reads stdin. The first token of each document is
not scored (nothing comes before it); the model's special tokens (a BOS where the model asks
for one) are added as when it is prompted.

Documents longer than the window (--max-context tokens) are scored in windows that advance by
--stride tokens (default: half the window): each token is scored once, in the first window that
holds it with at least window - stride tokens of context before it. Windows run batched
through the engine's runner (several windows a step, --batch-tokens tokens a step, each a
chunk of up to --chunk tokens), on the reference backend (CPU) or CUDA.

Qualifying a quantization or activation scheme: score once with --save-logits FILE (the raw
logits of every scored position, safetensors), then again with the other setting and
--reference-logits FILE: the report adds the mean KL(reference || this run) per token, the
fraction of positions whose top token agrees, and both perplexities. On CUDA, --activations
acts on the decode path (one token a row a step); add --decode-path to score through it."""

EPILOG = """\
examples:
  ninfer score book.txt
  ninfer score corpus.jsonl --json > scores.json
  ninfer score wiki.txt --backend cuda --activations f32 --decode-path --save-logits f32.safetensors
  ninfer score wiki.txt --backend cuda --activations q8 --decode-path --reference-logits f32.safetensors
  ninfer score notes.txt --logprobs-out lp.jsonl --max-context 1024 --stride 512"""



def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("score", help="log-likelihood / perplexity of a text or JSONL corpus",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("file", metavar="FILE", help="a text file, a .jsonl file ({\"text\": ...} a line), or '-' for stdin")
    add_model_arguments(parser, activations=True)
    add_corpus_arguments(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true", help="print one JSON object (per-document and total figures) "
                       "instead of the text report")  # fmt: skip
    group.add_argument("--logprobs-out", metavar="FILE", help="write every token's log-probability: a .npy name "
                       "writes one float32 array of all documents' tokens in order (NaN for each document's first "
                       "token); any other name writes JSONL, one {index, token_ids, logprobs} line per document "
                       "(logprobs[0] null)")  # fmt: skip
    group.add_argument("--save-logits", metavar="FILE", help="write the raw logits of every scored position "
                       "(safetensors: 'logits' [scored tokens, vocab], 'targets', 'doc_offsets'), for a later "
                       "--reference-logits run; vocab x 4 bytes a token (196 KB for SmolLM2)")  # fmt: skip
    group.add_argument("--logits-dtype", choices=("float32", "float16"), default="float32",
                       help="storage type of --save-logits (float16 halves the file; default: float32)")
    group.add_argument("--reference-logits", metavar="FILE", help="a --save-logits file of the same text and "
                       "tokenizer: report the mean KL(reference || this run) per token, top-1 agreement and "
                       "the reference's perplexity")  # fmt: skip
    group.add_argument("--decode-path", action="store_true", help="feed the scored positions one token a row a "
                       "step (the decode path, where CUDA's --activations acts) instead of prefill chunks: "
                       "slower, for qualifying decode activations")  # fmt: skip
    parser.set_defaults(run=run)
    return parser


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """--jsonl, the window and the batching: shared with `ninfer export-hidden`."""
    group = parser.add_argument_group("corpus and batching")
    group.add_argument("--jsonl", action="store_true", help="read FILE as JSONL whatever its name (one "
                       "{\"text\": ...} object a line)")  # fmt: skip
    group.add_argument("--stride", type=positive_int, default=None, metavar="TOKENS",
                       help="tokens a window advances for documents longer than --max-context (1 .. window - 1; "
                       "default: half the window); each window re-reads window - stride tokens as context")
    group.add_argument("--chunk", type=positive_int, default=512, metavar="TOKENS",
                       help="most tokens of one window in one step (default: 512)")
    group.add_argument("--batch-tokens", type=positive_int, default=1024, metavar="TOKENS",
                       help="most tokens in one step, over all windows in flight (default: 1024)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@attrs.define
class _Doc:
    tokens: np.ndarray
    logprobs: np.ndarray  # float64 [n]: NaN for token 0
    kl: np.ndarray | None = None  # float64 [n]: per target, with --reference-logits
    agree: np.ndarray | None = None  # bool [n]
    ref_logprobs: np.ndarray | None = None  # float64 [n]


def run(args: argparse.Namespace) -> int:
    from ninfer.runtime import create_runner, load

    docs = offline.read_documents(args.file, jsonl=args.jsonl)
    for name in ("logprobs_out", "save_logits"):
        if getattr(args, name):
            offline.open_for_write(getattr(args, name))
    reference = _open_reference(args.reference_logits) if args.reference_logits else None
    model = load(args.model, progress=not args.no_progress)
    token_docs = offline.tokenize(model.tokenizer, docs, min_tokens=2)
    runner, backend, config = create_runner(model, runtime_options(args), engine_config(args))
    try:
        report = score(runner, token_docs, window=config.max_context, stride=args.stride, chunk=args.chunk,
                       batch_tokens=args.batch_tokens, decode_path=args.decode_path, save_logits=args.save_logits,
                       logits_dtype=np.dtype(args.logits_dtype), reference=reference, progress=not args.no_progress,
                       metadata={"model": model.name, "backend": backend, "activations": args.activations})  # fmt: skip
    finally:
        runner.close()
    report = {"model": model.name, "backend": backend, "activations": args.activations if backend == "cuda" else None,
              **report}  # fmt: skip
    if args.logprobs_out:
        write_logprobs(args.logprobs_out, report.pop("_docs"))
    else:
        report.pop("_docs")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0


def score(runner, token_docs, *, window: int, stride: int | None, chunk: int = 512, batch_tokens: int = 1024,
          decode_path: bool = False, save_logits: str | None = None, logits_dtype=np.float32, reference=None,
          progress: bool = False, metadata: dict | None = None, max_rows: int = 64) -> dict:  # fmt: skip
    """Score `token_docs` (int32 arrays) on `runner`; the report dict (module doc of `run`),
    with the per-document arrays under "_docs"."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec
    from ninfer.gpu import quality

    stride = offline.check_stride(window, stride)
    # scored targets of document d: tokens 1 .. n - 1, at global index offsets[d] + t - 1
    offsets = np.concatenate([[0], np.cumsum([len(t) - 1 for t in token_docs])]).astype(np.int64)
    targets_all = np.concatenate([t[1:] for t in token_docs]).astype(np.int32)
    if reference is not None:
        reference.check(targets_all, offsets, runner.spec.vocab_size)
    saved = None
    vocab = runner.spec.vocab_size
    if save_logits:
        meta = {k: str(v) for k, v in (metadata or {}).items()}
        meta.update(window=str(window), stride=str(stride), decode_path=str(decode_path))
        saved = offline.SafetensorsWriter(save_logits, {
            "logits": (logits_dtype, (int(offsets[-1]), vocab)), "targets": (np.int32, (int(offsets[-1]),)),
            "doc_offsets": (np.int64, (len(token_docs) + 1,)),
        }, meta)  # fmt: skip
        saved.write("targets", targets_all)
        saved.write("doc_offsets", offsets)
        saved_logits = saved.view("logits")
    docs = [_Doc(t, np.full(len(t), np.nan)) for t in token_docs]
    if reference is not None:
        for d in docs:
            d.kl, d.agree, d.ref_logprobs = np.full(len(d.tokens), np.nan), np.zeros(len(d.tokens), bool), np.full(len(d.tokens), np.nan)
    # each window feeds tokens [start, end - 1) and scores targets from max(new_from, 1) to end - 1
    jobs = []
    for d, tokens in enumerate(token_docs):
        for w in offline.windows(d, len(tokens), window, stride):
            first = max(w.new_from, 1)
            jobs.append(offline.Job(seq_id=len(jobs), window=w, tokens=tokens[w.start : w.end - 1],
                                    want_from=first - 1 - w.start, want_to=w.end - 1 - w.start))  # fmt: skip
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_all_logits=True)

    def on_result(job: offline.Job, pos: int, n: int, result) -> None:
        lo, hi = max(pos, job.want_from), min(pos + n, job.want_to)
        logits = result.all_logits[lo - pos : hi - pos]
        doc = docs[job.window.doc]
        t0, t1 = job.window.start + lo + 1, job.window.start + hi + 1  # the targets' indices in the document
        doc.logprobs[t0:t1] = quality.token_logprobs(logits, doc.tokens[t0:t1])
        g0, g1 = offsets[job.window.doc] + t0 - 1, offsets[job.window.doc] + t1 - 1
        if saved is not None:
            saved_logits[g0:g1] = logits
        if reference is not None:
            ref = reference.logits(g0, g1)
            doc.kl[t0:t1], doc.agree[t0:t1] = quality.kl_rows(ref, logits)
            doc.ref_logprobs[t0:t1] = quality.token_logprobs(ref, doc.tokens[t0:t1])

    bar = offline.progress_bar(sum(len(j.tokens) for j in jobs), "scoring", progress)
    started = time.perf_counter()
    try:
        offline.drive(runner, jobs, lambda job, n: spec, on_result, chunk=chunk, batch_tokens=batch_tokens,
                      max_rows=max_rows, one_token=decode_path, progress=bar)  # fmt: skip
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if saved is not None and isinstance(saved_logits, np.memmap):
        saved_logits.flush()
    fed = sum(len(j.tokens) for j in jobs)
    return {
        "window": window, "stride": stride, "decode_path": decode_path,
        "documents": [_figures(i, d) for i, d in enumerate(docs)],
        "total": _figures(None, docs),
        "seconds": seconds, "tokens_fed": fed, "tokens_per_s": fed / seconds if seconds > 0 else None,
        "_docs": docs,
    }  # fmt: skip


def _figures(index: int | None, docs) -> dict:
    """Figures of one document (`index` set, `docs` that document) or of the corpus (`docs` a list)."""
    group = docs if index is None else [docs]
    lps = np.concatenate([d.logprobs[1:] for d in group])
    nll = float(-lps.sum())
    out = {} if index is None else {"index": index}
    if index is None:
        out["documents"] = len(group)
    out.update(tokens=int(sum(len(d.tokens) for d in group)), scored_tokens=int(lps.size), nll=nll,
               mean_nll=nll / lps.size, perplexity=math.exp(nll / lps.size))  # fmt: skip
    if group[0].kl is not None:
        kl = np.concatenate([d.kl[1:] for d in group])
        ref = np.concatenate([d.ref_logprobs[1:] for d in group])
        out.update(mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                   top1_agreement=float(np.concatenate([d.agree[1:] for d in group]).mean()),
                   reference_perplexity=math.exp(float(-ref.sum()) / ref.size))  # fmt: skip
    return out


class _Reference:
    """A --save-logits file opened for reading (the safetensors package, lazily sliced)."""

    def __init__(self, path: str):
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
            names = set(self._file.keys())
        except (OSError, SafetensorError) as e:
            raise CliError(f"cannot read reference logits {path}: {e}") from None
        if not {"logits", "targets", "doc_offsets"} <= names:
            raise CliError(f"{path} is not a --save-logits file (it lacks logits / targets / doc_offsets)")
        self._logits = self._file.get_slice("logits")

    def check(self, targets: np.ndarray, offsets: np.ndarray, vocab: int) -> None:
        shape = self._logits.get_shape()
        if len(shape) != 2 or shape[1] != vocab:
            raise CliError(f"reference logits {self.path} have shape {tuple(shape)}; this model's vocabulary has {vocab} tokens")
        theirs = self._file.get_tensor("targets")
        their_offsets = self._file.get_tensor("doc_offsets")
        if theirs.shape != targets.shape or not np.array_equal(their_offsets, offsets) or not np.array_equal(theirs, targets):
            raise CliError(f"reference logits {self.path} were saved for other tokens ({theirs.size} scored tokens "
                           f"in {their_offsets.size - 1} documents; this run has {targets.size} in {offsets.size - 1}): "
                           "score the same text with the same tokenizer")  # fmt: skip

    def logits(self, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self._logits[lo:hi], np.float32)


def _open_reference(path: str) -> _Reference:
    return _Reference(path)


def write_logprobs(path: str, docs) -> None:
    try:
        if path.endswith(".npy"):
            np.save(path, np.concatenate([d.logprobs for d in docs]).astype(np.float32))
            return
        with open(path, "w", encoding="utf-8") as f:
            for i, d in enumerate(docs):
                lps = [None if math.isnan(v) else float(v) for v in d.logprobs]
                f.write(json.dumps({"index": i, "token_ids": d.tokens.tolist(), "logprobs": lps}) + "\n")
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror}") from None


MAX_LISTED = 20  # the text report lists documents up to this many; --json always has them all


def format_report(report: dict) -> str:
    lines = []
    docs = report["documents"]
    if 1 < len(docs) <= MAX_LISTED:
        for d in docs:
            line = (f"document {d['index']}: {d['tokens']} tokens, {d['scored_tokens']} scored, NLL {d['nll']:.3f}, "
                    f"perplexity {d['perplexity']:.4f}")  # fmt: skip
            if "mean_kl" in d:
                line += f", mean KL {d['mean_kl']:.3g}"
            lines.append(line)
    t = report["total"]
    where = report["backend"] + (f", {report['activations']} activations" if report.get("activations") else "")
    lines.append(f"{t['documents']} document{'s' if t['documents'] != 1 else ''}, {t['tokens']} tokens, "
                 f"{t['scored_tokens']} scored: NLL {t['nll']:.3f} nats, {t['mean_nll']:.4f} a token, "
                 f"perplexity {t['perplexity']:.4f}")  # fmt: skip
    if "mean_kl" in t:
        lines.append(f"vs reference logits: mean KL {t['mean_kl']:.4g} nats a token (max {t['max_kl']:.3g}), "
                     f"top-1 agreement {100 * t['top1_agreement']:.2f} %, reference perplexity "
                     f"{t['reference_perplexity']:.4f} (ratio {t['perplexity'] / t['reference_perplexity']:.4f})")  # fmt: skip
    rate = f", {report['tokens_per_s']:.1f} tok/s" if report.get("tokens_per_s") else ""
    lines.append(f"{report['model']} on {where}; window {report['window']}, stride {report['stride']}"
                 f"{', decode path' if report['decode_path'] else ''}; {report['seconds']:.2f} s{rate}")  # fmt: skip
    return "\n".join(lines)
