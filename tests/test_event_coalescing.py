"""A reader that falls behind gets the tokens it has not taken coalesced: nothing lost, nothing
duplicated, order kept. Real model (SmolLM2 on the reference backend), real engine and service."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from ninfer.protocols.calls import CallFinished, CallStarted, CompletionCall, SamplingOptions, TextDelta
from ninfer.runtime import RuntimeOptions, open_runtime
from ninfer.sched.config import EngineConfig
from ninfer.server.service import collect, open_service

CALL = CompletionCall(prompt="Once upon a time, in a small village,", max_tokens=12, ignore_eos=True,
                      sampling=SamplingOptions(temperature=0.0), logprobs=True, top_logprobs=1)  # fmt: skip


async def _events(stream) -> list:
    events = []
    async with stream:
        async for event in stream:
            events.append(event)
    return events


async def test_a_reader_that_falls_behind_gets_one_coalesced_frame(smollm2):
    config = EngineConfig(max_context=128, kv_capacity=512, max_concurrency=2)
    async with open_runtime(smollm2, RuntimeOptions(backend="reference"), config) as (engine, _, _):
        async with open_service(engine, smollm2, max_context=128) as service:
            prompt_reader = await collect(await service.start_completion(CALL))

            slow = await service.start_completion(CALL)
            while engine.statistics().num_generated_tokens < 2 * CALL.max_tokens:
                await trio.sleep(0.02)  # the whole answer is generated before the reader looks
            await trio.testing.wait_all_tasks_blocked()
            # the engine's work ended: the request no longer counts inside the admission gate
            # (quiesce waits for engine work, not for readers), yet nothing it emitted is lost
            assert service.gate.num_inside == 0
            events = await _events(slow)

    assert [type(e) for e in events] == [CallStarted, TextDelta, CallFinished]
    [delta] = [e for e in events if isinstance(e, TextDelta)]
    assert delta.text == prompt_reader.text
    assert delta.token_ids == prompt_reader.token_ids and len(delta.token_ids) == CALL.max_tokens
    assert [lp.token_id for lp in delta.logprobs] == list(prompt_reader.token_ids)
    # (the second run reads the prompt from the prefix cache: the same values up to rounding)
    assert [lp.logprob for lp in delta.logprobs] == pytest.approx([lp.logprob for lp in prompt_reader.logprobs], abs=1e-4)
    assert events[-1].usage.completion_tokens == CALL.max_tokens


async def test_a_prompt_reader_sees_the_same_tokens_in_order(smollm2):
    """Read as they come (frames of any size): the frames join to the same answer, once each."""
    config = EngineConfig(max_context=128, kv_capacity=512, max_concurrency=2)
    async with open_runtime(smollm2, RuntimeOptions(backend="reference"), config) as (engine, _, _):
        async with open_service(engine, smollm2, max_context=128) as service:
            whole = await collect(await service.start_completion(CALL))
            events = await _events(await service.start_completion(CALL))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == whole.text
    assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
    assert sum(len(d.logprobs) for d in deltas) == CALL.max_tokens


async def test_paced_frames_gather_the_tokens_of_the_gap(autojump_clock):
    """With a frame gap (many streams), a token every ms and a 5 ms gap: the first token goes
    alone at once, later frames carry the tokens of their gap, in order, none lost or repeated."""
    from ninfer.core.usage import Timings, Usage
    from ninfer.sched.request import Finished, FinishReason, Started, TokenDelta
    from ninfer.sched.stream import RequestStream
    from ninfer.server.event_stream import CallRecord, EventStream, FrameTicks

    send, receive = trio.open_memory_channel(math.inf)
    record = CallRecord(source=RequestStream("r", 0, receive, cancel=lambda: None))
    ticks = FrameTicks(lambda: 0.005)
    stream = EventStream(record, trio.CancelScope(), request_id="r", keepalive_s=60, parse_tools=False,
                         new_call_id=lambda: "c", describe_token=lambda t: (str(t), b""), frame_ticks=ticks)  # fmt: skip

    async def produce():
        send.send_nowait(Started("r", 3, 0))
        for i in range(40):
            await trio.sleep(0.001)
            send.send_nowait(TokenDelta((i,), f"<{i}>"))
        send.send_nowait(Finished(FinishReason.LENGTH, Usage(3, 40), Timings(0, 0, 0)))

    frames = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        nursery.start_soon(ticks.run)
        async for event in stream:
            frames.append((trio.current_time(), event))
        nursery.cancel_scope.cancel()
    deltas = [e for _, e in frames if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == "".join(f"<{i}>" for i in range(40))
    assert [t for d in deltas for t in d.token_ids] == list(range(40))
    assert len(deltas[0].token_ids) == 1  # the first token is not held
    assert all(4 <= len(d.token_ids) <= 6 for d in deltas[1:-1])  # ~5 ms of tokens a frame
    assert isinstance(frames[-1][1], CallFinished)
    assert record.is_reported and record.outcome == "length"
    # a gap for every token after the first: each frame's gap over its tokens (~5 ms / ~5 tokens)
    assert len(record.gaps) == 39 and all(g == pytest.approx(0.001, rel=0.25) for g in record.gaps[1:])
