"""What `ninfer score` and `ninfer export-hidden` share: reading a corpus, cutting documents
into context windows, driving the runner over the windows in batched steps, and writing
tensors to files without holding them all in memory.

Windows (`windows`): a document of L tokens fits one window when L <= W (`--max-context`).
Longer ones are cut into windows of W tokens that advance by S tokens (`--stride`, 1 <= S <
W): the first covers tokens [0, W), each next one ends S tokens later (the last one ends at
L) and starts W tokens before its end, so it re-reads W - S (or more) tokens as context. Each
token takes its outputs from the first window that covers it, with at least W - S tokens of
context before it in that window (except the tokens of the first window, which see all that
comes before them). S = W - 1 is the cheapest (each window re-reads one token); smaller
strides give more context at more cost (about W / S passes over each token).

The driver (`drive`) feeds the runner as the engine does: windows in flight each hold the KV
pages of their W tokens, each step takes a chunk of up to `chunk` tokens from every window in
flight (up to `batch_tokens` in all), and only chunks that hold wanted positions ask the
runner for outputs (`SampleSpec.want_all_logits` / `hidden_layers`). A window that ends gives
back its pages and, on a runner with recurrent state (hybrid models), its state
(`release_sequence`).
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from ninfer.cli.common import CliError

# -- the corpus ------------------------------------------------------------------------------


def read_documents(path: str, *, jsonl: bool = False) -> list[str]:
    """The documents of FILE: the whole text, or with `jsonl` (or a .jsonl name) one document
    per non-blank line, each a JSON object with a string field "text". '-' reads stdin."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"cannot read {path}: no such file") from None
    except IsADirectoryError:
        raise CliError(f"cannot read {path}: it is a directory") from None
    except UnicodeDecodeError as e:
        raise CliError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}") from None
    name = "stdin" if path == "-" else path
    if not (jsonl or path.endswith(".jsonl")):
        if not text.strip():
            raise CliError(f"{name} holds no text")
        return [text]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{name} line {number} is not valid JSON: {e.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CliError(f'{name} line {number} is not a JSON object with a string "text" field')
        if not record["text"].strip():
            raise CliError(f"{name} line {number} has an empty text")
        docs.append(record["text"])
    if not docs:
        raise CliError(f"{name} holds no JSONL documents")
    return docs


def tokenize(tokenizer, docs: Sequence[str], *, min_tokens: int = 1) -> list[np.ndarray]:
    """Each document's token ids (with the special tokens the model asks for, e.g. a BOS)."""
    out = []
    for i, text in enumerate(docs):
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=True), np.int32)
        if ids.size < min_tokens:
            raise CliError(f"document {i} has {ids.size} token{'s' if ids.size != 1 else ''}; at least {min_tokens} are needed")
        out.append(ids)
    return out


# -- windows ---------------------------------------------------------------------------------


@attrs.frozen
class Window:
    """Tokens [start, end) of document `doc`; tokens from `new_from` on are first covered here."""

    doc: int
    start: int
    end: int
    new_from: int


