"""One request's events: the consumer reads the engine's stream, `EventStream` converts for APIs.

A holder task in the service's nursery submits the request and keeps it (and its place inside
the admission gate) until the engine's work for it ended; the consumer (an HTTP handler)
leaving, or the service shutting down, cancels the holder and with it the request in the engine
(its pages are free within one step). The consumer reads the engine's stream itself: no task
sits between the step task and the handler, so a token costs no task switch of its own, and a
handler that holds its next frame (`FrameTicks`, many streams) is not woken per token at all.
A timeout on the read gives `Idle` keep-alives.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from ninfer.core.usage import Usage
from ninfer.protocols.calls import (
    CallEvent, CallFinished, CallStarted, Idle, LogprobEntry, TextDelta, ToolCallDelta,
)  # fmt: skip
from ninfer.protocols.tool_calls import END_TAG, CallPiece, TextPiece, ToolCallParser
from ninfer.sched.engine import Engine
from ninfer.sched.request import (
    Finished, FinishReason, GenerationRequest, QueueTimeout, Started, TokenDelta,
)  # fmt: skip
from ninfer.sched.stream import RequestStream

log = logging.getLogger(__name__)


class CallObserver(Protocol):
    """Told once per started request how it ended (the server's metrics implement it)."""

    def call_finished(self, outcome: str, finished: Finished | None, inter_token_s: Sequence[float]) -> None:
        """outcome: stop / length / cancelled / error (the engine's reason) or queue_timeout."""


@attrs.define(eq=False)
class CallRecord:
    """One call as its holder task and its `EventStream` share it: the engine's stream, how the
    call ended and the gaps between its tokens as the consumer took them, told to the observer
    once, when the consumer takes the end or leaves."""

    observer: CallObserver | None = None
    on_event: Callable[[object], None] | None = None  # sees each engine event (the dashboard's live figures)
    source: RequestStream | None = None
    outcome: str = "cancelled"
    finished: Finished | None = None
    gaps: list[float] = attrs.Factory(list)
    last_token_s: float | None = None
    is_reported: bool = False

    def observe(self, events: list) -> None:
        """Events taken together: each token's gap is the frame's gap over its tokens."""
        num_tokens = 0
        for event in events:
            if self.on_event is not None:
                self.on_event(event)
            if isinstance(event, TokenDelta):
                num_tokens += len(event.token_ids)
            elif isinstance(event, Finished):
                self.outcome, self.finished = event.reason.value, event
        if num_tokens:
            now = trio.current_time()
            if self.last_token_s is not None:
                self.gaps += [(now - self.last_token_s) / num_tokens] * num_tokens
            self.last_token_s = now

    def fail(self, error: BaseException) -> None:
        self.outcome = "queue_timeout" if isinstance(error, QueueTimeout) else "error"
        self.report()

    def report(self) -> None:
        if not self.is_reported and self.observer is not None:
            self.observer.call_finished(self.outcome, self.finished, self.gaps)
        self.is_reported = True


async def hold_request(engine: Engine, request: GenerationRequest, record: CallRecord, *,
                       task_status=trio.TASK_STATUS_IGNORED):  # fmt: skip
    """Submit `request`, hand its stream to `record`, and hold it until the engine's work for it
    ended (its last events may still wait for the consumer), or the consumer leaves (cancelling
    the scope given to `task_status`), or the service shuts down; those two cancel the request.

    Errors raised before the request is admitted to the queue (Overloaded, RequestTooLarge,
    EngineUnhealthy) propagate out of `nursery.start`; later ones reach the consumer.
    """
    with trio.CancelScope() as scope:
        stream = engine.submit(request)  # never waits: a full queue raises Overloaded at once
        record.source = stream
        try:
            task_status.started(scope)
            await stream.ended.wait()
        finally:
            if not stream.ended.is_set():
                stream.close()  # a consumer still waiting sees the end


class FrameTicks:
    """The frame clock of paced streams (many at once): one timer for all of them, instead of a
    deadline (a cancel scope, a Cancelled raised and caught) per stream per frame. A stream that
    sent a text frame waits for the next tick; the ticks are `gap()` apart while any stream waits."""

    def __init__(self, gap: Callable[[], float]):
        self.gap = gap
        self._lot = trio.lowlevel.ParkingLot()
        self._waited = trio.Event()

    async def next_tick(self) -> None:
        self._waited.set()
        await self._lot.park()

    async def run(self) -> None:
        """(a task of the service's nursery) Tick while any stream waits."""
        while True:
            await self._waited.wait()
            await trio.sleep(self.gap())
            self._waited = trio.Event()  # those woken now wait again for a later tick
            self._lot.unpark_all()


class EventStream:
    """Async iterator (and async context manager) of one call's `CallEvent`s."""

    def __init__(self, record: CallRecord, scope: trio.CancelScope, *, request_id: str, keepalive_s: float,
                 parse_tools: bool, new_call_id: Callable[[], str],
                 describe_token: Callable[[int], tuple[str, bytes]],
                 frame_ticks: FrameTicks | None = None):  # fmt: skip
        self.request_id = request_id
        self._record = record
        self._source = record.source
        self._scope = scope  # the holder's: cancelling it ends the request
        self._keepalive_s = keepalive_s
        self._parser = ToolCallParser() if parse_tools else None
        self._new_call_id = new_call_id
        self._describe_token = describe_token
        self._pending: collections.deque[CallEvent] = collections.deque()
        self._num_calls = 0
        self._is_done = False
        self._frame_ticks = frame_ticks  # paces text frames (many streams)
        self._held = False  # a text frame went out: the next waits for a tick

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> CallEvent:
        while not self._pending:
            if self._is_done:
                raise StopAsyncIteration
            if self._held:
                await self._frame_ticks.next_tick()  # tokens gather meanwhile: one frame for them
                self._held = False
                self._convert(self._source.take_ready())
                continue
            with trio.move_on_after(self._keepalive_s):
                try:
                    events = await self._source.receive_ready()
                except Exception as error:  # the engine's error for this request (after its events)
                    self._is_done = True
                    self._record.fail(error)
                    raise
                if not events:
                    self._end_without_finish()
                self._convert(events)
                continue
            return Idle()
        event = self._pending.popleft()
        if isinstance(event, TextDelta) and self._frame_ticks is not None and not self._is_done:
            self._held = self._frame_ticks.gap() > 0
        return event

    async def aclose(self) -> None:
        """Cancel the request (if still running); the call is told to the observer."""
        self._scope.cancel()
        if not self._is_done:
            self._is_done = True
            self._record.observe(self._source.take_ready())  # a finish that came meanwhile counts
        self._record.report()

    def _end_without_finish(self) -> None:
        # The stream ended without a Finished: the holder left (the service is shutting down).
        self._is_done = True
        self._pending.append(CallFinished("cancelled", Usage(0, 0)))

    def _convert(self, events: list) -> None:
        """Convert events taken together; text a slow reader has not taken yet goes out
        coalesced (`_append` merges adjacent text deltas): one frame, not one each."""
        try:
            self._record.observe(events)
            for item in events:
                if isinstance(item, Started):
                    self._pending.append(CallStarted(self.request_id or item.request_id, item.prompt_tokens, item.cached_tokens))
                elif isinstance(item, TokenDelta):
                    self._add_delta(item)
                elif isinstance(item, Finished):
                    self._add_finish(item)
        except Exception as error:
            log.exception("request %s failed", self.request_id)
            self._is_done = True
            self._record.fail(error)
            raise

    def _add_delta(self, delta: TokenDelta) -> None:
        logprobs = None if delta.logprobs is None else tuple(self._entry(lp) for lp in delta.logprobs)
        if self._parser is None:
            self._append(TextDelta(delta.text, tuple(delta.token_ids), logprobs))
            return
        events = self._from_pieces(self._parser.feed(delta.text))
        for i, event in enumerate(events):
            if isinstance(event, TextDelta):
                events[i] = attrs.evolve(event, token_ids=tuple(delta.token_ids), logprobs=logprobs)
                break
        else:
            events.insert(0, TextDelta("", tuple(delta.token_ids), logprobs))
        for event in events:
            self._append(event)

    def _append(self, event: CallEvent) -> None:
        """Queue an event; text right after text (not yet taken) joins it."""
        last = self._pending[-1] if self._pending else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            logprobs = None
            if last.logprobs is not None or event.logprobs is not None:
                logprobs = (last.logprobs or ()) + (event.logprobs or ())
            self._pending[-1] = TextDelta(last.text + event.text, last.token_ids + event.token_ids, logprobs)
        else:
            self._pending.append(event)

    def _add_finish(self, finished: Finished) -> None:
        if self._parser is not None:
            self._pending.extend(self._from_pieces(self._parser.finish()))
        reason = finished.reason
        name = {FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "error"}.get(reason)
        if name is None:
            name = "tool_calls" if self._num_calls else "stop"
        stop_sequence = None if finished.stop_sequence == END_TAG and self._parser else finished.stop_sequence
        self._pending.append(CallFinished(name, finished.usage, finished.timings, stop_sequence, finished.error))
        self._is_done = True
        self._record.report()

    def _from_pieces(self, pieces) -> list[CallEvent]:
        events: list[CallEvent] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                events.append(TextDelta(piece.text))
            elif isinstance(piece, CallPiece):
                events.append(ToolCallDelta(self._num_calls, self._new_call_id(), piece.name, piece.arguments))
                self._num_calls += 1
        return events

    def _entry(self, lp) -> LogprobEntry:
        text, raw = self._describe_token(lp.token_id)
        top = tuple(LogprobEntry(i, *self._describe_token(i), float(v)) for i, v in lp.top)
        return LogprobEntry(lp.token_id, text, raw, float(lp.logprob), top)
