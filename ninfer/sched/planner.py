"""Scheduling decisions as pure functions over plain state (sans-IO; no trio, no runner).

`plan_step` decides, for the next forward pass, in this order:

1. Rows for the running sequences, oldest first. A decoding sequence always gets its one
   token; prefilling (or replaying) sequences share the step's prefill budget, oldest first,
   each row at most `prefill_chunk` tokens, or a chunk for itself and one for every request
   waiting for its prefix pages (single flight). The budget is `prefill_chunk`, except in a
   burst: when short prefills (at most a chunk each: short prompts, short suffixes over a
   cached prefix) running or admissible add up to more than `BURST_CHUNKS` chunks, or a
   prefill has waiters, the step takes every row's share, up to `max_prefill_tokens`. Pages
   are reserved only for the tokens of this step. A prefill row ends at the sequence's
   `checkpoint_at` (hybrid models: the prefix cache keeps the recurrent state there).
2. Pressure: when a row cannot get even the one page it needs, the planner first takes
   inactive prefix-cache pages (`num_reclaimable_pages`), then pauses the youngest running
   sequences that are younger than it, one at a time, until the page fits. A pause snapshots
   the victim's KV to host while the host budget allows, otherwise drops it for replay.
   Nobody is paused for an older sequence's sake, so the oldest always progresses.
3. Only in a step that paused nobody: resume paused sequences in arrival order, then admit
   waiting ones in FIFO order, each only when its restore plus its first row fit in the free
   pages with one spare page left for every running sequence (hysteresis against thrash).
   Nothing is admitted while anything is paused: paused sequences arrived earlier.

The driver applies the plan in the same order (reclaim, pauses, resumes, admissions, rows).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import attrs

from ninfer.cache.pages import pages_for_tokens
from ninfer.sched.sequence import Sequence


# Short prefills (at most a chunk each) adding up to more than this many chunks are a burst.
BURST_CHUNKS = 2


@attrs.frozen(kw_only=True)
class PlanLimits:
    page_size: int
    prefill_chunk: int  # the most prefill tokens of one row, and of a step outside a burst
    max_concurrency: int
    host_snapshot_bytes: int
    page_nbytes: int
    state_nbytes: int = 0  # one sequence's recurrent state (hybrid models): a snapshot pause keeps it too
    max_prefill_tokens: int | None = None  # of one step in a burst (None: 8 x prefill_chunk)

    def free_lanes(self, num_holding: int) -> int:
        """Execution lanes left when `num_holding` sequences (running or paused) hold one each."""
        return max(0, self.max_concurrency - num_holding)

    @property
    def max_step_prefill(self) -> int:
        """The most prefill tokens one step may take (at least a chunk)."""
        cap = 8 * self.prefill_chunk if self.max_prefill_tokens is None else self.max_prefill_tokens
        return max(self.prefill_chunk, cap)

    def row_prefill(self, seq: Sequence) -> int:
        """The most prefill tokens of the sequence's row: a chunk, and one more for every
        request waiting for its prefix pages (at most `max_step_prefill`)."""
        return min(self.max_step_prefill, self.prefill_chunk * (1 + seq.num_waiters))

    def prefill_budget(self, sequences: Iterable[Sequence]) -> int:
        """Prefill tokens for a step whose prefilling (or about to) sequences are `sequences`:
        a chunk, or in a burst (short ones, at most a chunk each, adding up to more than
        `BURST_CHUNKS` chunks, or one with waiters) every row's share, at most `max_step_prefill`."""
        chunk = self.prefill_chunk
        prefilling = [seq for seq in sequences if seq.num_pending > 1]
        num_short = sum(seq.num_pending for seq in prefilling if seq.num_pending <= chunk)
        if num_short <= BURST_CHUNKS * chunk and not any(seq.num_waiters for seq in prefilling):
            return chunk
        num_wanted = sum(min(seq.num_pending, self.row_prefill(seq)) for seq in prefilling)
        return max(chunk, min(self.max_step_prefill, num_wanted))


