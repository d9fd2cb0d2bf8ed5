"""`RequestStream`: what `engine.submit` returns to its caller."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import trio

from ninfer.sched.request import EngineError, Event, Finished, Started, TokenDelta, TokenLogprob


@attrs.frozen
class Completion:
    """A whole generation, as `RequestStream.collect()` gathers it."""

    started: Started
    token_ids: tuple[int, ...]
    text: str
    finished: Finished
    logprobs: tuple[TokenLogprob, ...] | None = None
    hidden: np.ndarray | None = attrs.field(default=None, eq=False)  # the first sampled position's (want_hidden)


class RequestStream:
    """The events of one request: `Started`, `TokenDelta`..., then exactly one `Finished`.

    Use it as `async with engine.submit(request) as stream: async for event in stream: ...`.
    Leaving the block, calling `aclose()`, or cancelling the task that iterates cancels the
    request. A request that never starts raises its `EngineError` (`QueueTimeout`,
    `EngineUnhealthy`) from the iterator instead of yielding `Started`.
    """

    def __init__(
        self,
        request_id: str,
        seed: int,
        receive: trio.MemoryReceiveChannel,
        cancel: Callable[[], None],
        ended: trio.Event | None = None,
    ):
        self.request_id = request_id
        self.seed = seed  # the request's seed, or the one drawn for it at submission
        self.ended = trio.Event() if ended is None else ended  # set by the engine once its last event went out
        self._receive = receive
        self._cancel = cancel
        self._is_done = False
        self._error: EngineError | None = None  # met by take_ready, raised by the next __anext__

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        self._raise_held_error()
        if self._is_done:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._is_done = True
            raise StopAsyncIteration from None
        except trio.Cancelled:
            self.cancel()
            raise
        if isinstance(item, EngineError):
            self._is_done = True
            raise item
        if isinstance(item, Finished):
            self._is_done = True
        return item

    def take_ready(self) -> list[Event]:
        """The events already waiting, without a checkpoint (a reader that fell behind takes
        them in one go). An `EngineError` among them is raised by the next `__anext__` (or
        `receive_ready`)."""
        ready: list[Event] = []
        while not self._is_done and self._error is None:
            try:
                item = self._receive.receive_nowait()
            except trio.WouldBlock:
                break
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self._is_done = True
                break
            self._take(item, ready)
        return ready

    async def receive_ready(self) -> list[Event]:
        """Wait for the next events and take every one waiting; [] once the stream ended.

        Unlike iterating, a cancelled wait leaves the request running and loses nothing (a
        reader may wait under a timeout). An `EngineError` is raised once the events before it
        were taken."""
        self._raise_held_error()
        if self._is_done:
            return []
        try:
            item = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._is_done = True
            return []
        ready: list[Event] = []
        self._take(item, ready)
        if not ready:  # the error came first
            return await self.receive_ready()
        return ready + self.take_ready()

    def _raise_held_error(self) -> None:
        """Raise the error `take_ready` met (the events before it were taken), once."""
        if self._error is not None:
            error, self._error = self._error, None
            self._is_done = True
            raise error

    def _take(self, item: Event | EngineError, ready: list[Event]) -> None:
        if isinstance(item, EngineError):
            self._error = item
            return
        ready.append(item)
        if isinstance(item, Finished):
            self._is_done = True

    def cancel(self) -> None:
        """Cancel the request (no-op once it finished); its pages are free within one step."""
        if not self._is_done:
            self._is_done = True
            self._cancel()

    def close(self) -> None:
        """Cancel the request and drop its events (a reader waiting for them sees the end)."""
        self.cancel()
        self._receive.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        """Iterate to the end and gather the ids, text and logprobs."""
        started, finished = None, None
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        hidden = None
        async for event in self:
            if isinstance(event, Started):
                started = event
            elif isinstance(event, TokenDelta):
                token_ids += event.token_ids
                text.append(event.text)
                logprobs += event.logprobs or ()
                if hidden is None:
                    hidden = event.hidden
            else:
                finished = event
        assert started is not None and finished is not None
        return Completion(started, tuple(token_ids), "".join(text), finished, tuple(logprobs) or None, hidden)
