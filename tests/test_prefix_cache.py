"""The prefix cache as a data structure: a real `PagePool`, a tiny real `ReferenceRunner`.

Sharing and refcounts, copy-on-write tails, salts, verified hits under forced hash collisions,
read-only requests, multi-turn reuse of generated tokens, LRU reclaim, byte-exact demotion to
the host tier and restore, host-tier LRU eviction, and a property test over random operations
with an exact KV-provenance oracle.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.cache.pages import PagePool, pages_for_tokens
from ninfer.cache.prefix import PrefixCache
from ninfer.core.params import SamplingParams
from ninfer.core.runner import PageSnapshot, SampleSpec, StepRow
from ninfer.gpu.reference import ReferenceRunner
from ninfer.sched.request import GenerationRequest
from ninfer.sched.sequence import Sequence
from tiny_models import tiny_llama

PAGE = 4
VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB)


def make_cache(runner, **kwargs) -> PrefixCache:
    return PrefixCache(page_size=runner.page_size, page_nbytes=runner.page_nbytes, **kwargs)


def make_seq(prompt, *, seq_id=0, cache_salt=None, read_only=False) -> Sequence:
    request = GenerationRequest(
        prompt_ids=tuple(int(t) for t in prompt), max_tokens=8, cache_salt=cache_salt, cache_read_only=read_only
    )
    return Sequence(seq_id, request, seed=seq_id, submitted_s=0.0)


def compute(runner, pool: PagePool, seq: Sequence) -> np.ndarray:
    """Prefill the sequence's uncomputed tokens in one row; returns the logits at its last token."""
    start, end = seq.num_cached, seq.num_tokens
    seq.pages += pool.allocate(pages_for_tokens(end, runner.page_size) - len(seq.pages))
    sample = SampleSpec(params=GREEDY, seed=0, token_index=0, want_logits=True)
    row = StepRow(
        seq_id=seq.seq_id,
        token_ids=np.asarray(seq.token_ids[start:end], dtype=np.int32),
        start_pos=start,
        page_table=np.asarray(seq.pages, dtype=np.int32),
        sample=sample,
    )
    [result] = runner.step([row])
    seq.num_cached = end
    return result.logits


def generate(runner, pool, seq, num_tokens) -> None:
    """Greedy decode: append tokens, computing each one's KV before sampling the next."""
    logits = compute(runner, pool, seq)
    for _ in range(num_tokens):
        seq.token_ids.append(int(np.argmax(logits)))
        logits = compute(runner, pool, seq)
    seq.token_ids.append(int(np.argmax(logits)))  # sampled, its KV never computed


def finish(cache, pool, seq) -> None:
    """What the scheduler does at STOP / LENGTH: publish, then release the sequence's pages."""
    cache.publish(seq, pool)
    pool.release(seq.pages)
    seq.pages = []


def attach(cache, runner, pool, seq) -> None:
    cache.attach(seq, pool)
    cache.run_io(runner, pool)


def check_pool(pool, cache, *holders) -> None:
    pool.check_consistent(holders=[*cache.holders(), *(seq.pages for seq in holders)])
    # the index's device entries (what reclaiming walks) are exactly those holding a page, in LRU order
    index = cache._index
    assert list(index.on_device()) == [entry for entry in index if entry.page_id is not None]


def kv_of(runner, pages) -> PageSnapshot:
    return runner.snapshot_pages(list(pages))


def same_kv(a: PageSnapshot, b: PageSnapshot, num_tokens: int | None = None) -> bool:
    """Byte equality of two snapshots (over the first num_tokens positions when given)."""
    def flat(snap):
        return [x.reshape(x.shape[0], -1, *x.shape[3:])[:, :num_tokens] for x in snap.arrays]

    return all(np.array_equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))


# -- sharing -------------------------------------------------------------------------------