@attrs.frozen(kw_only=True)
class PoolState:
    num_free_pages: int
    num_reclaimable_pages: int = 0  # inactive prefix-cache pages that could be freed
    # ... or, given, counts them up to n when the plan needs pages (a cache filling the pool
    # holds thousands: counting them all each step cost more than the step's other planning)
    count_reclaimable: Callable[[int], int] | None = None
    host_snapshot_bytes_used: int = 0
    # Pages a pause would free: those the victim alone holds. Pages it shares with the prefix
    # cache (or other sequences) stay in use. None: every page is the victim's alone.
    count_private_pages: Callable[[Sequence], int] | None = None


class PauseMode(enum.Enum):
    SNAPSHOT = "snapshot"  # copy the pages to host, restore them on resume
    DROP = "drop"  # free the pages, replay prompt + emitted tokens on resume


@attrs.frozen(eq=False)
class Pause:
    seq: Sequence
    mode: PauseMode


@attrs.frozen(eq=False)
class PlannedRow:
    """Feed `seq.token_ids[seq.num_cached : seq.num_cached + num_tokens]` this step."""

    seq: Sequence
    num_tokens: int
    num_new_pages: int  # pages to allocate for this row (after any snapshot restore)
    samples: bool  # the row reaches the last known token, so the runner samples the next


@attrs.frozen(eq=False)
class StepPlan:
    rows: tuple[PlannedRow, ...] = ()
    pauses: tuple[Pause, ...] = ()
    resumes: tuple[Sequence, ...] = ()
    admits: tuple[Sequence, ...] = ()
    num_reclaim_pages: int = 0

    @property
    def is_idle(self) -> bool:
        return not (self.rows or self.pauses or self.resumes or self.admits)


class _Budget:
    """What is left to hand out while one step is being planned."""

    def __init__(self, pool: PoolState, limits: PlanLimits, num_prefill: int):
        self.num_free = pool.num_free_pages
        self.num_reclaimable = pool.num_reclaimable_pages
        self._count_reclaimable = pool.count_reclaimable
        self.num_reclaim = 0
        self.num_prefill_left = num_prefill
        self.host_bytes_left = limits.host_snapshot_bytes - pool.host_snapshot_bytes_used
        self._count_private = pool.count_private_pages or (lambda seq: len(seq.pages))

    def pages_freed_by_pause(self, seq: Sequence) -> int:
        return self._count_private(seq)

    def reclaim_up_to(self, num_pages: int) -> None:
        need = max(0, num_pages - self.num_free)
        if need == 0:
            return
        if self._count_reclaimable is not None:  # those this plan has not taken yet
            self.num_reclaimable = self._count_reclaimable(self.num_reclaim + need) - self.num_reclaim
        take = min(self.num_reclaimable, need)
        self.num_reclaimable -= take
        self.num_reclaim += take
        self.num_free += take

    def pause_mode(self, seq: Sequence, page_nbytes: int, state_nbytes: int = 0) -> PauseMode:
        snapshot_bytes = len(seq.pages) * page_nbytes + state_nbytes
        if seq.num_cached == 0 or snapshot_bytes > self.host_bytes_left:
            return PauseMode.DROP
        self.host_bytes_left -= snapshot_bytes
        return PauseMode.SNAPSHOT


def plan_step(
    running: Seq[Sequence],
    paused: Seq[Sequence],
    waiting: Seq[Sequence],
    pool: PoolState,
    limits: PlanLimits,
) -> StepPlan:
    """Decide the next step. All three lists are in arrival (FIFO) order; `waiting` holds the
    admission candidates (looked up in the prefix cache, not waiting for another's pages)."""
    candidates = waiting[: limits.free_lanes(len(running) + len(paused))]
    budget = _Budget(pool, limits, limits.prefill_budget([*running, *paused, *candidates]))
    residents = list(running)
    rows, pauses = _plan_running(residents, budget, limits)
    resumes: list[Sequence] = []
    admits: list[Sequence] = []
    if not pauses:
        resumes = _plan_starts(paused, residents, rows, budget, limits)
        if len(resumes) == len(paused):
            admits = _plan_starts(waiting[: limits.free_lanes(len(residents))], residents, rows, budget, limits)
    return StepPlan(
        rows=tuple(rows),
        pauses=tuple(pauses),
        resumes=tuple(resumes),
        admits=tuple(admits),
        num_reclaim_pages=budget.num_reclaim,
    )


