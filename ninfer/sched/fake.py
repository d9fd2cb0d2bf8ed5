"""A fake runner with a cost model, for deterministic scheduler tests and `ninfer simulate`.

`FakeRunner` implements the `Runner` protocol without a model. Its "KV" is the token id and a
running hash of the whole prefix ending there at every page slot, so a step really depends on
the page table: the next token is a pure function of (seed, token index, the context read back
from the pages). A scheduler that loses, mixes up or forgets to restore pages therefore changes
the tokens, and reading a slot never written, or a page that does not continue the row's own
prefix, raises; pages shared by a prefix cache pass, as they hold exactly that prefix. Each call
adds its cost in virtual seconds to `pending_cost_s`; `VirtualTimeExecutor` sleeps that long in
trio time (use it with `trio.testing.MockClock(autojump_threshold=0)`).
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Sequence

import attrs
import numpy as np
import trio

from ninfer.core.runner import PageSnapshot, SampledToken, StepRow, SyncSubmit
from ninfer.models.spec import ModelSpec


@attrs.frozen(kw_only=True)
class CostModel:
    """Virtual seconds per call. Binary fractions keep test timelines exact."""

    step_s: float = 1 / 64  # fixed cost of one forward
    token_s: float = 1 / 1024  # per token fed (prefill and decode alike)
    row_s: float = 0.0  # per row in the batch
    page_copy_s: float = 0.0  # per page snapshotted or restored

    def step_cost_s(self, rows: Sequence[StepRow]) -> float:
        num_tokens = sum(len(row.token_ids) for row in rows)
        return self.step_s + self.token_s * num_tokens + self.row_s * len(rows)


@attrs.frozen
class StepLog:
    """What one `step` call saw: (seq_id, start_pos, num_tokens, sampled) per row."""

    rows: tuple[tuple[int, int, int, bool], ...]


class FakeRunner(SyncSubmit):
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int = 16,
        vocab_size: int = 257,
        max_context: int = 4096,
        cost: CostModel = CostModel(),
        page_nbytes: int | None = None,
        fail_at_step: int | None = None,
    ):
        self.spec = ModelSpec(
            arch="llama", num_layers=1, d_model=8, d_ffn=8, num_heads=1, num_kv_heads=1,
            head_dim=8, vocab_size=vocab_size, max_context=max_context,
        )  # fmt: skip
        self.page_size = page_size
        self.num_pages = num_pages
        self.cost = cost
        self._page_nbytes = page_nbytes or page_size * 16
        self._fail_at_step = fail_at_step
        self._tokens = np.full((num_pages, page_size), -1, dtype=np.int64)
        # _prefix[slot] = mix(_prefix[previous position], token): the prefix's rolling hash.
        self._prefix = np.full((num_pages, page_size), _UNWRITTEN, dtype=np.uint64)
        self.pending_cost_s = 0.0
        self.steps: list[StepLog] = []
        self.num_snapshots = 0
        self.num_restores = 0

    @property
    def page_nbytes(self) -> int:
        return self._page_nbytes

    def take_pending_cost(self) -> float:
        cost, self.pending_cost_s = self.pending_cost_s, 0.0
        return cost

    def _step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        if self._fail_at_step is not None and len(self.steps) == self._fail_at_step:
            raise RuntimeError("injected runner failure")
        _check_distinct_pages(rows, self.page_size)
        for row in rows:
            if row.start_pos + len(row.token_ids) > self.spec.max_context:
                raise AssertionError(f"row {row.seq_id} reaches position {row.start_pos + len(row.token_ids) - 1}, "
                                     f"past the context of {self.spec.max_context}")  # fmt: skip
        self.steps.append(StepLog(tuple(_log_row(row) for row in rows)))
        self.pending_cost_s += self.cost.step_cost_s(rows)
        for row in rows:
            self._write(row)
        return [self._sample(row) if row.sample is not None else None for row in rows]

    def _slots(self, row: StepRow, positions: np.ndarray):
        page_index = positions // self.page_size
        if page_index.size and page_index.max() >= len(row.page_table):
            raise AssertionError(f"row {row.seq_id}: its page table does not cover its positions")
        return row.page_table[page_index], positions % self.page_size

    def _write(self, row: StepRow) -> None:
        positions = np.arange(row.start_pos, row.start_pos + len(row.token_ids))
        pages, offsets = self._slots(row, positions)
        prefix = _ROOT
        if row.start_pos:
            [page], [offset] = self._slots(row, np.array([row.start_pos - 1]))
            prefix = int(self._prefix[page, offset])
            if prefix == _UNWRITTEN:
                raise AssertionError(f"row {row.seq_id} continues a position it never computed")
        hashes = []
        for token_id in row.token_ids.tolist():
            prefix = _mix(prefix, token_id)
            hashes.append(prefix)
        self._tokens[pages, offsets] = row.token_ids
        self._prefix[pages, offsets] = np.array(hashes, dtype=np.uint64)

    def _sample(self, row: StepRow) -> SampledToken:
        positions = np.arange(row.start_pos + len(row.token_ids))
        pages, offsets = self._slots(row, positions)
        context = self._tokens[pages, offsets]
        prefix = self._prefix[pages, offsets]
        previous = np.concatenate([np.array([_ROOT], dtype=np.uint64), prefix[:-1]])
        if np.any(prefix == _UNWRITTEN) or np.any(_mix_array(previous, context) != prefix):
            raise AssertionError(f"row {row.seq_id} reads KV that does not hold its own prefix")
        spec = row.sample
        digest = _hash(spec.seed, spec.token_index, context)
        if spec.allowed is not None:
            choices = np.flatnonzero(spec.allowed)
            token_id = int(choices[digest % len(choices)])
        else:
            token_id = digest % self.spec.vocab_size
        logprob = -float((digest >> 20) % 4096) / 512
        num_top = spec.num_top_logprobs
        top_ids = np.array([(token_id + k) % self.spec.vocab_size for k in range(num_top)], np.int32)
        top_logprobs = np.array([logprob - k for k in range(num_top)], np.float32)
        return SampledToken(
            token_id=token_id, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs
        )

    def snapshot_pages(self, page_ids: Sequence[int]) -> PageSnapshot:
        ids = np.asarray(page_ids, dtype=np.int64)
        self.num_snapshots += 1
        self.pending_cost_s += self.cost.page_copy_s * len(ids)
        return PageSnapshot((self._tokens[ids].copy(), self._prefix[ids].copy()))

    def restore_pages(self, page_ids: Sequence[int], snapshot: PageSnapshot) -> None:
        ids = np.asarray(page_ids, dtype=np.int64)
        tokens, prefix = snapshot.arrays
        if len(ids) != len(tokens):
            raise AssertionError(f"restoring {len(tokens)} snapshotted pages into {len(ids)}")
        self.num_restores += 1
        self.pending_cost_s += self.cost.page_copy_s * len(ids)
        self._tokens[ids], self._prefix[ids] = tokens, prefix

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        self.pending_cost_s += self.cost.page_copy_s * len(src_ids)
        self._tokens[list(dst_ids)] = self._tokens[list(src_ids)]
        self._prefix[list(dst_ids)] = self._prefix[list(src_ids)]

    def close(self) -> None:
        pass


_UNWRITTEN = (1 << 64) - 1
_ROOT = 0x9E3779B97F4A7C15
_MULTIPLIER = 0x100000001B3  # odd: the mix is a bijection of the previous hash


def _mix(prefix: int, token_id: int) -> int:
    return (prefix * _MULTIPLIER + token_id + 1) % (1 << 64)


def _mix_array(prefix: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as _mix's modulo does
        return prefix * np.uint64(_MULTIPLIER) + token_ids.astype(np.uint64) + np.uint64(1)


def _hash(seed: int, token_index: int, context: np.ndarray) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{seed}:{token_index}:".encode())
    h.update(context.astype(np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def _log_row(row: StepRow) -> tuple[int, int, int, bool]:
    return (row.seq_id, row.start_pos, len(row.token_ids), row.sample is not None)


def _check_distinct_pages(rows: Sequence[StepRow], page_size: int) -> None:
    """A page a row writes is in no other row's table (shared prefix pages are only read)."""
    written: dict[int, int] = {}
    for row in rows:
        first, last = row.start_pos // page_size, (row.start_pos + len(row.token_ids) - 1) // page_size
        for page in row.page_table[first : last + 1].tolist():
            if written.setdefault(page, row.seq_id) != row.seq_id:
                raise AssertionError(f"page {page} is written by rows {written[page]} and {row.seq_id}")
    for row in rows:
        for page in row.page_table.tolist():
            if written.get(page, row.seq_id) != row.seq_id:
                raise AssertionError(f"row {row.seq_id} reads page {page} while row {written[page]} writes it")


class VirtualTimeExecutor:
    """Runs a runner call inline, then sleeps its cost in trio (virtual) time."""

    def __init__(self, runner: FakeRunner):
        self.runner = runner

    async def __call__(self, fn, *args):
        result = fn(*args)
        await trio.sleep(self.runner.take_pending_cost())
        return result


class ByteTokenizer:
    """Token ids 0..255 are bytes; 256 and up are special tokens without text."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()


class ByteDetokenizer:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id])) if token_id < 256 else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
