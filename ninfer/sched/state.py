"""The engine's shared state and its synchronous transitions (finish, fail, count).

The step task, the lane tasks and `submit` all mutate this one object from the trio thread,
never across an `await`, so no locks are needed. Page releases of resident sequences happen
only between steps (the step task reaps cancellations and finishes sequences as it accepts
their tokens), never while the runner may still be writing those pages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from ninfer.cache.pages import PagePool
from ninfer.core.usage import Timings, Usage
from ninfer.sched.output import OutputText
from ninfer.sched.prefix_hook import PrefixCacheHook
from ninfer.sched.request import EngineError, EngineUnhealthy, Event, Finished, FinishReason
from ninfer.sched.sequence import Phase, Sequence
from ninfer.sched.stats import Counters, EngineStatistics, Outcome, RequestObserver, RequestRecord

log = logging.getLogger(__name__)

_OUTCOME_OF_REASON = {
    FinishReason.STOP: Outcome.STOP,
    FinishReason.LENGTH: Outcome.LENGTH,
    FinishReason.CANCELLED: Outcome.CANCELLED,
    FinishReason.ERROR: Outcome.ERROR,
}


class Signal:
    """A level-triggered wake-up for one waiter: `notify` before `wait` is never lost."""

    def __init__(self):
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


class Ticket:
    """The trio side of one sequence: its event stream, its lane's cancel scope, wake-ups."""

    def __init__(self, text: OutputText, stop_ids: frozenset[int]):
        self.events_send, self.events_receive = trio.open_memory_channel[Event | EngineError](
            math.inf  # bounded by max_tokens; a slow reader must never stall the step
        )
        self.scope: trio.CancelScope | None = None  # the lane's resident scope; pause cancels it
        self.wake = Signal()  # resumed, or finished while paused
        self.text = text
        self.stop_ids = stop_ids
        self.ended = trio.Event()  # the last event (Finished or the error) went out

    def end(self, item: Event | EngineError) -> None:
        """Emit the stream's last event and close it."""
        self.emit(item)
        self.events_send.close()
        self.ended.set()

    def emit(self, item: Event | EngineError) -> None:
        try:
            self.events_send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; its cancellation is already on the way

    def interrupt(self) -> None:
        """Move the lane out of its resident phase (pause or finish)."""
        if self.scope is not None:
            self.scope.cancel()
        self.wake.notify()