def _wanted_tokens(seq: Sequence, num_prefill_left: int, limits: PlanLimits) -> int:
    """Tokens the sequence would feed this step: its decode token, or a prefill chunk."""
    if seq.num_pending == 1:
        return 1
    num_tokens = min(seq.num_pending, num_prefill_left, limits.row_prefill(seq))
    if seq.checkpoint_at > seq.num_cached:  # the prefix cache wants the state there: end the row at it
        num_tokens = min(num_tokens, seq.checkpoint_at - seq.num_cached)
    return num_tokens


def _plan_running(residents: list[Sequence], budget: _Budget, limits: PlanLimits):
    rows: list[PlannedRow] = []
    pauses: list[Pause] = []
    index = 0
    while index < len(residents):
        seq = residents[index]
        num_wanted = _wanted_tokens(seq, budget.num_prefill_left, limits)
        if num_wanted:
            budget.reclaim_up_to(seq.pages_needed(num_wanted, limits.page_size))
            pauses += _pause_for(seq, index, residents, budget, limits)
            row = _fit_row(seq, num_wanted, len(seq.pages), budget, limits)
            if row is not None:
                rows.append(row)
        index += 1
    return rows, pauses


def _pause_for(seq, index, residents, budget, limits) -> list[Pause]:
    """Pause the youngest residents younger than `seq` until its first new token fits."""
    pauses = []
    while seq.pages_needed(1, limits.page_size) > budget.num_free:
        victim = next((s for s in reversed(residents[index + 1 :]) if s.pages), None)
        if victim is None:
            break
        residents.remove(victim)
        pauses.append(Pause(victim, budget.pause_mode(victim, limits.page_nbytes, limits.state_nbytes)))
        # Shared pages stay in use (they become reclaimable cache only in the next step).
        budget.num_free += budget.pages_freed_by_pause(victim)
    return pauses


def _fit_row(seq, num_wanted, num_held, budget: _Budget, limits) -> PlannedRow | None:
    """Shrink the wanted tokens to the free pages; reserve them."""
    fitting = (num_held + budget.num_free) * limits.page_size - seq.num_cached
    num_tokens = min(num_wanted, fitting)
    if num_tokens <= 0:
        return None
    num_new_pages = pages_for_tokens(seq.num_cached + num_tokens, limits.page_size) - num_held
    budget.num_free -= max(0, num_new_pages)
    if seq.num_pending > 1:
        budget.num_prefill_left -= num_tokens
    return PlannedRow(seq, num_tokens, max(0, num_new_pages), num_tokens == seq.num_pending)


def _plan_starts(candidates, residents, rows, budget: _Budget, limits) -> list[Sequence]:
    """Resume (or admit) candidates in order while each fits with headroom; stop at the first miss."""
    started = []
    for seq in candidates:
        num_held = seq.num_snapshot_pages if seq.snapshot is not None else len(seq.pages)
        first_row = 1 if seq.num_pending == 1 else min(seq.num_pending, limits.prefill_chunk)
        num_needed = pages_for_tokens(seq.num_cached + first_row, limits.page_size) - len(seq.pages)
        num_headroom = len(residents)  # one page of growth for every running sequence
        budget.reclaim_up_to(num_needed + num_headroom)
        if budget.num_free - num_needed < num_headroom:
            break
        budget.num_free -= num_held - len(seq.pages)  # the snapshot's pages
        residents.append(seq)
        started.append(seq)
        row = _fit_row(seq, _wanted_tokens(seq, budget.num_prefill_left, limits), num_held, budget, limits)
        if row is not None:
            rows.append(row)
    return started


def split_expired(waiting: Seq[Sequence], now_s: float) -> tuple[list[Sequence], list[Sequence]]:
    """(still waiting, past their pending deadline)."""
    keep = [seq for seq in waiting if seq.deadline_s > now_s]
    expired = [seq for seq in waiting if seq.deadline_s <= now_s]
    return keep, expired


def next_deadline_s(waiting: Seq[Sequence]) -> float:
    return min((seq.deadline_s for seq in waiting), default=float("inf"))
