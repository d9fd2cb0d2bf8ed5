"""One request's events: a pump task reads the engine stream, `EventStream` converts for APIs.

The pump runs in the service's nursery and forwards engine events into a memory channel; the
consumer (an HTTP handler) reads the channel with a timeout to produce `Idle` keep-alives.
Closing the `EventStream` cancels the pump, whose exit from the engine stream cancels the
request in the engine (its pages are freed within one step).
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
    EngineError, Finished, FinishReason, GenerationRequest, QueueTimeout, Started, TokenDelta,
)  # fmt: skip

log = logging.getLogger(__name__)


class CallObserver(Protocol):
    """Told once per started request how it ended (the server's metrics implement it)."""

    def call_finished(self, outcome: str, finished: Finished | None, inter_token_s: Sequence[float]) -> None:
        """outcome: stop / length / cancelled / error (the engine's reason) or queue_timeout."""


@attrs.frozen
class _Failure:
    error: BaseException


async def pump_events(engine: Engine, request: GenerationRequest, send, observer: CallObserver | None, *,
                      on_event: Callable[[object], None] | None = None,
                      task_status=trio.TASK_STATUS_IGNORED):  # fmt: skip
    """Submit `request` and forward its events to `send` until it finishes or is cancelled;
    `on_event(event)` sees each engine event first (the dashboard's live figures).

    Errors raised before the request is admitted to the queue (Overloaded, RequestTooLarge,
    EngineUnhealthy) propagate out of `nursery.start`; later ones go down the channel.
    """
    started, outcome, finished, gaps = False, "cancelled", None, []
    with trio.CancelScope() as scope:
        async with send:  # closed last, after any failure below went down it
            try:
                stream = engine.submit(request)  # never waits: a full queue raises Overloaded at once
                async with stream as events:
                    task_status.started(scope)
                    started = True
                    outcome, finished = await _forward(events, send, gaps, on_event)
            except trio.BrokenResourceError:
                pass  # the consumer left; leaving the engine stream above cancelled the request
            except EngineError as e:
                if not started:
                    raise
                outcome = "queue_timeout" if isinstance(e, QueueTimeout) else "error"
                _send_failure(send, e)
            except Exception as e:
                if not started:
                    raise
                log.exception("request %s failed", request.request_id)
                outcome = "error"
                _send_failure(send, e)
            finally:
                if started and observer is not None:
                    observer.call_finished(outcome, finished, gaps)


async def _forward(events, send, gaps: list[float], on_event=None) -> tuple[str, Finished | None]:
    """Forward the engine's events; whatever is already waiting goes in one go (one task switch
    per batch, not per token), and the channel is unbounded as the engine's own is."""
    last_token_s = None
    async for first in events:
        for event in (first, *events.take_ready()):
            if on_event is not None:
                on_event(event)
            if isinstance(event, TokenDelta) and event.token_ids:
                now = trio.current_time()
                if last_token_s is not None:
                    gaps.append((now - last_token_s) / len(event.token_ids))
                last_token_s = now
            send.send_nowait(event)
            if isinstance(event, Finished):
                return event.reason.value, event
    return "cancelled", None


def _send_failure(send, error: BaseException) -> None:
    try:
        send.send_nowait(_Failure(error))
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass


class EventStream:
    """Async iterator (and async context manager) of one call's `CallEvent`s."""

    def __init__(self, receive, scope: trio.CancelScope, *, request_id: str, keepalive_s: float,
                 parse_tools: bool, new_call_id: Callable[[], str],
                 describe_token: Callable[[int], tuple[str, bytes]],
                 frame_gap: Callable[[], float] | None = None):  # fmt: skip
        self.request_id = request_id
        self._receive = receive
        self._scope = scope
        self._keepalive_s = keepalive_s
        self._parser = ToolCallParser() if parse_tools else None
        self._new_call_id = new_call_id
        self._describe_token = describe_token
        self._pending: collections.deque[CallEvent] = collections.deque()
        self._num_calls = 0
        self._is_done = False
        self._failure: _Failure | None = None  # raised once the events before it are taken
        self._frame_gap = frame_gap  # seconds to hold text after a text frame (many streams)
        self._hold_until_s = 0.0

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> CallEvent:
        while not self._pending:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure.error
            if self._is_done:
                raise StopAsyncIteration
            if self._hold_until_s > trio.current_time():
                await trio.sleep_until(self._hold_until_s)  # tokens gather meanwhile: one frame for them
                self._hold_until_s = 0.0
                self._take_ready()
                continue
            with trio.move_on_after(self._keepalive_s):
                try:
                    item = await self._receive.receive()
                except trio.EndOfChannel:
                    self._end_without_finish()
                    continue
                self._convert(item)
                self._take_ready()
                continue
            return Idle()
        event = self._pending.popleft()
        if isinstance(event, TextDelta) and self._frame_gap is not None and not self._is_done:
            gap = self._frame_gap()
            if gap > 0:
                self._hold_until_s = trio.current_time() + gap
        return event

    def _take_ready(self) -> None:
        """Convert every event already waiting, so that text a slow reader has not taken yet
        goes out coalesced (`_append` merges adjacent text deltas): one frame, not one each."""
        while not self._is_done:
            try:
                item = self._receive.receive_nowait()
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                self._end_without_finish()
                return
            self._convert(item)

    async def aclose(self) -> None:
        """Cancel the request (if still running) and release the channel."""
        self._scope.cancel()
        self._receive.close()
        self._is_done = True

    def _end_without_finish(self) -> None:
        # The pump stopped without a Finished: the service is shutting down.
        self._is_done = True
        self._pending.append(CallFinished("cancelled", Usage(0, 0)))

    def _convert(self, item) -> None:
        if isinstance(item, _Failure):
            self._is_done = True
            self._failure = item
            return
        if isinstance(item, Started):
            self._pending.append(CallStarted(self.request_id or item.request_id, item.prompt_tokens, item.cached_tokens))
        elif isinstance(item, TokenDelta):
            self._add_delta(item)
        elif isinstance(item, Finished):
            self._add_finish(item)

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
