"""Execution lanes: one trio task per lane, serving one admitted request at a time.

A lane holds its request from admission to finish, paused or not. While the request is
resident the lane sits inside a cancel scope, taking each sampled token from the step task,
turning it into events (text, stop strings, grammar, limits) and telling the step task it is
done, so the next step sees the request's new state. Pausing cancels that scope; the lane then
waits, keeping everything it emitted, until the step task resumes (or ends) the request.
"""

from __future__ import annotations

import logging

import trio

from ninfer.gpu.runner import SampledToken
from ninfer.sched.request import FinishReason, TokenDelta, TokenLogprob
from ninfer.sched.sequence import Phase, Sequence
from ninfer.sched.state import EngineState, Ticket

log = logging.getLogger(__name__)


async def run_lane(state: EngineState, assignments: trio.MemoryReceiveChannel, max_context: int):
    """Serve admitted requests, one after another, forever."""
    async for seq in assignments:
        await _serve(state, seq, max_context)


async def _serve(state: EngineState, seq: Sequence, max_context: int) -> None:
    ticket = state.tickets.get(seq.seq_id)
    while ticket is not None and seq.phase is not Phase.FINISHED:
        if seq.phase is Phase.PAUSED:
            await ticket.wake.wait()
            continue
        with trio.CancelScope() as ticket.scope:
            await _consume_tokens(state, seq, ticket, max_context)
        ticket.scope = None


async def _consume_tokens(state: EngineState, seq: Sequence, ticket: Ticket, max_context: int):
    while seq.phase is Phase.RUNNING:
        sampled = await ticket.inbox_receive.receive()
        try:
            accept_token(state, seq, ticket, sampled, max_context)
        except Exception as exc:
            # A bad request (its grammar, say) must not take the others down.
            log.exception("request %s failed while accepting a token", seq.request.request_id)
            state.finish(seq, FinishReason.ERROR, error=f"internal error: {exc}")
        finally:
            state.settle_one()


def accept_token(
    state: EngineState, seq: Sequence, ticket: Ticket, sampled: SampledToken, max_context: int
) -> None:
    """Record one sampled token, emit its delta, and finish the request if it should stop."""
    token_id = int(sampled.token_id)
    seq.token_ids.append(token_id)
    seq.token_times_s.append(trio.current_time())
    state.counters.num_generated_tokens += 1
    if token_id in ticket.stop_ids:
        _finish_with_flush(state, seq, ticket, FinishReason.STOP, stop_token_id=token_id)
        return
    chunk = ticket.text.push(token_id)
    ticket.emit(TokenDelta((token_id,), chunk.text, _logprobs(seq, sampled)))
    if chunk.stop_sequence is not None:
        state.finish(seq, FinishReason.STOP, stop_sequence=chunk.stop_sequence)
        return
    constraint = seq.request.constraint
    if constraint is not None:
        constraint.advance(token_id)
        if constraint.is_finished():
            _finish_with_flush(state, seq, ticket, FinishReason.STOP)
            return
    if seq.num_output >= seq.request.max_tokens or seq.num_tokens >= max_context:
        _finish_with_flush(state, seq, ticket, FinishReason.LENGTH)


def _finish_with_flush(state, seq, ticket: Ticket, reason: FinishReason, **details) -> None:
    """Emit the held-back text (it turned out not to be a stop string), then finish."""
    chunk = ticket.text.finish()
    if chunk.text:
        ticket.emit(TokenDelta((), chunk.text))
    if chunk.stop_sequence is not None:
        reason, details = FinishReason.STOP, {"stop_sequence": chunk.stop_sequence}
    state.finish(seq, reason, **details)


def _logprobs(seq: Sequence, sampled: SampledToken) -> tuple[TokenLogprob, ...] | None:
    if not seq.request.logprobs:
        return None
    top = ()
    if sampled.top_ids is not None and sampled.top_logprobs is not None:
        top = tuple(
            (int(i), float(lp))
            for i, lp in zip(sampled.top_ids[: seq.request.top_logprobs], sampled.top_logprobs)
        )
    return (TokenLogprob(int(sampled.token_id), float(sampled.logprob), top),)
