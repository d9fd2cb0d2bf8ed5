"""The `Runner` protocol: the one interface between the scheduler and a compute backend.

Backends (`ninfer.gpu`) implement it; the scheduler and the prefix cache use it, so it lives in
`ninfer.core`, numba-free. A runner owns the model's weights and the KV page storage;
`ninfer.cache` decides which page ids a sequence holds.

One `step` call processes a batch of rows. Each row is one sequence's new tokens: a prefill
chunk (many tokens) or a single decode token, at absolute positions
`start_pos .. start_pos + len(token_ids) - 1`. The runner writes their K/V into the row's
pages (`page_table[p // page_size]` holds position p) and attends over positions
`0 .. start_pos + len(token_ids) - 1`. Rows whose `sample` is set get one token sampled from the
logits at their last position; other rows (non-final prefill chunks) return None.

Sampling randomness is a pure function of (seed, token_index), so a seeded request produces the
same tokens alone, in any batch, and after pause / replay.

A step can also be submitted now and collected later (`submit` / `collect`), and a decode step
can take its input tokens from the samples of the step submitted before it (`feed`) without
the host reading them: a runner that computes in the background (`pipelined`) then lets the
scheduler queue step N + 1 before it has read step N's tokens, so the GPU does not wait for
the host between steps.

Hybrid models (`spec.is_hybrid`) also carry per-sequence recurrent state, which the runner keeps
by `seq_id`: a row at position 0 starts it, every later row must continue exactly where it ends.
Such runners have `release_sequence(seq_id)`, which the scheduler calls when it frees a
sequence's pages or pauses it to replay (optional: dense-only runners need not have it), and
the `RecurrentState` methods: `snapshot_state(seq_id)` copies a sequence's state (every GDN
layer's conv window and delta-rule state) to host memory as a `StateSnapshot`, and
`restore_state(seq_id, snapshot)` makes that the sequence's state, whatever it held before, so
its next row continues at `snapshot.num_tokens`. A snapshot pause keeps one beside the page
snapshot; the prefix cache restores a checkpoint into a new sequence that reuses a prefix.
`state_nbytes` is the fixed size of one sequence's state (what each `StateSnapshot` holds);
`max_states` how many sequences may hold one at a time (None: no fixed bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np

from ninfer.core.params import MAX_TOP_LOGPROBS, SamplingParams, in_range
from ninfer.models.spec import ModelSpec


@attrs.frozen(kw_only=True, eq=False)
class SampleSpec:
    """What to sample at a row's last position.

    Penalties: presence / frequency apply over `output_ids` (tokens generated so far);
    repetition applies over prompt and output (`prompt_ids` + `output_ids`), as in vLLM.
    `allowed` is a bool mask over the vocabulary from a grammar (None = unconstrained).
    Log-probabilities are of the raw model distribution (log_softmax of the logits, before
    temperature, penalties or masks).

    `score_ids` (scoring): token ids whose log-probabilities at this position the result
    reports in `SampledToken.score_logprobs`, in the same order, whatever is sampled. With
    `allowed` set to a single token and greedy params, a row is teacher-forced: the sampled
    token is that token and its `logprob` is its raw log-probability.

    Every position of the row (offline scoring, `ninfer score` / `ninfer export-hidden`), not
    only its last: `want_all_logits` returns `SampledToken.all_logits`, the raw logits after
    each of the row's tokens; `hidden_layers` returns `SampledToken.layer_hidden`, the hidden
    rows of those layers at each of the row's tokens: layer k (0 .. num_layers - 1) is the
    residual stream after decoder block k, -1 the final hidden row (rmsnorm(x) * final_norm,
    the head's input; what `want_hidden` gives for the last position). Only rows that ask pay
    for it.
    """

    params: SamplingParams
    seed: int
    token_index: int  # index of the token being sampled among the request's outputs
    prompt_ids: np.ndarray | None = None
    output_ids: np.ndarray | None = None
    allowed: np.ndarray | None = None
    num_top_logprobs: int = attrs.field(default=0, validator=in_range(0, MAX_TOP_LOGPROBS))
    want_logits: bool = False  # return the raw float32 logits row (tests, scoring)
    score_ids: np.ndarray | None = None  # int32 [k]: report these ids' raw log-probabilities
    want_hidden: bool = False  # return the final hidden row: rmsnorm(x) * final_norm, the head's input
    want_all_logits: bool = False  # return the logits at every position of the row (all_logits)
    hidden_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # layer_hidden: these layers, -1 = final

    def next_token(self) -> SampleSpec:
        """The same spec for the request's next token (a decode step queued ahead). Built field
        by field: `attrs.evolve` costs twice as much, once per row per step on the serving path."""
        return SampleSpec(
            params=self.params, seed=self.seed, token_index=self.token_index + 1, prompt_ids=self.prompt_ids,
            output_ids=self.output_ids, allowed=self.allowed, num_top_logprobs=self.num_top_logprobs,
            want_logits=self.want_logits, score_ids=self.score_ids, want_hidden=self.want_hidden,
            want_all_logits=self.want_all_logits, hidden_layers=self.hidden_layers,
        )  # fmt: skip


@attrs.frozen(kw_only=True, eq=False)
class StepRow:
    seq_id: int
    token_ids: np.ndarray  # int32 [n], n >= 1
    start_pos: int
    page_table: np.ndarray  # int32 page ids covering positions 0 .. start_pos + n - 1
    sample: SampleSpec | None = None


@attrs.frozen(kw_only=True, eq=False)
class SampledToken:
    token_id: int
    logprob: float  # log-probability of token_id under the raw distribution
    top_ids: np.ndarray | None = None  # int32 [k], best first
    top_logprobs: np.ndarray | None = None  # float32 [k]
    logits: np.ndarray | None = None  # float32 [vocab] when SampleSpec.want_logits
    score_logprobs: np.ndarray | None = None  # float32 [k]: of SampleSpec.score_ids, in order
    hidden: np.ndarray | None = None  # float32 [d_model] when SampleSpec.want_hidden
    # float32 [n, vocab] when SampleSpec.want_all_logits: row i is the logits after token_ids[i]
    # (it predicts the token at position start_pos + i + 1); the last row is the sampled position's
    all_logits: np.ndarray | None = None
    # float32 [len(hidden_layers), n, d_model] when SampleSpec.hidden_layers: [j, i] is layer
    # hidden_layers[j]'s hidden row at token_ids[i]
    layer_hidden: np.ndarray | None = None


@attrs.frozen(eq=False)
class PageSnapshot:
    """KV contents of some pages, copied to host memory (opaque to the scheduler)."""

    arrays: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


@attrs.frozen(eq=False)
class StateSnapshot:
    """One sequence's recurrent state after its first `num_tokens` tokens, in host memory
    (the arrays are the runner's to read: opaque to the scheduler and the prefix cache), or,
    with `slot` set, in one of the runner's checkpoint slots (device memory: `arrays` empty;
    `RecurrentState.save_checkpoint`)."""

    num_tokens: int
    arrays: tuple[np.ndarray, ...]
    slot: int | None = None  # the runner's checkpoint slot holding the state
    slot_nbytes: int = 0  # that slot's bytes (the state's size)

    @property
    def on_device(self) -> bool:
        return self.slot is not None

    @property
    def nbytes(self) -> int:
        """Host bytes (a checkpoint slot's state takes none)."""
        return sum(int(a.nbytes) for a in self.arrays)


@attrs.define(eq=False)
class Pending:
    """A submitted step; `Runner.collect` turns it into the step's results."""

    rows: Sequence[StepRow]
    state: object = None  # the runner's own: the launched sub-steps, or a synchronous runner's results


def check_hidden_layers(layers: Sequence[int], num_layers: int) -> None:
    """Raise ValueError unless every index is a layer (0 .. num_layers - 1) or -1 (final)."""
    for layer in layers:
        if not (layer == -1 or 0 <= layer < num_layers):
            raise ValueError(f"hidden layer {layer} is not one of 0 .. {num_layers - 1} or -1 (the final hidden row)")


def next_position(row: StepRow) -> int:
    """Position of the token a row samples: its sequence's next input."""
    return row.start_pos + len(row.token_ids)


def with_tokens(rows: Sequence[StepRow], sampled: Sequence[SampledToken]) -> list[StepRow]:
    """Fed rows made host-fed: each row's one token is the matching sampled token."""
    return [attrs.evolve(row, token_ids=np.array([tok.token_id], np.int32))
            for row, tok in zip(rows, sampled, strict=True)]  # fmt: skip


def check_feed(previous: Sequence[StepRow] | None, rows: Sequence[StepRow]) -> None:
    """Raise ValueError unless `rows` can take their tokens from the samples of `previous` (the
    step submitted just before): the same sequences in the same order, each sampled there,
    each now one token at the next position."""
    if previous is None:
        raise ValueError("feed needs a step submitted before it")
    if len(previous) != len(rows):
        raise ValueError(f"feed needs the previous step's {len(previous)} rows, got {len(rows)}")
    for prev, row in zip(previous, rows, strict=True):
        if prev.sample is None or row.seq_id != prev.seq_id or len(row.token_ids) != 1:
            raise ValueError(f"sequence {row.seq_id}: feed needs one token per row, sampled by the step before")
        if row.start_pos != next_position(prev):
            raise ValueError(f"sequence {row.seq_id}: feed needs position {next_position(prev)}, got {row.start_pos}")


class SyncSubmit:
    """`step` / `submit` / `collect` for runners that compute synchronously in `_step(rows)`
    (nothing runs behind the caller's back, so submitting ahead saves nothing: `pipelined` is
    False unless set, which tests do to run the scheduler's pipelined path on them)."""

    pipelined = False
    _last: tuple | None = None  # (rows, results) of the last step, for `feed`

    def step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        """Run one forward over the batch; one result per row, None where row.sample is None."""
        return self.collect(self.submit(rows))

    def submit(self, rows: Sequence[StepRow], *, feed: bool = False) -> Pending:
        if feed:
            check_feed(self._last[0] if self._last else None, rows)
            rows = with_tokens(rows, self._last[1])
        results = self._step(rows)
        self._last = (rows, results)
        return Pending(rows, results)

    def collect(self, pending: Pending) -> list[SampledToken | None]:
        return pending.state


@runtime_checkable
class Runner(Protocol):
    """A compute backend: the numpy reference or the numba.cuda one."""

    spec: ModelSpec
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the pool; ids are 0 .. num_pages - 1
    pipelined: bool  # submit returns before the step is done (worth submitting one step ahead)

    @property
    def page_nbytes(self) -> int:
        """Bytes one page holds over all layers (K and V)."""

    def step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        """Run one forward over the batch; one result per row, None where row.sample is None."""

    def submit(self, rows: Sequence[StepRow], *, feed: bool = False) -> Pending:
        """Start a step; `collect` waits for its results. A runner that computes in the
        background (`pipelined`) returns at once, so the caller can submit the next step while
        this one runs. feed=True: the rows continue the previous submitted step's rows (see
        `check_feed`), each taking the token sampled there as its input (token_ids ignored)."""

    def collect(self, pending: Pending) -> list[SampledToken | None]:
        """The results of a submitted step (each step collected once, in submission order)."""

    def snapshot_pages(self, page_ids: Sequence[int]) -> PageSnapshot:
        """Copy the pages' KV to host memory."""

    def restore_pages(self, page_ids: Sequence[int], snapshot: PageSnapshot) -> None:
        """Write a snapshot back into (possibly different) pages, in the same order."""

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Device-side page copy (copy-on-write of a shared tail page)."""

    def close(self) -> None:
        """Release device memory and threads."""


@runtime_checkable
class RecurrentState(Protocol):
    """What runners of hybrid models (`spec.is_hybrid`) add to `Runner`: per-sequence recurrent
    state, by `seq_id`."""

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (the size of each `StateSnapshot`)."""

    @property
    def max_states(self) -> int | None:
        """Sequences that may hold a state at once (device slots), or None (no fixed bound)."""

    @property
    def num_recurrent_states(self) -> int:
        """Sequences holding a state now."""

    def release_sequence(self, seq_id: int) -> None:
        """Drop the sequence's state (no-op when it holds none)."""

    def snapshot_state(self, seq_id: int) -> StateSnapshot:
        """Copy the sequence's state to host memory (after the steps queued so far);
        ValueError when it holds none."""

    def restore_state(self, seq_id: int, snapshot: StateSnapshot) -> None:
        """Make `snapshot` the sequence's state: its next row starts at `snapshot.num_tokens`
        (a snapshot in a checkpoint slot is copied from there, and stays)."""

    # Device checkpoints (optional: runners whose `num_checkpoint_slots` > 0). The prefix
    # cache's newest state checkpoints stay in the runner's own memory, where a hit restores
    # them without a host copy; older ones are demoted to host copies.

    @property
    def num_checkpoint_slots(self) -> int:
        """Checkpoint slots the runner holds (0: none)."""

    @property
    def num_free_checkpoint_slots(self) -> int:
        """Checkpoint slots free now."""

    def save_checkpoint(self, seq_id: int) -> StateSnapshot:
        """Copy the sequence's state (after the queued steps) into a free checkpoint slot: a
        snapshot with `slot` set. ValueError when it holds none or no slot is free."""

    def demote_checkpoint(self, snapshot: StateSnapshot) -> StateSnapshot:
        """The host copy of a checkpoint slot's state; the slot is free afterwards."""

    def release_checkpoint(self, snapshot: StateSnapshot) -> None:
        """Free the snapshot's checkpoint slot (bookkeeping only: no copy, no wait)."""


def recurrent_state(runner) -> RecurrentState | None:
    """The runner, where it keeps recurrent state (a hybrid model's) and can copy it, else None."""
    if getattr(runner.spec, "is_hybrid", False) and hasattr(runner, "snapshot_state"):
        return runner
    return None


def has_checkpoint_slots(runner) -> bool:
    """Whether the runner keeps device checkpoints (`RecurrentState.save_checkpoint`)."""
    return getattr(runner, "num_checkpoint_slots", 0) > 0


@attrs.define(eq=False)
class CheckpointSlots:
    """Which of a runner's `count` checkpoint slots hold a state, and which snapshot stands for
    it (a runner's bookkeeping; the states live where the runner keeps them)."""

    count: int
    _free: list[int] = attrs.field(init=False)
    _held: dict[int, StateSnapshot | None] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"checkpoint slots must be >= 0, got {self.count}")
        self._free = list(range(self.count - 1, -1, -1))  # pop() takes slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot, reserved (`hold` names the snapshot that stands for it)."""
        if not self._free:
            raise ValueError(f"no free checkpoint slot: all {self.count} hold a state (demote or release one)")
        slot = self._free.pop()
        self._held[slot] = None
        return slot

    def hold(self, snapshot: StateSnapshot) -> StateSnapshot:
        self._held[snapshot.slot] = snapshot
        return snapshot

    def check(self, snapshot: StateSnapshot) -> int:
        """The snapshot's slot, checked to still hold its state (not freed, not taken again)."""
        if snapshot.slot is None or self._held.get(snapshot.slot) is not snapshot:
            raise ValueError(f"checkpoint slot {snapshot.slot} no longer holds this snapshot's state")
        return snapshot.slot

    def free(self, snapshot: StateSnapshot) -> int:
        slot = self.check(snapshot)
        del self._held[slot]
        self._free.append(slot)
        return slot