class EngineState:
    def __init__(self, pool: PagePool, prefix: PrefixCacheHook, observer: RequestObserver | None,
                 release_state: Callable[[int], None] | None = None, *,
                 count_states: Callable[[], int] | None = None, state_nbytes: int = 0):  # fmt: skip
        self.pool = pool
        # drops a sequence's recurrent state in the runner (hybrid models), by sequence id
        self.release_state = release_state or (lambda seq_id: None)
        # sequences whose recurrent state the runner holds now, and the bytes of one such state
        self.count_states = count_states or (lambda: 0)
        self.state_nbytes = state_nbytes
        self.prefix = prefix
        self.observer = observer
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []
        self.tickets: dict[int, Ticket] = {}
        self.counters = Counters()
        self.host_snapshot_bytes = 0
        self.is_healthy = True
        self.is_closed = False
        self.is_draining = False  # shutting down: queued and new requests are refused
        self.work_changed = Signal()  # wakes the idle step task
        self.queue_changed = Signal()  # wakes the deadline task

    # -- phases -------------------------------------------------------------------------

    def move(self, seq: Sequence, phase: Phase) -> None:
        """Move a sequence between the waiting / running / paused lists (kept in arrival order)."""
        self._list_of(seq.phase).remove(seq)
        seq.phase = phase
        target = self._list_of(phase)
        target.append(seq)
        target.sort(key=lambda s: s.seq_id)

    def _list_of(self, phase: Phase) -> list[Sequence]:
        lists = {Phase.WAITING: self.waiting, Phase.RUNNING: self.running, Phase.PAUSED: self.paused}
        return lists[phase]

    def release_kv(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        self.release_state(seq.seq_id)
        seq.start_state = None
        if seq.snapshot is not None:
            self.host_snapshot_bytes -= seq.snapshot.nbytes
            seq.snapshot = None
        if seq.state_snapshot is not None:
            self.host_snapshot_bytes -= seq.state_snapshot.nbytes
            seq.state_snapshot = None

    # -- endings ------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: FinishReason, **details) -> None:
        """End an admitted sequence: free its KV, send Finished, record, wake its lane."""
        if seq.phase is Phase.FINISHED:
            return
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.publish_pages(self.prefix.publish, seq)
        self.forget_prefix(seq)
        self._list_of(seq.phase).remove(seq)
        seq.phase = Phase.FINISHED
        self.release_kv(seq)
        ticket = self.tickets.pop(seq.seq_id)
        now_s = trio.current_time()
        usage = Usage(seq.num_prompt, seq.num_output, seq.num_cached_prompt)
        ticket.end(Finished(reason, usage, _timings(seq, now_s), **details))
        ticket.interrupt()
        self._record(seq, _OUTCOME_OF_REASON[reason], now_s)
        self.work_changed.notify()

    def publish_pages(self, publish: Callable[[Sequence, PagePool], None], seq: Sequence) -> None:
        """Offer a sequence's pages to the prefix cache; a failure costs the sharing, not the engine."""
        try:
            publish(seq, self.pool)
        except Exception:
            log.exception("request %s: the prefix cache failed to take its pages", seq.request.request_id)

    def forget_prefix(self, seq: Sequence) -> None:
        """The sequence stops computing: whoever waits for its pages looks up again (single flight)."""
        try:
            self.prefix.forget(seq)
        except Exception:
            log.exception("request %s: the prefix cache failed to end its claims", seq.request.request_id)

    def reject_waiting(self, seq: Sequence, error: EngineError | Finished, outcome: Outcome) -> None:
        """End a sequence that never got a lane: its stream raises `error`."""
        self.waiting.remove(seq)
        seq.phase = Phase.FINISHED
        if seq.is_prefix_looked_up:  # attached this step: the lookup of a request never admitted
            seq.is_prefix_looked_up = False
            try:
                self.prefix.detach(seq, self.pool)
            except Exception:
                log.exception("request %s: the prefix cache failed to detach it", seq.request.request_id)
        self.forget_prefix(seq)
        self.release_kv(seq)  # pages a prefix-cache hit attached while it waited
        ticket = self.tickets.pop(seq.seq_id)
        ticket.end(error)
        self._record(seq, outcome, trio.current_time())
        self.queue_changed.notify()

    def cancel_waiting(self, seq: Sequence) -> None:
        """The consumer left before the request got a lane."""
        now_s = trio.current_time()
        usage = Usage(seq.num_prompt, 0, 0)
        finished = Finished(FinishReason.CANCELLED, usage, _timings(seq, now_s))
        self.reject_waiting(seq, finished, Outcome.CANCELLED)

    def fail_all(self, message: str) -> None:
        """A runner failure: every admitted sequence ends with ERROR, the queue is refused.

        `message` goes to every client, so it must name no request's data."""
        self.is_healthy = False
        for seq in [*self.running, *self.paused]:
            self.finish(seq, FinishReason.ERROR, error=message)
        for seq in list(self.waiting):
            error = EngineUnhealthy(f"The engine failed before this request started: {message}")
            self.reject_waiting(seq, error, Outcome.UNHEALTHY)

    def _record(self, seq: Sequence, outcome: Outcome, now_s: float) -> None:
        self.counters.count_outcome(outcome)
        if self.observer is None:
            return
        try:
            self.observer(_record_of(seq, outcome, now_s))
        except Exception:
            log.exception("the request observer failed; ignoring it")

    # -- statistics ---------------------------------------------------------------------

    def statistics(self, num_lanes: int) -> EngineStatistics:
        c = self.counters
        active = {page for seq in self.running for page in seq.pages}
        num_states = self.count_states()
        return EngineStatistics(
            is_healthy=self.is_healthy,
            num_lanes=num_lanes,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_paused=len(self.paused),
            num_pages_capacity=self.pool.num_pages,
            num_pages_used=self.pool.num_used,
            num_pages_free=self.pool.num_free,
            num_pages_active=len(active),
            host_snapshot_bytes=self.host_snapshot_bytes,
            num_recurrent_states=num_states,
            recurrent_state_bytes=num_states * self.state_nbytes,
            num_steps=c.num_steps,
            num_lookahead_steps=c.num_lookahead_steps,
            num_preemptions=c.num_preemptions,
            num_snapshot_restores=c.num_snapshot_restores,
            num_replay_restores=c.num_replay_restores,
            num_replayed_tokens=c.num_replayed_tokens,
            num_prompt_tokens=c.num_prompt_tokens,
            num_prefill_tokens=c.num_prefill_tokens,
            num_cached_prompt_tokens=c.num_cached_prompt_tokens,
            num_generated_tokens=c.num_generated_tokens,
            requests_by_outcome=dict(c.outcomes),
            step_phase_s=dict(c.phases.seconds),
            **_prefix_fields(self.prefix),
        )


def _prefix_fields(prefix: PrefixCacheHook) -> dict[str, int]:
    cache = prefix.statistics()
    if cache is None:
        return {}
    return {
        "num_prefix_lookups": cache.num_lookups,
        "num_prefix_waits": cache.num_waits,
        "num_prefix_hits": cache.num_hits,
        "num_prefix_demotions": cache.num_demotions,
        "num_prefix_restores": cache.num_restores,
        "num_prefix_evictions": cache.num_evictions,
        "num_prefix_cache_pages": cache.num_device_pages,
        "num_prefix_host_pages": cache.num_host_pages,
        "prefix_host_bytes": cache.host_bytes,
        "num_prefix_checkpoints": cache.num_checkpoints,
        "num_prefix_device_checkpoints": cache.num_device_checkpoints,
        "prefix_checkpoint_bytes": cache.checkpoint_bytes,
    }


def _timings(seq: Sequence, now_s: float) -> Timings:
    total_s = now_s - seq.submitted_s
    queue_s = total_s if seq.first_scheduled_s is None else seq.first_scheduled_s - seq.submitted_s
    ttft_s = seq.token_times_s[0] - seq.submitted_s if seq.token_times_s else total_s
    return Timings(queue_s=queue_s, ttft_s=ttft_s, total_s=total_s)


def _record_of(seq: Sequence, outcome: Outcome, now_s: float) -> RequestRecord:
    times = seq.token_times_s
    return RequestRecord(
        request_id=seq.request.request_id,
        outcome=outcome,
        num_prompt_tokens=seq.num_prompt,
        num_cached_tokens=seq.num_cached_prompt,
        num_generated_tokens=seq.num_output,
        num_pauses=seq.num_pauses,
        queue_s=None if seq.first_scheduled_s is None else seq.first_scheduled_s - seq.submitted_s,
        ttft_s=times[0] - seq.submitted_s if times else None,
        inter_token_s=tuple(b - a for a, b in zip(times, times[1:])),
        total_s=now_s - seq.submitted_s,
    )
