"""The step task: the only owner of the runner.

Each iteration is one recipe: reap cancelled requests, expire the queue, plan, apply the
plan (reclaim, pause, resume, admit), run one batched forward off the event loop, and accept
the sampled tokens (lane.accept_sampled: text, stop strings, grammar, limits) in one pass, so
the next plan sees every request's new state without waiting on any other task.

Lookahead (a pipelined runner, `EngineConfig.lookahead`): while the running set only decodes
and nothing could be admitted or resumed, the step task submits step N + 1 with `feed` (its
tokens are step N's samples, on the device) before it collects step N, so the GPU runs N + 1
while the host hands out N's tokens. It stops looking ahead as soon as the plan could differ
(a request queued with a lane free, a request paused, cancelled or finished, a grammar or
penalties, a sequence at its last token, no free page); the step in flight is then collected
and committed like any other, its tokens dropped for sequences that ended meanwhile (the K/V
it writes for them, the right K/V of their last token, lies past what they or the prefix
cache count as computed; later users of those pages are queued behind it on the stream).

Hybrid models (a runner with recurrent state, `core.runner.RecurrentState`): a snapshot pause
copies the sequence's state beside its pages and the resume restores both; any pause releases
the runner's copy (a replay recomputes it). A sequence admitted over a cached prefix starts
from the prefix cache's checkpoint (`seq.start_state`, restored before its first row), and a
row that ends at `seq.checkpoint_at` hands the state there to the cache (`keep_checkpoint`),
after the step (prefill rows are never looked ahead, so no step is in flight then).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from ninfer.core.runner import (
    Runner, SampleSpec, StateSnapshot, StepRow, has_checkpoint_slots, next_position, recurrent_state,
)
from ninfer.sched.lane import accept_sampled
from ninfer.sched.planner import Pause, PauseMode, PlanLimits, PlannedRow, PoolState, plan_step
from ninfer.sched.planner import StepPlan, split_expired
from ninfer.sched.request import FinishReason, QueueTimeout, RequestFailed, Started
from ninfer.sched.sequence import Phase, Sequence
from ninfer.sched.state import EngineState
from ninfer.sched.stats import Outcome

log = logging.getLogger(__name__)

Executor = Callable[..., Awaitable[Any]]
_FED = np.zeros(1, np.int32)  # a fed row's token ids: the runner takes the token from the step before
_FED.flags.writeable = False


class Stepper:
    def __init__(
        self,
        state: EngineState,
        runner: Runner,
        executor: Executor,
        limits: PlanLimits,
        assignments: trio.MemorySendChannel,
        *,
        max_context: int | None = None,
        lookahead: bool = False,
    ):
        self._state = state
        self._runner = runner
        self._executor = executor
        self._limits = limits
        self._assignments = assignments
        self._max_context = max_context or runner.spec.max_context
        self._lookahead = lookahead
        self._recurrent = recurrent_state(runner)  # hybrid models: snapshots and checkpoints of the state

    async def run(self) -> None:
        """Step until cancelled, or until the runner fails (the engine is then unhealthy)."""
        while True:
            await trio.lowlevel.checkpoint()
            try:
                did_work = await self._step_once()
            except trio.Cancelled:
                raise
            except Exception as exc:
                # The runner's state is unknown now: fail everything in flight, take no more.
                log.exception("an engine step failed; the engine is now unhealthy")
                self._state.fail_all(f"the runner failed ({type(exc).__name__}; details are in the server log)")
                return
            if not did_work:
                await self._state.work_changed.wait()

    async def _step_once(self) -> bool:
        state = self._state
        clock = state.counters.phases  # host seconds per phase (stats.STEP_PHASES)
        clock.start()
        self._reap_cancelled()
        expire_waiting(state)
        candidates = self._attach_prefixes()
        clock.lap("schedule")
        await self._run_cache_io()  # restores and copy-on-write tails for those hits
        clock.lap("cache_io")
        # Only looked-up requests may be admitted: not those waiting for another's pages, nor
        # those that arrived (or a cancellation removed) while the copies ran.
        plan = self._plan([seq for seq in candidates if seq.phase is Phase.WAITING])
        if self._detach_unadmitted(plan):
            # Pages held by queued requests must not starve running ones: plan again without.
            plan = self._plan([seq for seq in plan.admits if seq.phase is Phase.WAITING])
        clock.lap("schedule")
        if plan.is_idle:
            return False
        if plan.num_reclaim_pages:
            state.prefix.reclaim(plan.num_reclaim_pages, state.pool)
            await self._run_cache_io()  # demotions: their pages are free once snapshotted
            clock.lap("cache_io")
        # Pauses and resumes await the runner; meanwhile a queued request may be cancelled
        # or expire, so each step re-checks the phase the plan was made for.
        for pause in plan.pauses:
            if pause.seq.phase is Phase.RUNNING:
                await self._pause(pause)
        for seq in plan.resumes:
            if seq.phase is Phase.PAUSED:
                await self._resume(seq)
        clock.lap("pause_resume")
        for seq in plan.admits:
            if seq.phase is Phase.WAITING:
                self._admit(seq)
        if self._recurrent is not None:  # hybrids: admitted sequences start from a cache checkpoint
            await self._start_states(plan.admits)
        if plan.rows:
            await self._run_rows(plan.rows)
            if self._recurrent is not None:
                await self._take_checkpoints(plan.rows)
                clock.lap("cache_io")
        return True

    def _plan(self, waiting: list[Sequence]) -> StepPlan:
        state = self._state
        pool = PoolState(
            num_free_pages=state.pool.num_free,
            count_reclaimable=state.prefix.num_reclaimable_pages,
            host_snapshot_bytes_used=state.host_snapshot_bytes,
            count_private_pages=self._count_private_pages,
        )
        return plan_step(state.running, state.paused, waiting, pool, self._limits)

    def _count_private_pages(self, seq: Sequence) -> int:
        pool = self._state.pool
        return sum(1 for page in seq.pages if pool.refcount(page) == 1)

    # -- bookkeeping before the plan ----------------------------------------------------

    def _reap_cancelled(self) -> None:
        for seq in [*self._state.running, *self._state.paused]:
            if seq.is_cancel_requested:
                self._state.finish(seq, FinishReason.CANCELLED)

    def _attach_prefixes(self) -> list[Sequence]:
        """Look up queued requests in FIFO order until there is one for every free lane; returns
        them (the admission candidates). A request whose next prefix pages another request is
        computing right now waits for them (single flight): it is no candidate this step."""
        state = self._state
        num_lanes_free = self._limits.free_lanes(len(state.running) + len(state.paused))
        candidates: list[Sequence] = []
        owners: Counter[int] = Counter()  # seq_id -> requests waiting for its pages now
        for seq in list(state.waiting):
            if len(candidates) >= num_lanes_free:
                break
            if not seq.is_prefix_looked_up:
                try:
                    state.prefix.attach(seq, state.pool)
                    if seq.prefix_wait is not None:
                        owners[seq.prefix_wait.owner_id] += 1
                        continue
                    seq.is_prefix_looked_up = True
                    state.prefix.claim(seq)
                except Exception:
                    # Work that depends on one request fails that request alone.
                    log.exception("request %s: the prefix-cache lookup failed", seq.request.request_id)
                    error = RequestFailed("The server failed while looking up this request's prompt in its cache.")
                    state.reject_waiting(seq, error, Outcome.ERROR)
                    continue
            candidates.append(seq)
        for seq in (*state.running, *state.paused, *candidates):
            seq.num_waiters = owners[seq.seq_id]  # the planner gives their rows more
        return candidates

    def _detach_unadmitted(self, plan: StepPlan) -> bool:
        """Queued requests the plan does not admit give their cache hits back (looked up again later).

        Returns whether any held pages, i.e. whether the plan saw fewer free pages than there are.
        """
        admitted = {seq.seq_id for seq in plan.admits}
        held = False
        for seq in self._state.waiting:
            if seq.is_prefix_looked_up and seq.seq_id not in admitted:
                held = held or bool(seq.pages)
                self._state.prefix.detach(seq, self._state.pool)
                seq.start_state, seq.checkpoint_at = None, 0
                seq.is_prefix_looked_up = False
        return held

    async def _run_cache_io(self) -> None:
        """Run the prefix cache's queued KV copies off the event loop, then let it settle them."""
        prefix = self._state.prefix
        io = prefix.take_io()
        if io:
            result = await self._executor(io.run, self._runner)
            prefix.complete_io(io, result, self._state.pool)

    # -- applying the plan ---------------------------------------------------------------

    async def _pause(self, pause: Pause) -> None:
        state, seq = self._state, pause.seq
        if pause.mode is PauseMode.SNAPSHOT:
            snapshot = await self._executor(self._runner.snapshot_pages, list(seq.pages))
            seq.snapshot, seq.num_snapshot_pages = snapshot, len(seq.pages)
            state.host_snapshot_bytes += snapshot.nbytes
            if self._recurrent is not None:  # the recurrent state goes beside the pages
                seq.state_snapshot = await self._executor(self._recurrent.snapshot_state, seq.seq_id)
                state.host_snapshot_bytes += seq.state_snapshot.nbytes
        else:
            seq.num_cached = 0  # a replay starts its recurrent state over
        state.release_state(seq.seq_id)  # paused sequences hold no state in the runner
        state.pool.release(seq.pages)
        seq.pages = []
        state.forget_prefix(seq)  # requests waiting for its prefix pages compute them themselves
        seq.num_pauses += 1
        state.counters.num_preemptions += 1
        state.move(seq, Phase.PAUSED)
        state.tickets[seq.seq_id].interrupt()

    async def _resume(self, seq: Sequence) -> None:
        state = self._state
        if seq.snapshot is not None:
            pages = state.pool.allocate(seq.num_snapshot_pages)
            await self._executor(self._runner.restore_pages, pages, seq.snapshot)
            state.host_snapshot_bytes -= seq.snapshot.nbytes
            seq.snapshot, seq.pages = None, pages
            if seq.state_snapshot is not None:
                await self._executor(self._recurrent.restore_state, seq.seq_id, seq.state_snapshot)
                state.host_snapshot_bytes -= seq.state_snapshot.nbytes
                seq.state_snapshot = None
            state.counters.num_snapshot_restores += 1
        else:
            state.counters.num_replay_restores += 1
        state.move(seq, Phase.RUNNING)
        state.tickets[seq.seq_id].wake.notify()

    async def _start_states(self, admitted) -> None:
        """Hybrid models: sequences admitted over a cached prefix start from its checkpoint."""
        for seq in admitted:
            if seq.start_state is not None and seq.phase is Phase.RUNNING:
                if seq.start_state.num_tokens != seq.num_cached:
                    raise RuntimeError(f"sequence {seq.seq_id}: a checkpoint after {seq.start_state.num_tokens}"
                                       f" tokens for a prefix of {seq.num_cached}")  # fmt: skip
                await self._executor(self._recurrent.restore_state, seq.seq_id, seq.start_state)
            seq.start_state = None

    async def _take_checkpoints(self, planned: tuple[PlannedRow, ...]) -> None:
        """Hybrid models: hand the prefix cache the state of sequences whose row just ended at
        their `checkpoint_at` (no step is in flight here: prefill rows are never looked ahead)."""
        for planned_row in planned:
            seq = planned_row.seq
            if not seq.checkpoint_at or seq.num_cached != seq.checkpoint_at or seq.phase is not Phase.RUNNING:
                continue
            seq.checkpoint_at = 0
            snapshot = await self._checkpoint(seq.seq_id)
            kept = False
            try:
                kept = self._state.prefix.keep_checkpoint(seq, snapshot)
            except Exception:
                log.exception("request %s: the prefix cache failed to take its checkpoint", seq.request.request_id)
            if snapshot.on_device and not kept:
                self._recurrent.release_checkpoint(snapshot)

    async def _checkpoint(self, seq_id: int) -> StateSnapshot:
        """The sequence's state for the prefix cache: in one of the runner's checkpoint slots
        where it has them (the oldest device checkpoint demoted to a host copy when every slot
        is full), else a host copy."""
        runner, prefix = self._recurrent, self._state.prefix
        if has_checkpoint_slots(runner):
            if runner.num_free_checkpoint_slots == 0 and (oldest := prefix.take_oldest_device_checkpoint()):
                entry, device = oldest
                host = await self._executor(runner.demote_checkpoint, device)
                prefix.keep_demoted(entry, host)
            if runner.num_free_checkpoint_slots > 0:
                return await self._executor(runner.save_checkpoint, seq_id)
        return await self._executor(runner.snapshot_state, seq_id)

    def _admit(self, seq: Sequence) -> None:
        state = self._state
        state.move(seq, Phase.RUNNING)
        state.counters.num_prompt_tokens += seq.num_prompt
        state.counters.num_cached_prompt_tokens += seq.num_cached_prompt
        ticket = state.tickets[seq.seq_id]
        ticket.emit(Started(seq.request.request_id, seq.num_prompt, seq.num_cached_prompt))
        self._assignments.send_nowait(seq)
        state.queue_changed.notify()

    # -- the forward pass ----------------------------------------------------------------

    async def _run_rows(self, planned: tuple[PlannedRow, ...]) -> None:
        started_s = trio.current_time()
        kept, rows = [], []
        for planned_row in planned:
            row = self._make_row(planned_row, started_s)
            if row is not None:
                kept.append(planned_row)
                rows.append(row)
        clock = self._state.counters.phases
        clock.lap("schedule")
        if not rows:
            return
        if not self._lookahead:
            results = await self._executor(self._runner.step, rows)
            clock.lap("forward")
            self._commit_step(kept, rows, results)
            clock.lap("commit")
            return
        pending = await self._executor(self._runner.submit, rows)
        clock.lap("forward")
        while True:
            ahead = self._ahead(kept, rows)
            clock.lap("schedule")
            if ahead is None:
                results = await self._executor(self._runner.collect, pending)
            else:  # step N + 1 queued behind step N, then step N's tokens
                results, next_pending = await self._executor(self._submit_then_collect, ahead[1], pending)
                self._state.counters.num_lookahead_steps += 1
            clock.lap("forward")
            self._commit_step(kept, rows, results)
            clock.lap("commit")
            if ahead is None:
                return
            (kept, rows), pending = ahead, next_pending

    def _submit_then_collect(self, rows: list[StepRow], pending):
        """(in the executor's thread) Queue `rows` fed by the step before, then collect that step."""
        next_pending = self._runner.submit(rows, feed=True)
        return self._runner.collect(pending), next_pending

    def _commit_step(self, kept: list[PlannedRow], rows: list[StepRow], results) -> None:
        if len(results) != len(rows):
            raise RuntimeError(f"the runner returned {len(results)} results for {len(rows)} rows")
        self._state.counters.num_steps += 1
        for planned_row, result in zip(kept, results):
            self._commit(planned_row, result)

    def _ahead(self, kept: list[PlannedRow], rows: list[StepRow]):
        """(planned rows, step rows) of the decode step after the one in flight (`rows`), fed by
        its samples, or None where the plan after it could be anything else."""
        state = self._state
        # a paused request may resume, a queued one be admitted where a lane is free (the
        # deadline task expires the queue meanwhile)
        can_admit = state.waiting and len(state.running) < self._limits.max_concurrency
        if state.paused or can_admit or len(state.running) != len(kept):
            return None
        for planned_row, row in zip(kept, rows, strict=True):
            seq, request = planned_row.seq, planned_row.seq.request
            if not planned_row.samples or seq.phase is not Phase.RUNNING or seq.is_cancel_requested:
                return None
            if request.constraint is not None or request.sampling.has_penalties:
                return None  # the next step's inputs depend on the token in flight
            # the in-flight token is the last one (length, context): nothing to look ahead for
            if seq.num_output + 1 >= request.max_tokens or next_position(row) + 2 > self._max_context:
                return None
        page_size = self._limits.page_size
        new_page = [next_position(row) // page_size >= len(p.seq.pages) for p, row in zip(kept, rows, strict=True)]
        if sum(new_page) > state.pool.num_free:
            return None
        ahead_kept, ahead_rows = [], []
        for planned_row, row, needs_page in zip(kept, rows, new_page, strict=True):
            seq = planned_row.seq
            if needs_page:
                seq.pages += state.pool.allocate(1)
            page_table = row.page_table  # the runner only reads it: shared until a page is added
            if len(page_table) != len(seq.pages):
                page_table = np.asarray(seq.pages, dtype=np.int32)
            ahead_kept.append(PlannedRow(seq=seq, num_tokens=1, num_new_pages=0, samples=True))
            ahead_rows.append(StepRow(
                seq_id=seq.seq_id, token_ids=_FED, start_pos=next_position(row), page_table=page_table,
                sample=row.sample.next_token(),
            ))  # fmt: skip
        return ahead_kept, ahead_rows

    def _make_row(self, planned: PlannedRow, started_s: float) -> StepRow | None:
        seq = planned.seq
        if seq.phase is not Phase.RUNNING:
            return None
        sample = None
        if planned.samples:
            try:
                sample = self._sample_spec(seq)
            except Exception as exc:
                log.exception("request %s: building its sampling inputs failed", seq.request.request_id)
                self._state.finish(seq, FinishReason.ERROR, error=f"invalid constraint: {exc}")
                return None
        seq.pages += self._state.pool.allocate(planned.num_new_pages)
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = started_s
        start = seq.num_cached
        tokens = seq.token_ids[start : start + planned.num_tokens]
        return StepRow(
            seq_id=seq.seq_id,
            token_ids=np.asarray(tokens, dtype=np.int32),
            start_pos=start,
            page_table=np.asarray(seq.pages, dtype=np.int32),
            sample=sample,
        )

    def _sample_spec(self, seq: Sequence) -> SampleSpec:
        request = seq.request
        allowed = None
        if request.constraint is not None:
            allowed = request.constraint.allowed_mask()
            if allowed is not None and not np.any(allowed):
                raise ValueError("the grammar allows no token at this point")
        with_penalties = request.sampling.has_penalties
        return SampleSpec(
            params=request.sampling,
            seed=seq.seed,
            token_index=seq.num_output,
            prompt_ids=seq.prompt_array if with_penalties else None,
            output_ids=np.asarray(seq.output_ids, dtype=np.int32) if with_penalties else None,
            allowed=allowed,
            num_top_logprobs=request.top_logprobs if request.logprobs else 0,
            score_ids=np.asarray(request.score_token_ids, dtype=np.int32) if request.score_token_ids else None,
            want_hidden=request.want_hidden,
        )

    def _commit(self, planned: PlannedRow, result) -> None:
        seq, counters = planned.seq, self._state.counters
        old, new = seq.num_cached, seq.num_cached + planned.num_tokens
        seq.num_cached = new
        counters.num_replayed_tokens += max(0, min(new, seq.num_computed_max) - old)
        counters.num_prefill_tokens += max(0, min(new, seq.num_prompt) - max(old, seq.num_computed_max))
        seq.num_computed_max = max(seq.num_computed_max, new)
        completed_pages = new // self._limits.page_size > old // self._limits.page_size
        if completed_pages and old < seq.num_prompt and seq.phase is Phase.RUNNING:
            # Share the prompt pages just completed: requests arriving now reuse them. (Pages of
            # generated tokens wait for the finish: sharing them mid-run would cost a hash and a
            # chain touch per page per stream on the decode path, for follow-ups that come later.)
            self._state.publish_pages(self._state.prefix.publish_progress, seq)
        # A request cancelled (or shut down) while the step ran is reaped, not fed.
        if planned.samples and seq.phase is Phase.RUNNING and not seq.is_cancel_requested:
            if result is None:
                raise RuntimeError(f"the runner sampled nothing for sequence {seq.seq_id}")
            accept_sampled(self._state, seq, result, self._max_context)


def expire_waiting(state: EngineState) -> None:
    """Reject every queued request whose pending deadline has passed."""
    now_s = trio.current_time()
    _, expired = split_expired(state.waiting, now_s)
    for seq in expired:
        waited_s = now_s - seq.submitted_s
        error = QueueTimeout(f"The request waited {waited_s:.3g} s for a free lane and timed out.")
        state.reject_waiting(seq, error, Outcome.QUEUE_TIMEOUT)
