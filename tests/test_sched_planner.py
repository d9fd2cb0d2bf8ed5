"""The sans-IO planner: admission, batching, chunked prefill, pressure, resume — no event loop."""

import pytest

from ninfer.sched.planner import (
    PauseMode,
    PlanLimits,
    PoolState,
    next_deadline_s,
    plan_step,
    split_expired,
)
from ninfer.sched.request import GenerationRequest
from ninfer.sched.sequence import Phase, Sequence

PAGE = 4


def limits(**overrides):
    values = dict(page_size=PAGE, prefill_chunk=8, max_concurrency=4, host_snapshot_bytes=0, page_nbytes=100)
    values.update(overrides)
    return PlanLimits(**values)


def make_seq(seq_id, *, prompt=4, output=0, cached=None, phase=Phase.RUNNING, max_tokens=64):
    """A sequence with `prompt` prompt tokens and `output` emitted ones, `cached` of them in KV."""
    seq = Sequence(seq_id, GenerationRequest(prompt_ids=tuple(range(1, prompt + 1)), max_tokens=max_tokens),
                   seed=seq_id, submitted_s=0.0)  # fmt: skip
    seq.token_ids += [7] * output
    seq.phase = phase
    if cached is None:
        cached = seq.num_tokens - 1 if output else 0
    seq.num_cached = cached
    seq.num_computed_max = cached
    seq.pages = list(range(100 * seq_id, 100 * seq_id + -(-cached // PAGE)))
    return seq


def rows_of(plan):
    return [(row.seq.seq_id, row.num_tokens, row.num_new_pages, row.samples) for row in plan.rows]


def test_idle_when_nothing_to_do():
    plan = plan_step([], [], [], PoolState(num_free_pages=8), limits())
    assert plan.is_idle


def test_admits_in_fifo_order_and_splits_the_prefill_chunk():
    waiting = [make_seq(i, prompt=5, phase=Phase.WAITING) for i in range(3)]
    plan = plan_step([], [], waiting, PoolState(num_free_pages=20), limits())
    assert [s.seq_id for s in plan.admits] == [0, 1, 2]
    # 8 prefill tokens per step: 5 for the first, 3 for the second, none left for the third.
    assert rows_of(plan) == [(0, 5, 2, True), (1, 3, 1, False)]


def test_admission_stops_at_free_lanes():
    running = [make_seq(0, output=1)]
    waiting = [make_seq(i, phase=Phase.WAITING) for i in (1, 2, 3)]
    plan = plan_step(running, [], waiting, PoolState(num_free_pages=50), limits(max_concurrency=2))
    assert [s.seq_id for s in plan.admits] == [1]


def test_every_decode_runs_alongside_a_bounded_prefill():
    decoders = [make_seq(i, prompt=3, output=2) for i in range(3)]  # 4 cached, 1 pending
    long_prompt = make_seq(3, prompt=30)
    plan = plan_step([*decoders, long_prompt], [], [], PoolState(num_free_pages=50), limits())
    # Each decoder writes position 4: a new page. The prefill gets the whole chunk of 8.
    assert rows_of(plan) == [(0, 1, 1, True), (1, 1, 1, True), (2, 1, 1, True), (3, 8, 2, False)]


def test_prefill_shrinks_to_the_free_pages_without_pausing_anyone():
    old = make_seq(0, prompt=20, cached=8)  # prefilling, 2 pages held
    young = make_seq(1, prompt=3, output=2)  # decoding, 1 page held
    plan = plan_step([old, young], [], [], PoolState(num_free_pages=2), limits())
    # The old one can grow by 2 pages (8 tokens); the young decoder then finds no page.
    assert rows_of(plan) == [(0, 8, 2, False)]
    assert plan.pauses == ()


def test_pressure_pauses_the_youngest_first_and_never_for_a_younger_one():
    a = make_seq(0, prompt=3, output=2)  # needs a new page for position 4
    b = make_seq(1, prompt=3, output=2)
    c = make_seq(2, prompt=3, output=2)
    plan = plan_step([a, b, c], [], [], PoolState(num_free_pages=0), limits())
    # a pauses c (the youngest, 1 page), b then pauses nobody older and must skip this step.
    assert [(p.seq.seq_id, p.mode) for p in plan.pauses] == [(2, PauseMode.DROP)]
    assert rows_of(plan) == [(0, 1, 1, True)]
    assert plan.resumes == () and plan.admits == ()


def test_pause_snapshots_within_the_host_budget_then_drops():
    a = make_seq(0, prompt=7, output=2)  # 8 cached = 2 full pages, needs a third
    b = make_seq(1, prompt=3, output=1)  # 3 cached, 1 page
    c = make_seq(2, prompt=3, output=1)
    plan = plan_step([a, b, c], [], [], PoolState(num_free_pages=0),
                     limits(host_snapshot_bytes=150))  # fmt: skip
    assert [(p.seq.seq_id, p.mode) for p in plan.pauses] == [(2, PauseMode.SNAPSHOT)]
    # With the budget used by an earlier snapshot, the same pause drops instead.
    plan = plan_step([a, b, c], [], [], PoolState(num_free_pages=0, host_snapshot_bytes_used=100),
                     limits(host_snapshot_bytes=150))  # fmt: skip
    assert [(p.seq.seq_id, p.mode) for p in plan.pauses] == [(2, PauseMode.DROP)]


def test_inactive_cache_pages_are_reclaimed_before_anyone_pauses():
    a = make_seq(0, prompt=3, output=2)
    b = make_seq(1, prompt=3, output=1)
    plan = plan_step([a, b], [], [], PoolState(num_free_pages=0, num_reclaimable_pages=3), limits())
    assert plan.num_reclaim_pages == 1
    assert plan.pauses == ()
    assert rows_of(plan) == [(0, 1, 1, True), (1, 1, 0, True)]


def test_the_oldest_always_progresses_by_pausing_everyone_younger():
    oldest = make_seq(0, prompt=3, output=2)
    others = [make_seq(i, prompt=2, output=1) for i in (1, 2, 3)]  # 2 cached, 1 page each
    plan = plan_step([oldest, *others], [], [], PoolState(num_free_pages=0), limits())
    assert [p.seq.seq_id for p in plan.pauses] == [3]
    assert rows_of(plan)[0] == (0, 1, 1, True)


def test_resume_in_arrival_order_with_headroom_and_no_admission_meanwhile():
    running = [make_seq(0, prompt=3, output=1)]  # 3 cached, 1 page, next fits
    older = make_seq(1, prompt=6, output=1, phase=Phase.PAUSED)
    older.snapshot, older.num_snapshot_pages = object(), 2  # restores 2 pages
    older.pages = []
    younger = make_seq(2, prompt=6, output=1, phase=Phase.PAUSED, cached=0)
    younger.pages = []
    waiting = [make_seq(3, phase=Phase.WAITING)]
    # 3 free: the snapshot needs its 2 pages plus 1 spare per running sequence (now 1).
    plan = plan_step(running, [older, younger], waiting, PoolState(num_free_pages=3), limits())
    assert [s.seq_id for s in plan.resumes] == [1]
    assert plan.admits == ()
    # Its decode row writes position 6 into the second restored page: no new page.
    assert rows_of(plan) == [(0, 1, 0, True), (1, 1, 0, True)]
    # With one page fewer, nobody resumes, and the younger one never jumps the queue.
    plan = plan_step(running, [older, younger], waiting, PoolState(num_free_pages=2), limits())
    assert plan.resumes == () and plan.admits == ()


def test_replay_resume_prefills_prompt_and_emitted_tokens():
    dropped = make_seq(0, prompt=6, output=3, phase=Phase.PAUSED, cached=0)
    dropped.pages = []
    plan = plan_step([], [dropped], [], PoolState(num_free_pages=10), limits())
    assert [s.seq_id for s in plan.resumes] == [0]
    # 9 known tokens, chunk 8: no sample until the last known token is fed.
    assert rows_of(plan) == [(0, 8, 2, False)]


def test_a_pause_step_resumes_and_admits_nobody():
    a = make_seq(0, prompt=3, output=2)
    b = make_seq(1, prompt=3, output=2)
    waiting = [make_seq(2, phase=Phase.WAITING)]
    plan = plan_step([a, b], [], waiting, PoolState(num_free_pages=0), limits())
    assert [p.seq.seq_id for p in plan.pauses] == [1]
    assert plan.admits == ()


def test_deadlines():
    seqs = [make_seq(i, phase=Phase.WAITING) for i in range(3)]
    for seq, deadline in zip(seqs, (5.0, 2.0, 9.0)):
        seq.deadline_s = deadline
    assert next_deadline_s(seqs) == 2.0
    keep, expired = split_expired(seqs, 5.0)
    assert [s.seq_id for s in keep] == [2] and [s.seq_id for s in expired] == [0, 1]
    assert next_deadline_s([]) == float("inf")


# -- the burst budget ----------------------------------------------------------------------


def test_a_burst_of_short_prefills_is_planned_in_one_step_up_to_the_cap():
    # Six 5-token prompts with chunks of 8: 30 tokens, more than two chunks, so a burst.
    waiting = [make_seq(i, prompt=5, phase=Phase.WAITING) for i in range(6)]
    plan = plan_step([], [], waiting, PoolState(num_free_pages=40), limits(max_concurrency=8))
    assert [s.seq_id for s in plan.admits] == list(range(6))
    assert rows_of(plan) == [(i, 5, 2, True) for i in range(6)]  # the default cap: 8 chunks
    # A cap of 24 tokens: rows in FIFO order until it is spent.
    plan = plan_step([], [], waiting, PoolState(num_free_pages=40), limits(max_concurrency=8, max_prefill_tokens=24))
    assert rows_of(plan) == [(0, 5, 2, True), (1, 5, 2, True), (2, 5, 2, True), (3, 5, 2, True), (4, 4, 1, False)]
    # Without the burst (two chunks or less of short work) the step keeps one chunk.
    plan = plan_step([], [], waiting[:3], PoolState(num_free_pages=40), limits(max_concurrency=8))
    assert rows_of(plan) == [(0, 5, 2, True), (1, 3, 1, False)]


def test_in_a_burst_an_older_long_prefill_keeps_its_chunk_and_goes_first():
    long_prompt = make_seq(0, prompt=30)
    waiting = [make_seq(i, prompt=4, phase=Phase.WAITING) for i in range(1, 6)]
    plan = plan_step([long_prompt], [], waiting, PoolState(num_free_pages=40), limits(max_concurrency=8))
    # 8 for the long prompt (never more than a chunk a row), then 4 for each short one.
    assert rows_of(plan) == [(0, 8, 2, False), *((i, 4, 1, True) for i in range(1, 6))]
    plan = plan_step([long_prompt], [], waiting, PoolState(num_free_pages=40),
                     limits(max_concurrency=8, max_prefill_tokens=12))  # fmt: skip
    assert rows_of(plan) == [(0, 8, 2, False), (1, 4, 1, True)]


def test_a_prefill_others_wait_for_gets_a_chunk_per_waiter():
    owner = make_seq(0, prompt=40)
    owner.num_waiters = 2
    plan = plan_step([owner], [], [], PoolState(num_free_pages=40), limits())
    assert rows_of(plan) == [(0, 24, 6, False)]  # its chunk and one for each waiter
    plan = plan_step([owner], [], [], PoolState(num_free_pages=40), limits(max_prefill_tokens=16))
    assert rows_of(plan) == [(0, 16, 4, False)]
    owner.num_waiters = 0
    assert rows_of(plan_step([owner], [], [], PoolState(num_free_pages=40), limits())) == [(0, 8, 2, False)]


def test_the_burst_cap_is_checked():
    from ninfer.sched.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig(prefill_chunk=512, max_prefill_tokens=256)
    assert limits(prefill_chunk=8).max_step_prefill == 64
    assert limits(prefill_chunk=8, max_prefill_tokens=100).max_step_prefill == 100