def check_stride(window: int, stride: int | None) -> int:
    """The stride in effect: `stride`, or W // 2 when unset (CliError unless 1 <= S < W)."""
    if stride is None:
        return max(1, window // 2)
    if not 1 <= stride < window:
        raise CliError(f"--stride must be at least 1 and below the window (--max-context {window}), got {stride}")
    return stride


def windows(doc: int, num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows of one document (module doc)."""
    end = min(num_tokens, window)
    out = [Window(doc, 0, end, 0)]
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        out.append(Window(doc, max(0, new_end - window), new_end, end))
        end = new_end
    return out


# -- the driver ------------------------------------------------------------------------------


@attrs.define(eq=False)
class Job:
    """One window in flight: its tokens, its pages, the positions (window-relative) whose
    outputs are wanted, and how far it has been fed."""

    seq_id: int
    window: Window
    tokens: np.ndarray
    want_from: int
    want_to: int
    pages: np.ndarray | None = None
    pos: int = 0


def drive(
    runner,
    jobs: Sequence[Job],
    make_spec: Callable[[Job, int], object],
    on_result: Callable[[Job, int, int, object], None],
    *,
    chunk: int,
    batch_tokens: int,
    max_rows: int,
    one_token: bool = False,
    progress=None,
) -> None:
    """Run every job's tokens through `runner`. A chunk of n tokens at window position p that
    overlaps the wanted positions gets `make_spec(job, n)` as its sample spec and its result
    goes to `on_result(job, p, n, result)`. `one_token`: wanted positions are fed one token a
    row per step, in steps of their own (the decode path); only context before them goes in
    chunks. `progress`: a tqdm bar advanced by the tokens fed."""
    page = runner.page_size
    free = list(range(runner.num_pages - 1, -1, -1))
    release = getattr(runner, "release_sequence", None)
    queue = deque(jobs)
    active: list[Job] = []
    for job in jobs:
        if -(-len(job.tokens) // page) > runner.num_pages:
            raise CliError(f"a window of {len(job.tokens)} tokens needs more KV pages than the runner has "
                           f"({runner.num_pages} of {page} tokens): raise --kv-capacity or lower --max-context")  # fmt: skip
    while queue or active:
        while queue and len(active) < max_rows and -(-len(queue[0].tokens) // page) <= len(free):
            job = queue.popleft()
            need = -(-len(job.tokens) // page)
            job.pages = np.array([free.pop() for _ in range(need)], np.int32)
            active.append(job)
        rows, fed = _plan_step(active, chunk, batch_tokens, one_token, make_spec)
        results = runner.step(rows)
        for (job, n, wants), row, result in zip(fed, rows, results, strict=True):
            if wants:
                on_result(job, job.pos, n, result)
            job.pos += n
            if progress is not None:
                progress.update(n)
        for job in [j for j in active if j.pos == len(j.tokens)]:
            active.remove(job)
            free.extend(int(p) for p in job.pages[::-1])
            if release is not None:  # hybrid models: the window's recurrent state goes with it
                release(job.seq_id)


def _plan_step(active: list[Job], chunk: int, batch_tokens: int, one_token: bool, make_spec):
    from ninfer.core.runner import StepRow

    # the decode path: context chunks go in steps of their own, wanted positions one token a row
    prefilling = one_token and any(j.pos < j.want_from for j in active)
    rows, fed = [], []
    budget = batch_tokens
    for job in active:
        if budget <= 0:
            break
        if one_token:
            if prefilling != (job.pos < job.want_from):
                continue
            n = min(chunk, job.want_from - job.pos, budget) if prefilling else 1
        else:
            n = min(chunk, len(job.tokens) - job.pos, budget)
            if job.pos < job.want_from:  # context chunks end where the wanted positions begin
                n = min(n, job.want_from - job.pos)
        wants = job.pos + n > job.want_from and job.pos < job.want_to
        rows.append(StepRow(seq_id=job.seq_id, token_ids=job.tokens[job.pos : job.pos + n], start_pos=job.pos,
                            page_table=job.pages, sample=make_spec(job, n) if wants else None))  # fmt: skip
        fed.append((job, n, wants))
        budget -= n
    return rows, fed


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, file=sys.stderr)


# -- tensor files ----------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32",
                       np.dtype(np.int64): "I64"}  # fmt: skip


class SafetensorsWriter:
    """A safetensors file written in place: every tensor's dtype and shape are declared up
    front, the file is laid out at once, and `view(name)` is a writable memory map of one
    tensor, so tensors larger than memory can be filled piece by piece. Read it back with the
    `safetensors` package (`safe_open(path, framework="numpy")`)."""

    def __init__(self, path: str | Path, tensors: dict[str, tuple[np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):  # fmt: skip
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {})}
        self._layout = {}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (dtype, tuple(shape), offset)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._data_start = 8 + len(blob)
        try:
            with open(self.path, "wb") as f:
                f.write(len(blob).to_bytes(8, "little"))
                f.write(blob)
                f.truncate(self._data_start + offset)
        except OSError as e:
            raise CliError(f"cannot write {self.path}: {e.strerror}") from None

    def view(self, name: str) -> np.ndarray:
        dtype, shape, offset = self._layout[name]
        if 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r+", offset=self._data_start + offset, shape=shape)

    def write(self, name: str, array: np.ndarray) -> None:
        view = self.view(name)
        view[...] = array
        if isinstance(view, np.memmap):
            view.flush()


def open_for_write(path: str) -> Path:
    """`path`'s parent must exist; CliError otherwise (checked before any work is done)."""
    p = Path(path)
    if not p.parent.exists():
        raise CliError(f"cannot write {path}: no directory {p.parent}")
    if p.is_dir():
        raise CliError(f"cannot write {path}: it is a directory")
    return p
