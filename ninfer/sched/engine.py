"""`open_engine`: the scheduler's public face.

    async with open_engine(config, runner, tokenizer, stop_token_ids=model.stop_token_ids) as engine:
        async with engine.submit(request) as stream:
            async for event in stream:
                ...

The engine owns a nursery with one task per execution lane, the step task (the only user of
the runner) and a deadline task for the queue. `submit` never waits: it queues the request or
raises (`Overloaded`, `RequestTooLarge`, `InvalidRequest`, `EngineUnhealthy`). See
docs/scheduling.md.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import trio

from ninfer.cache.pages import PagePool, pages_for_tokens
from ninfer.cache.prefix import PrefixCache, model_salt
from ninfer.core.runner import Runner, has_checkpoint_slots, recurrent_state
from ninfer.sched.config import EngineConfig
from ninfer.sched.lane import run_lane
from ninfer.sched.output import OutputText
from ninfer.sched.planner import PlanLimits, next_deadline_s
from ninfer.sched.prefix_hook import NoPrefixCache, PrefixCacheHook
from ninfer.sched.request import (
    EngineUnhealthy,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    Overloaded,
    RequestTooLarge,
    ShuttingDown,
)
from ninfer.sched.sequence import Phase, Sequence
from ninfer.sched.state import EngineState, Ticket
from ninfer.sched.stats import EngineStatistics, Outcome, RequestObserver
from ninfer.sched.stepper import Executor, Stepper, expire_waiting
from ninfer.sched.stream import RequestStream

log = logging.getLogger(__name__)

MAX_SEED = (1 << 63) - 1


def resolve_max_context(config: EngineConfig, runner: Runner) -> int:
    """The context limit in effect: the config's, else the model's (`EngineConfig.resolve_max_context`)."""
    return config.resolve_max_context(runner.spec.max_context)


def check_capacity(config: EngineConfig, runner: Runner, max_context: int) -> None:
    """The KV pool must hold one full-length sequence, or the oldest request could starve."""
    if runner.page_size != config.page_size:
        raise ValueError(
            f"The runner's KV pages hold {runner.page_size} tokens but the engine is configured"
            f" for {config.page_size}; build both with the same page size."
        )
    num_tokens = runner.num_pages * runner.page_size
    if runner.num_pages < pages_for_tokens(max_context, runner.page_size):
        raise ValueError(
            f"The KV pool holds {num_tokens} tokens ({runner.num_pages} pages of"
            f" {runner.page_size}), fewer than max_context ({max_context}); give the runner"
            " more pages or lower max_context."
        )
    if config.kv_capacity is not None and num_tokens < config.kv_capacity:
        raise ValueError(
            f"The runner holds {num_tokens} KV tokens but kv_capacity asks for"
            f" {config.kv_capacity}; size the runner with pages_for_tokens(kv_capacity, page_size)."
        )
    # Hybrid models: every running sequence holds one recurrent state (paused ones keep theirs
    # on the host or none), so the runner must hold one per lane.
    recurrent = recurrent_state(runner)
    max_states = None if recurrent is None else recurrent.max_states
    if max_states is not None and max_states < config.max_concurrency:
        raise ValueError(
            f"The runner keeps recurrent state for {max_states} sequences but the engine runs"
            f" {config.max_concurrency} lanes; build the runner with max_sequences >= max_concurrency."
        )


def default_prefix_cache(config: EngineConfig, runner: Runner) -> PrefixCacheHook:
    """The prefix cache `config` asks for: device pages plus a host tier of `host_cache_bytes`.

    Hybrid models: a prefix is reusable only where a checkpoint of the recurrent state after
    it exists (cache/prefix.py); half of `host_cache_bytes` holds those checkpoints, the other
    half the host tier's pages (a runner with checkpoint slots keeps the newest checkpoints in
    them, device memory, and they are demoted to those host bytes as newer ones come). A hybrid
    runner that cannot copy its state gets no cache."""
    if not config.prefix_cache:
        return NoPrefixCache()
    host_bytes, checkpoint_bytes = config.host_cache_bytes, None
    if runner.spec.is_hybrid:
        if recurrent_state(runner) is None:
            return NoPrefixCache()
        checkpoint_bytes = host_bytes // 2
        host_bytes -= checkpoint_bytes
    cache = PrefixCache(
        page_size=runner.page_size,
        page_nbytes=runner.page_nbytes,
        host_budget_bytes=host_bytes,
        checkpoint_budget_bytes=checkpoint_bytes,
        salt=model_salt(runner.spec, type(runner).__name__, config.prefix_salt),
        # Restores and tail copies leave pages of growth to running requests (one per lane,
        # at most an eighth of the pool).
        num_reserved_pages=min(config.max_concurrency, runner.num_pages // 8),
    )
    if has_checkpoint_slots(runner):  # the newest checkpoints stay in the runner's slots
        cache.set_checkpoint_release(runner.release_checkpoint)
    return cache


class Engine:
    """Admission, statistics and the request streams; the tasks run in `open_engine`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer,
        *,
        stop_token_ids: Iterable[int] = (),
        executor: Executor | None = None,
        observer: RequestObserver | None = None,
        prefix_cache: PrefixCacheHook | None = None,
    ):
        self.config = config
        self.runner = runner
        self.max_context = resolve_max_context(config, runner)
        check_capacity(config, runner, self.max_context)
        self._tokenizer = tokenizer
        self._model_stop_ids = frozenset(int(i) for i in stop_token_ids)
        self._executor = executor or trio.to_thread.run_sync
        prefix_cache = prefix_cache or default_prefix_cache(config, runner)
        release_state = getattr(runner, "release_sequence", None)  # runners with recurrent state
        recurrent = recurrent_state(runner)  # hybrid models: the state's size, who holds one
        state_nbytes = 0 if recurrent is None else recurrent.state_nbytes
        count_states = None if recurrent is None else (lambda: recurrent.num_recurrent_states)
        self._state = EngineState(PagePool(runner.num_pages), prefix_cache, observer, release_state,
                                  count_states=count_states, state_nbytes=state_nbytes)  # fmt: skip
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._limits = PlanLimits(
            page_size=config.page_size,
            prefill_chunk=config.prefill_chunk,
            max_prefill_tokens=config.max_prefill_tokens,
            max_concurrency=config.max_concurrency,
            # a hybrid's snapshot holds its recurrent state beside its pages; a hybrid runner
            # that cannot copy its state drops and replays (recomputing the state) instead
            host_snapshot_bytes=0 if runner.spec.is_hybrid and recurrent is None else config.host_snapshot_bytes,
            page_nbytes=runner.page_nbytes,
            state_nbytes=state_nbytes,
        )

    # -- public API ----------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._state.is_healthy

    @property
    def num_running(self) -> int:
        """Requests generating now (admitted, not paused)."""
        return len(self._state.running)

    def statistics(self) -> EngineStatistics:
        return self._state.statistics(self.config.max_concurrency)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request and return its event stream; never waits.

        Raises `EngineUnhealthy` after a runner failure (or once the engine closed),
        `InvalidRequest` for token ids outside the vocabulary, `RequestTooLarge` when it can
        never fit the context, `Overloaded` when `max_pending` requests already wait.
        """
        state = self._state
        try:
            self._check_admissible(request)
        except EngineUnhealthy:
            state.counters.count_outcome(Outcome.UNHEALTHY)
            raise
        except RequestTooLarge:
            state.counters.count_outcome(Outcome.TOO_LARGE)
            raise
        # Requests about to take a free lane do not count against the FIFO's bound.
        num_lanes_free = self._limits.free_lanes(len(state.running) + len(state.paused))
        if len(state.waiting) >= self.config.max_pending + num_lanes_free:
            state.counters.count_outcome(Outcome.OVERLOADED)
            raise Overloaded(
                f"The engine is at capacity: {self.config.max_pending} requests are already"
                " waiting for a lane."
            )
        return self._enqueue(request)

    def drain(self) -> None:
        """Begin a shutdown: refuse new requests and reject the queued ones (`ShuttingDown`);
        admitted requests go on until they finish or `cancel_all`."""
        state = self._state
        state.is_draining = True
        for seq in list(state.waiting):
            state.reject_waiting(seq, ShuttingDown("The server is shutting down."), Outcome.CANCELLED)

    def cancel_all(self) -> None:
        """End every admitted request with CANCELLED (within one step: the runner may be writing
        their pages now)."""
        for seq in [*self._state.running, *self._state.paused]:
            self._cancel(seq)

    # -- admission -----------------------------------------------------------------------

    def _check_admissible(self, request: GenerationRequest) -> None:
        if not self._state.is_healthy:
            raise EngineUnhealthy("The engine is unhealthy after a runner failure.")
        if self._state.is_closed:
            raise EngineUnhealthy("The engine has shut down.")
        if self._state.is_draining:
            raise ShuttingDown("The server is shutting down.")
        num_prompt, limit = len(request.prompt_ids), self.max_context
        if num_prompt >= limit:
            raise RequestTooLarge(
                f"The prompt has {num_prompt} tokens but the context holds {limit},"
                " leaving no room for output."
            )
        if num_prompt + request.max_tokens > limit:
            raise RequestTooLarge(
                f"The prompt ({num_prompt} tokens) plus max_tokens ({request.max_tokens})"
                f" exceeds the context of {limit} tokens; ask for at most"
                f" {limit - num_prompt} tokens."
            )
        vocab_size = self.runner.spec.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
            raise InvalidRequest(
                f"The prompt holds token ids outside the vocabulary (0..{vocab_size - 1})."
            )
        scored = request.score_token_ids
        if scored and (min(scored) < 0 or max(scored) >= vocab_size):
            raise InvalidRequest(f"The score token ids must be in the vocabulary (0..{vocab_size - 1}).")

    def _enqueue(self, request: GenerationRequest) -> RequestStream:
        state = self._state
        seed = request.seed if request.seed is not None else self._rng.randint(0, MAX_SEED)
        seq = Sequence(next(self._seq_ids), request, seed=seed, submitted_s=trio.current_time())
        seq.deadline_s = seq.submitted_s + self.config.pending_timeout_s
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self._model_stop_ids
        ticket = Ticket(OutputText(self._tokenizer.detokenizer(), request.stop), frozenset(stop_ids))
        state.tickets[seq.seq_id] = ticket
        state.waiting.append(seq)
        state.work_changed.notify()
        state.queue_changed.notify()
        return RequestStream(request.request_id, seed, ticket.events_receive, lambda: self._cancel(seq), ticket.ended)

    def _cancel(self, seq: Sequence) -> None:
        state = self._state
        if seq.phase is Phase.WAITING:
            state.cancel_waiting(seq)
        elif seq.phase is not Phase.FINISHED:
            # The runner may be writing its pages right now: the step task frees them
            # between steps (within one step).
            seq.is_cancel_requested = True
            state.work_changed.notify()

    # -- tasks ---------------------------------------------------------------------------

    def _start(self, nursery: trio.Nursery) -> None:
        assign_send, assign_receive = trio.open_memory_channel[Sequence](math.inf)
        for _ in range(self.config.max_concurrency):
            nursery.start_soon(run_lane, self._state, assign_receive)
        lookahead = self.config.lookahead and self.runner.pipelined
        stepper = Stepper(self._state, self.runner, self._executor, self._limits, assign_send,
                          max_context=self.max_context, lookahead=lookahead)  # fmt: skip
        nursery.start_soon(stepper.run)
        nursery.start_soon(self._expire_queue)

    async def _expire_queue(self) -> None:
        """Reject queued requests at their deadline, even while no step is running."""
        state = self._state
        while True:
            with trio.move_on_at(next_deadline_s(state.waiting)):
                await state.queue_changed.wait()
            expire_waiting(state)

    def _close(self) -> None:
        state = self._state
        state.is_closed = True
        for seq in [*state.running, *state.paused]:
            state.finish(seq, FinishReason.CANCELLED)
        for seq in list(state.waiting):
            state.reject_waiting(seq, EngineUnhealthy("The engine has shut down."), Outcome.UNHEALTHY)


@asynccontextmanager
async def open_engine(config: EngineConfig, runner: Runner, tokenizer, **options) -> AsyncIterator[Engine]:
    """Run an engine for the duration of the block.

    `tokenizer` needs `detokenizer()` (-> `push(id) -> str`, `flush() -> str`). `options` are
    `Engine`'s keywords: `stop_token_ids`, the model's end-of-turn ids; `executor(fn, *args)`,
    which runs blocking runner calls (default `trio.to_thread.run_sync`); `observer(record)`,
    called for every request that ends; `prefix_cache`, a hook in place of the one `config`
    describes. The runner is not closed here: its owner closes it.
    """
    engine = Engine(config, runner, tokenizer, **options)
    try:
        async with trio.open_nursery() as nursery:
            engine._start(nursery)
            try:
                yield engine
            finally:
                engine._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Only our own body can raise here (the tasks catch their errors), so hand back the
        # caller's exception as it was raised, not wrapped in a group.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