def test_a_published_prompt_is_shared_and_its_tail_copied_on_write(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)
    first = make_seq(range(1, 11), seq_id=0)  # 10 tokens: two full pages and a tail of 2
    compute(runner, pool, first)
    first_pages, first_kv = list(first.pages), kv_of(runner, first.pages)
    finish(cache, pool, first)
    assert [pool.refcount(p) for p in first_pages] == [1, 1, 1]  # held by the cache alone
    assert cache.num_reclaimable_pages() == 3

    second = make_seq([*range(1, 11), 30, 31, 32], seq_id=1)
    attach(cache, runner, pool, second)
    # Full pages are shared; the tail is a private copy, so `second` never writes a shared page.
    assert second.num_cached == second.num_cached_prompt == 10
    assert second.pages[:2] == first_pages[:2] and second.pages[2] not in first_pages
    assert [pool.refcount(p) for p in second.pages] == [2, 2, 1]
    assert same_kv(kv_of(runner, second.pages), first_kv, num_tokens=10)
    assert cache.num_reclaimable_pages() == 1  # the tail's cached page; the shared two are active
    check_pool(pool, cache, second)
    stats = cache.statistics()
    assert (stats.num_lookups, stats.num_hits, stats.num_hit_tokens, stats.num_tail_copies) == (1, 1, 10, 1)


def test_concurrent_sequences_share_the_same_pages(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)
    first = make_seq(range(1, 14))
    compute(runner, pool, first)
    finish(cache, pool, first)
    readers = [make_seq([*range(1, 14), 40 + i], seq_id=i) for i in range(3)]
    for seq in readers:
        attach(cache, runner, pool, seq)
    shared = readers[0].pages[:3]
    assert all(seq.pages[:3] == shared for seq in readers)
    assert [pool.refcount(p) for p in shared] == [4, 4, 4]  # the cache and three readers
    check_pool(pool, cache, *readers)
    for seq in readers:
        pool.release(seq.pages)
        seq.pages = []
    check_pool(pool, cache)
    assert pool.num_used == cache.statistics().num_device_pages  # idle: everything used is cache


def test_the_last_prompt_token_is_always_left_to_compute(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)
    first = make_seq(range(1, 9))  # exactly two full pages
    compute(runner, pool, first)
    finish(cache, pool, first)
    again = make_seq(range(1, 9), seq_id=1)
    attach(cache, runner, pool, again)
    # One shared page, then 3 of the second page's 4 tokens copied into a private page.
    assert again.num_cached == 7 and pool.refcount(again.pages[0]) == 2 and pool.refcount(again.pages[1]) == 1
    short = make_seq([1], seq_id=2)
    attach(cache, runner, pool, short)
    assert (short.num_cached, short.pages) == (0, [])


def test_reused_kv_gives_the_same_next_token_as_computing_it(model):
    runner = ReferenceRunner(model, num_pages=32, page_size=PAGE)
    pool, cache = PagePool(32), make_cache(runner)
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, VOCAB, size=22)]
    first = make_seq(prompt)
    generate(runner, pool, first, 5)
    finish(cache, pool, first)
    fresh = make_seq(first.token_ids, seq_id=1)
    fresh_logits = compute(runner, pool, fresh)
    reused = make_seq(first.token_ids, seq_id=2)
    attach(cache, runner, pool, reused)
    assert reused.num_cached == len(first.token_ids) - 1
    reused_logits = compute(runner, pool, reused)
    assert np.argmax(reused_logits) == np.argmax(fresh_logits)
    np.testing.assert_allclose(reused_logits, fresh_logits, rtol=1e-5, atol=1e-5)


# -- salts, collisions, read-only ----------------------------------------------------------


