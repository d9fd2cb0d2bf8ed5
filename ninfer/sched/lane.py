"""Execution lanes: one trio task per lane, holding one admitted request at a time.

A lane holds its request from admission to finish, paused or not: the number of lanes bounds
the requests in flight. While the request is resident the lane sits inside a cancel scope;
pausing cancels that scope, and the lane then waits, keeping everything the request emitted,
until the step task resumes (or ends) the request.

Sampled tokens are accepted by the step task itself, right after the step that sampled them
(`accept_sampled`: text, stop strings, grammar, limits): one pass over the batch, no task
switch per token and no barrier between steps, and the next plan sees every request's new
state. A failure while accepting one request's token ends that request alone.
"""

from __future__ import annotations

import logging

import trio

from ninfer.core.runner import SampledToken
from ninfer.sched.request import FinishReason, TokenDelta, TokenLogprob
from ninfer.sched.sequence import Phase, Sequence
from ninfer.sched.state import EngineState, Ticket

log = logging.getLogger(__name__)


async def run_lane(state: EngineState, assignments: trio.MemoryReceiveChannel):
    """Hold admitted requests, one after another, forever."""
    async for seq in assignments:
        await _hold(state, seq)


async def _hold(state: EngineState, seq: Sequence) -> None:
    ticket = state.tickets.get(seq.seq_id)
    while ticket is not None and seq.phase is not Phase.FINISHED:
        if seq.phase is Phase.PAUSED:
            await ticket.wake.wait()
            continue
        with trio.CancelScope() as ticket.scope:
            await trio.sleep_forever()  # resident until a pause or the finish cancels the scope
        ticket.scope = None


def accept_sampled(state: EngineState, seq: Sequence, sampled: SampledToken, max_context: int) -> None:
    """(the step task) Accept one sampled token; a failure ends this request alone."""
    try:
        accept_token(state, seq, state.tickets[seq.seq_id], sampled, max_context)
    except Exception as exc:
        # A bad request (its grammar, say) must not take the others down.
        log.exception("request %s failed while accepting a token", seq.request.request_id)
        state.finish(seq, FinishReason.ERROR, error=f"internal error: {exc}")


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
    ticket.emit(TokenDelta((token_id,), chunk.text, _logprobs(seq, sampled), sampled.hidden))
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
    scores = () if sampled.score_logprobs is None else tuple(float(lp) for lp in sampled.score_logprobs)
    return (TokenLogprob(int(sampled.token_id), float(sampled.logprob), top, scores),)