def test_salts_isolate_tenants_and_models(model):
    runner = ReferenceRunner(model, num_pages=32, page_size=PAGE)
    pool = PagePool(32)
    cache = make_cache(runner, salt="smollm2/chatml")
    tenant_a = make_seq(range(1, 10), cache_salt="tenant-a")
    compute(runner, pool, tenant_a)
    finish(cache, pool, tenant_a)
    hits = {}
    for name, salt in {"same": "tenant-a", "other": "tenant-b", "none": None, "empty": ""}.items():
        seq = make_seq([*range(1, 10), 5], cache_salt=salt)
        attach(cache, runner, pool, seq)
        hits[name] = seq.num_cached
    assert hits == {"same": 9, "other": 0, "none": 0, "empty": 0}


def prefix_hash(tokens) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, "<i8").tobytes(), digest_size=7).digest(), "little")


class ProvenanceStore:
    """Runner stand-in for the KV *contents*: each slot records a hash of the prefix ending there.

    Exact oracle for which prefix a page was computed for; it implements the runner's page
    copies so the cache's restore / copy / snapshot paths move these records like real KV.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.slots = np.full((num_pages, page_size), -1, dtype=np.int64)

    def write(self, pages, tokens, start: int) -> None:
        for pos in range(start, len(tokens)):
            self.slots[pages[pos // self.page_size], pos % self.page_size] = prefix_hash(tokens[: pos + 1])

    def holds(self, pages, tokens, num_tokens: int) -> bool:
        got = [self.slots[pages[p // self.page_size], p % self.page_size] for p in range(num_tokens)]
        return got == [prefix_hash(tokens[: p + 1]) for p in range(num_tokens)]

    def snapshot_pages(self, page_ids):
        return PageSnapshot((self.slots[list(page_ids)].copy(),))

    def restore_pages(self, page_ids, snapshot):
        self.slots[list(page_ids)] = snapshot.arrays[0]

    def copy_pages(self, src_ids, dst_ids):
        self.slots[list(dst_ids)] = self.slots[list(src_ids)]


def store_compute(store, pool, seq) -> None:
    seq.pages += pool.allocate(pages_for_tokens(seq.num_tokens, store.page_size) - len(seq.pages))
    store.write(seq.pages, seq.token_ids, seq.num_cached)
    seq.num_cached = seq.num_tokens


def test_hash_collisions_never_change_what_a_hit_holds():
    # One-byte keys: 256 buckets for hundreds of distinct pages, so collisions are certain.
    pool, store = PagePool(4096), ProvenanceStore(4096, PAGE)
    cache = PrefixCache(page_size=PAGE, page_nbytes=1, key_bytes=1)
    rng = np.random.default_rng(7)
    heads = [rng.integers(1, VOCAB, size=PAGE).tolist() for _ in range(40)]
    num_hit_tokens = 0
    for i in range(300):
        prompt = heads[i % len(heads)] + rng.integers(1, VOCAB, size=int(rng.integers(1, 9))).tolist()
        seq = make_seq(prompt, seq_id=i)
        cache.attach(seq, pool)
        cache.run_io(store, pool)
        assert store.holds(seq.pages, seq.token_ids, seq.num_cached)
        num_hit_tokens += seq.num_cached
        store_compute(store, pool, seq)
        finish(cache, pool, seq)
    assert num_hit_tokens >= 200 * PAGE  # the shared first pages were found despite collisions
    check_pool(pool, cache)


def test_read_only_requests_read_but_publish_nothing(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)
    reader = make_seq(range(1, 10), read_only=True)
    compute(runner, pool, reader)
    finish(cache, pool, reader)
    assert pool.num_used == 0 and cache.statistics().num_published_pages == 0
    writer = make_seq(range(1, 10), seq_id=1)
    compute(runner, pool, writer)
    finish(cache, pool, writer)
    reader = make_seq([*range(1, 10), 11, 12, 13, 14, 15, 16], seq_id=2, read_only=True)
    attach(cache, runner, pool, reader)
    assert reader.num_cached == 9
    compute(runner, pool, reader)
    num_cached_pages = pool.num_used - len(reader.pages) + 2  # two of the reader's pages are shared
    finish(cache, pool, reader)
    assert pool.num_used == num_cached_pages == 3


def test_the_next_turn_reuses_the_generated_answer(model):
    runner = ReferenceRunner(model, num_pages=32, page_size=PAGE)
    pool, cache = PagePool(32), make_cache(runner)
    turn1 = make_seq([3, 1, 4, 1, 5, 9, 2, 6, 5])
    generate(runner, pool, turn1, 6)
    finish(cache, pool, turn1)
    # The next prompt: the whole first turn (prompt + answer), then the new user message.
    turn2 = make_seq([*turn1.token_ids, 7, 7, 8], seq_id=1)
    attach(cache, runner, pool, turn2)
    assert turn2.num_cached == len(turn1.token_ids) - 1  # every computed position of turn 1
    generate(runner, pool, turn2, 3)
    finish(cache, pool, turn2)
    turn3 = make_seq([*turn2.token_ids, 9], seq_id=2)
    attach(cache, runner, pool, turn3)
    assert turn3.num_cached == len(turn2.token_ids) - 1


# -- pressure: reclaim, demotion, restore, eviction ----------------------------------------


def publish_prompts(cache, runner, pool, prompts):
    for i, prompt in enumerate(prompts):
        seq = make_seq(prompt, seq_id=100 + i)
        compute(runner, pool, seq)
        finish(cache, pool, seq)


def test_progress_resumes_after_its_chain_was_evicted(model):
    """A running sequence publishes its pages as they complete, hashing only the new ones; when
    the entries it chained to were evicted meanwhile, it chains its own pages from the root."""
    runner = ReferenceRunner(model, num_pages=24, page_size=PAGE)
    pool, cache = PagePool(24), make_cache(runner)
    prompt = list(range(1, 14))  # three full pages and one token
    running = make_seq(prompt, seq_id=1)
    cache.attach(running, pool)  # a miss: it computes the prompt itself
    compute(runner, pool, running)
    publish_prompts(cache, runner, pool, [prompt])  # another sequence publishes the same pages first
    cache.publish_progress(running, pool)  # finds them: its chain is the other's entries
    cache.reclaim(cache.num_reclaimable_pages(), pool)  # evicts them (only the cache held them)
    running.token_ids += [5, 6, 7, 8]
    compute(runner, pool, running)
    cache.publish_progress(running, pool)
    assert not cache.unreachable()
    hit = cache.lookup([*running.token_ids[:16], 0], None, pool)
    assert hit.num_tokens == 16 and list(hit.page_ids) == running.pages[:4]
    pool.release(hit.page_ids)
    finish(cache, pool, running)
    check_pool(pool, cache)


def test_reclaim_evicts_least_recently_used_leaves_first(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)  # no host tier: reclaim evicts
    a, b = list(range(1, 13)), list(range(21, 33))  # three full pages each
    publish_prompts(cache, runner, pool, [a, b])

    def cached_tokens(prompt):
        hit = cache.lookup([*prompt, 0], None, pool)
        pool.release(hit.page_ids)
        return hit.num_tokens

    assert cached_tokens(a) == 12  # a is now more recent than b
    cache.reclaim(1, pool)
    assert cached_tokens(b) == 8  # b's leaf went first, its prefix still hits; b is now recent
    cache.reclaim(2, pool)
    assert cached_tokens(a) == 4 and cached_tokens(b) == 8
    stats = cache.statistics()
    assert (stats.num_evictions, stats.num_device_pages, pool.num_used) == (3, 3, 3)
    check_pool(pool, cache)


def test_active_pages_are_never_reclaimed(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool, cache = PagePool(16), make_cache(runner)
    publish_prompts(cache, runner, pool, [list(range(1, 13)), list(range(21, 33))])
    reader = make_seq([*range(1, 13), 5])
    attach(cache, runner, pool, reader)
    assert cache.num_reclaimable_pages() == 3
    with pytest.raises(ValueError, match="only 3 were inactive"):
        cache.reclaim(4, pool)
    assert all(pool.refcount(p) >= 1 for p in reader.pages)
    check_pool(pool, cache, reader)


def test_demotion_to_host_and_restore_are_byte_exact(model):
    runner = ReferenceRunner(model, num_pages=12, page_size=PAGE)
    pool = PagePool(12)
    cache = make_cache(runner, host_budget_bytes=8 * runner.page_nbytes)
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, VOCAB, size=14)]  # 3 full + tail 2
    first = make_seq(prompt)
    compute(runner, pool, first)
    original = kv_of(runner, first.pages)
    finish(cache, pool, first)
    follow_up = [*prompt, 9, 8, 7]
    on_device = make_seq(follow_up, seq_id=1)
    attach(cache, runner, pool, on_device)
    logits_on_device = compute(runner, pool, on_device)
    pool.release(on_device.pages)

    cache.reclaim(4, pool)  # every cached page, tail included, goes to host
    cache.run_io(runner, pool)
    stats = cache.statistics()
    assert (stats.num_demotions, stats.num_device_pages, stats.num_host_pages) == (4, 0, 4)
    assert stats.host_bytes == 4 * runner.page_nbytes and pool.num_used == 0
    # Other work overwrites every device page the demoted KV lived in.
    scribble = make_seq(np.random.default_rng(3).integers(1, VOCAB, size=12 * PAGE - 1), seq_id=2)
    compute(runner, pool, scribble)
    pool.release(scribble.pages)

    restored = make_seq(follow_up, seq_id=3)
    cache.attach(restored, pool)
    assert pool.num_used == 4  # three restored full pages and the tail's private copy
    cache.run_io(runner, pool)
    assert restored.num_cached == len(prompt)
    assert same_kv(kv_of(runner, restored.pages), original, num_tokens=len(prompt))
    logits_restored = compute(runner, pool, restored)
    assert np.array_equal(logits_restored, logits_on_device)  # same KV bytes, same step: same bits
    stats = cache.statistics()
    assert (stats.num_restores, stats.num_device_pages, stats.num_host_pages) == (3, 3, 1)
    check_pool(pool, cache, restored)


def test_a_hit_on_a_full_pool_swaps_older_pages_out_to_restore_its_own(model):
    runner = ReferenceRunner(model, num_pages=8, page_size=PAGE)
    pool = PagePool(8)
    cache = make_cache(runner, host_budget_bytes=8 * runner.page_nbytes)
    rng = np.random.default_rng(5)
    a, b = rng.integers(1, VOCAB, size=3 * PAGE).tolist(), rng.integers(1, VOCAB, size=8 * PAGE).tolist()
    kv = {}
    for name, prompt in (("a", a), ("b", b)):
        seq = make_seq(prompt)
        compute(runner, pool, seq)
        kv[name] = kv_of(runner, seq.pages)
        finish(cache, pool, seq)
        if name == "a":
            cache.reclaim(3, pool)  # a -> host, so b can fill the whole pool
            cache.run_io(runner, pool)
    assert pool.num_free == 0 and cache.statistics().num_host_pages == 3

    for name, prompt, num_restored in (("a", a, 3), ("b", b, 3)):
        hit = cache.lookup([*prompt, 0], None, pool)
        # No free page: each restore takes the page of an older inactive entry, snapshotted first.
        cache.run_io(runner, pool)
        assert hit.num_tokens == len(prompt) and pool.num_free == 0
        assert same_kv(kv_of(runner, hit.page_ids), kv[name])
        pool.check_consistent(holders=[*cache.holders(), list(hit.page_ids)])
        pool.release(hit.page_ids)
        stats = cache.statistics()
        assert stats.num_host_pages == 3 and stats.host_bytes == 3 * runner.page_nbytes
    assert cache.statistics().num_restores == 6 and cache.statistics().num_demotions == 9


def test_the_host_tier_keeps_the_most_recent_pages_within_its_budget(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool = PagePool(16)
    cache = make_cache(runner, host_budget_bytes=2 * runner.page_nbytes + runner.page_nbytes // 2)
    prompts = [list(range(10 * i + 1, 10 * i + 1 + PAGE)) for i in range(4)]  # one page each
    publish_prompts(cache, runner, pool, prompts)  # used in order 0, 1, 2, 3
    cache.reclaim(4, pool)
    cache.run_io(runner, pool)
    # Two pages fit the host: the more recent 2 and 3 are demoted, 0 and 1 evicted.
    stats = cache.statistics()
    assert (stats.num_demotions, stats.num_evictions, stats.num_host_pages) == (2, 2, 2)
    assert stats.host_bytes <= stats.host_budget_bytes
    hits = [cache.lookup([*p, 0], None, pool).num_tokens for p in prompts]
    cache.run_io(runner, pool)
    assert hits == [0, 0, PAGE, PAGE] and cache.statistics().num_restores == 2
    # Later pressure: the host evicts its least recent page to take a more recent one.
    publish_prompts(cache, runner, pool, [list(range(60, 60 + PAGE))])  # newest: prompt 4
    pool.release([p for p in range(16) if pool.refcount(p) == 2])  # the lookups' references
    cache.reclaim(1, pool)  # prompt 2's page (the least recent) -> host
    cache.run_io(runner, pool)
    assert cache.statistics().num_host_pages == 1
    cache.reclaim(2, pool)  # prompts 3 and 4 -> host; 2, its least recent page, is evicted for them
    cache.run_io(runner, pool)
    stats = cache.statistics()
    assert (stats.num_host_pages, stats.num_device_pages, stats.num_evictions) == (2, 0, 3)
    hits = [cache.lookup([*p, 0], None, pool).num_tokens for p in [*prompts, list(range(60, 60 + PAGE))]]
    assert hits == [0, 0, 0, PAGE, PAGE]


def test_demotion_skips_more_recent_host_pages_and_evicts_instead(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool = PagePool(16)
    cache = make_cache(runner, host_budget_bytes=runner.page_nbytes)  # room for one page
    old, new = list(range(1, 1 + PAGE)), list(range(31, 31 + PAGE))
    publish_prompts(cache, runner, pool, [old, new])
    cache.reclaim(1, pool)
    cache.run_io(runner, pool)  # old -> host
    hit = cache.lookup([*old, 0], None, pool)  # restores old: now the most recent entry
    cache.run_io(runner, pool)
    pool.release(hit.page_ids)
    cache.reclaim(1, pool)  # new is the least recent device page: demoted, host has room again
    cache.run_io(runner, pool)
    cache.reclaim(1, pool)  # old: more recent than new (on host), so new is evicted for it
    cache.run_io(runner, pool)
    hits = [cache.lookup([*p, 0], None, pool).num_tokens for p in (old, new)]
    assert hits == [PAGE, 0]
    assert cache.statistics().num_evictions == 1


def test_a_page_demoted_while_shared_stays_valid_for_its_holder(model):
    runner = ReferenceRunner(model, num_pages=16, page_size=PAGE)
    pool = PagePool(16)
    cache = make_cache(runner, host_budget_bytes=4 * runner.page_nbytes)
    publish_prompts(cache, runner, pool, [list(range(1, 9))])
    cache.reclaim(2, pool)  # queued, not run yet: the pages are still held by the cache
    assert pool.num_used == 2 and cache.num_reclaimable_pages() == 0
    reader = make_seq([*range(1, 9), 3])
    cache.attach(reader, pool)  # hits the pages mid-demotion
    cache.run_io(runner, pool)
    assert reader.num_cached == 8 and pool.num_used == 2  # the reader's references keep them
    check_pool(pool, cache, reader)
    finish(cache, pool, reader)  # publishing the same KV brings the entries back to the device
    stats = cache.statistics()
    assert (stats.num_device_pages, stats.num_host_pages, stats.host_bytes) == (2, 0, 0)
    check_pool(pool, cache)


# -- the property test ---------------------------------------------------------------------

HEADS = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 6, 6, 6]]  # shared and diverging first pages
TAILS = [[7, 1, 2, 3, 4, 5, 6, 7, 1, 2], [7, 1, 2, 3, 9, 9, 9, 9, 9], [2, 2, 2, 2, 2, 2]]

operation = st.one_of(
    st.tuples(st.just("run"), st.integers(0, 2), st.integers(0, 2), st.integers(1, 10), st.booleans()),
    st.tuples(st.just("reclaim"), st.integers(1, 6)),
    st.tuples(st.just("end"), st.integers(0, 3)),
    st.tuples(st.just("end"), st.integers(0, 3)),
    st.tuples(st.just("extend"), st.integers(0, 3), st.lists(st.integers(1, 7), min_size=1, max_size=5)),
    st.tuples(st.just("progress"), st.integers(0, 3)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=10, max_size=40), host_pages=st.integers(0, 4), salted=st.booleans())
def test_random_operations_keep_every_invariant(ops, host_pages, salted):
    num_pages = 24
    pool, store = PagePool(num_pages), ProvenanceStore(num_pages, PAGE)
    cache = PrefixCache(page_size=PAGE, page_nbytes=PAGE * 8, host_budget_bytes=host_pages * PAGE * 8)
    live: list[Sequence] = []
    for index, op in enumerate(ops):
        if op[0] == "run":  # a new sequence: attach, verify, then compute the rest (or give up)
            _, head, tail, num_tail, read_only = op
            seq = make_seq(HEADS[head] + TAILS[tail][:num_tail], seq_id=index, cache_salt=str(index % 2) if salted else None,
                           read_only=read_only)  # fmt: skip
            cache.attach(seq, pool)
            cache.run_io(store, pool)
            assert store.holds(seq.pages, seq.token_ids, seq.num_cached)
            assert seq.num_cached < seq.num_prompt and all(pool.refcount(p) >= 1 for p in seq.pages)
            num_short = pages_for_tokens(seq.num_tokens, PAGE) - len(seq.pages) - pool.num_free
            if num_short > cache.num_reclaimable_pages():
                cache.detach(seq, pool)  # as the scheduler does for a request it cannot admit
            else:
                cache.reclaim(max(0, num_short), pool)
                cache.run_io(store, pool)
                store_compute(store, pool, seq)
                live.append(seq)
        elif op[0] == "reclaim":
            num = min(op[1], cache.num_reclaimable_pages())
            cache.reclaim(num, pool)
            cache.run_io(store, pool)
        elif op[0] == "end" and live:
            seq = live.pop(op[1] % len(live))
            finish(cache, pool, seq)
        elif op[0] == "extend" and live and pool.num_free >= 2:  # generated tokens
            seq = live[op[1] % len(live)]
            seq.token_ids += op[2]
            store_compute(store, pool, seq)
        elif op[0] == "progress" and live:  # the step task shares a running sequence's full pages
            cache.publish_progress(live[op[1] % len(live)], pool)  # again: only the pages since
        check_pool(pool, cache, *live)
        assert not cache.unreachable()
        stats = cache.statistics()
        assert stats.host_bytes <= stats.host_budget_bytes
        assert stats.num_device_pages + len({p for s in live for p in s.pages}) >= pool.num_used
    for seq in live:
        finish(cache, pool, seq)
    check_pool(pool, cache)
    assert pool.num_used == cache.statistics().num_device_pages  # at idle, every used page is cache
    cache.reclaim(cache.num_reclaimable_pages(), pool)
    cache.run_io(store, pool)
    assert pool.num_used == 0
