"""The prefix cache: computed KV pages reused across requests, on a device and a host tier.

It implements the scheduler's `PrefixCacheHook` (`ninfer/sched/prefix_hook.py`):

- `publish` keeps the full pages of a finished sequence (prompt *and* generated tokens, so the
  next turn of a chat hits the previous answer) and its partially filled tail page, by taking
  one reference on each in the page pool. Read-only requests (`cache_read_only`) publish nothing.
- `attach` gives a new sequence the longest cached prefix of its prompt: shared full pages
  (one more reference each) and, where the prompt continues into a cached page only part way,
  a private copy of that page (copy-on-write), so no sequence ever writes into a shared page.
  At least the last prompt token is always left to compute: its logits give the first sample.
- `publish_progress` shares a running sequence's full pages as soon as they are computed, so
  a request arriving meanwhile reuses a prefill still in progress.
- Pages only the cache holds are *inactive*. Under pressure `reclaim` demotes the least
  recently used of them to a bounded host tier or evicts them; a later hit restores a host
  entry (`ninfer/cache/tiers.py`). The host tier evicts least recently used first.
- `detach` undoes an `attach` for a request the scheduler could not admit this step.

Every KV copy this needs is queued in a `CacheIO` batch (see `host_tier.py`): the owner of the
runner calls `take_io()`, runs the batch off the event loop and hands the result back to
`complete_io()`, after `attach` and after `reclaim`, before the next forward pass.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.cache.host_tier import CacheIO, HostTier
from ninfer.cache.pages import PagePool
from ninfer.cache.prefix_index import DEFAULT_KEY_BYTES, CacheEntry, PrefixIndex, Tier
from ninfer.cache.prefix_index import salt_bytes, token_bytes
from ninfer.cache.tiers import Tiers
from ninfer.core.runner import PageSnapshot, Runner


@attrs.frozen(kw_only=True)
class PrefixCacheStatistics:
    """Counters (only grow) and gauges of one prefix cache."""

    num_lookups: int  # prompts looked up (of admitted requests)
    num_hits: int  # lookups that reused at least one token
    num_hit_tokens: int  # prompt tokens served from the cache
    num_published_pages: int  # pages the cache took from sequences
    num_tail_copies: int  # partially reused pages copied on write
    num_demotions: int  # pages moved device -> host
    num_restores: int  # host entries moved back onto the device by a hit
    num_evictions: int  # entries dropped (from either tier)
    num_device_pages: int  # pool pages the cache holds now
    num_host_pages: int  # snapshots on the host tier now
    host_bytes: int  # bytes of those snapshots
    host_budget_bytes: int


@attrs.frozen
class Hit:
    """What a lookup reused: pages for positions 0 .. num_tokens - 1, now held by the caller."""

    page_ids: tuple[int, ...]
    num_tokens: int


class PrefixCache:
    """`PrefixCacheHook` with device / host retention and LRU eviction."""

    def __init__(
        self,
        *,
        page_size: int,
        page_nbytes: int,
        host_budget_bytes: int = 0,
        salt: bytes | str = b"",
        num_reserved_pages: int = 0,
        key_bytes: int = DEFAULT_KEY_BYTES,
    ):
        """`salt` names the model (KV from another model must never match).

        `num_reserved_pages`: free pages a hit must leave when it allocates (a restore or a tail
        copy), so cache traffic never takes the last pages running sequences grow into.
        """
        self.page_size = page_size
        self._salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self._index = PrefixIndex(page_size, key_bytes=key_bytes)
        self._host = HostTier(host_budget_bytes, page_nbytes)
        self._tiers = Tiers(self._index, self._host, num_reserved_pages=num_reserved_pages)
        self._counts = dict.fromkeys(("lookups", "hits", "hit_tokens", "published_pages", "tail_copies"), 0)

    # -- the scheduler's hook ------------------------------------------------------------

    def attach(self, seq, pool: PagePool) -> None:
        """Give a waiting sequence its cached prefix (sets pages, num_cached, num_cached_prompt)."""
        if seq.pages or seq.num_cached:
            raise ValueError(f"sequence {seq.seq_id} already holds KV; attach it before it runs")
        hit = self.lookup(seq.token_ids[: seq.num_prompt], seq.request.cache_salt, pool)
        seq.pages = list(hit.page_ids)
        seq.num_cached = seq.num_cached_prompt = hit.num_tokens

    def detach(self, seq, pool: PagePool) -> None:
        """Undo `attach` for a sequence that stays queued (its lookup is not counted)."""
        pool.release(seq.pages)
        self._count(lookups=-1, hits=-int(seq.num_cached_prompt > 0), hit_tokens=-seq.num_cached_prompt)
        seq.pages = []
        seq.num_cached = seq.num_cached_prompt = 0

    def publish(self, seq, pool: PagePool) -> None:
        """Keep a finished sequence's computed pages (before it releases them)."""
        if not seq.request.cache_read_only:
            self.insert(seq.token_ids[: seq.num_cached], seq.pages, seq.request.cache_salt, pool)

    def publish_progress(self, seq, pool: PagePool) -> None:
        """Share a running sequence's completed full pages now (its tail page is still written)."""
        if not seq.request.cache_read_only:
            num_full_tokens = seq.num_cached // self.page_size * self.page_size
            self.insert(seq.token_ids[:num_full_tokens], seq.pages, seq.request.cache_salt, pool)

    def num_reclaimable_pages(self) -> int:
        """Pages held only by the cache, which `reclaim` may free."""
        return self._tiers.num_reclaimable()

    def reclaim(self, num_pages: int, pool: PagePool) -> None:
        """Free `num_pages` inactive pages, least recently used first: demoted or evicted.

        Evicted pages are free on return; demoted ones once `complete_io` ran their snapshots.
        """
        self._tiers.bind(pool)
        self._tiers.reclaim(num_pages)

    # -- the KV copies -------------------------------------------------------------------

    def take_io(self) -> CacheIO:
        """The copies queued since the last call (possibly empty); run them, then `complete_io`."""
        return self._tiers.take_io()

    def complete_io(self, io: CacheIO, snapshots: list[PageSnapshot], pool: PagePool) -> None:
        """Finish a batch after `io.run(runner)` returned `snapshots`: store them, free the pages."""
        self._tiers.bind(pool)
        self._tiers.complete_io(io, snapshots)

    def run_io(self, runner: Runner, pool: PagePool) -> None:
        """Run the queued copies here, blocking (tests, and drivers without an event loop)."""
        io = self.take_io()
        if io:
            self.complete_io(io, io.run(runner), pool)

    # -- lookups and inserts -------------------------------------------------------------

    def lookup(self, prompt_ids, cache_salt: str | None, pool: PagePool) -> Hit:
        """Hold the longest cached prefix of the prompt for a new holder (who releases the pages)."""
        self._tiers.bind(pool)
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        salt = salt_bytes(self._salt, cache_salt)
        max_tokens = len(prompt) - 1  # the last prompt token is computed: it yields the first sample
        chain = self._index.walk(salt, prompt, max_tokens // self.page_size)
        # Touch first: a restore that must free a page takes it from strictly older entries.
        self._index.touch(chain)
        floor = chain[-1].last_used if chain else None
        held = 0
        for entry in chain:
            if entry.tier is Tier.HOST and not self._tiers.restore(entry, floor):
                break
            pool.retain([entry.page_id])
            held += 1
        page_ids = [entry.page_id for entry in chain[:held]]
        num_tokens = held * self.page_size
        tail = self._copy_tail(chain[:held], salt, prompt[num_tokens:max_tokens])
        if tail is not None:
            page_ids.append(tail[0])
            num_tokens += tail[1]
        self._count(lookups=1, hits=int(num_tokens > 0), hit_tokens=num_tokens)
        return Hit(tuple(page_ids), num_tokens)

    def insert(self, token_ids, page_ids, cache_salt: str | None, pool: PagePool) -> None:
        """Take a reference on the pages holding `token_ids`' KV (full pages, then a partial tail)."""
        self._tiers.bind(pool)
        tokens = np.asarray(token_ids, dtype=np.int64)
        salt = salt_bytes(self._salt, cache_salt)
        num_full = min(len(tokens) // self.page_size, len(page_ids))
        chain: list[CacheEntry] = []
        parent = None
        for i in range(num_full):
            page_tokens = tokens[i * self.page_size : (i + 1) * self.page_size]
            parent = self._keep(parent, salt, token_bytes(page_tokens), page_ids[i])
            if parent is None:
                break  # a hash collision holds this key: the rest cannot be found either
            chain.append(parent)
        else:
            tail_tokens = tokens[num_full * self.page_size :]
            if tail_tokens.size and num_full < len(page_ids):
                tail = self._keep_tail(parent, salt, tail_tokens, page_ids[num_full])
                chain += [tail] if tail is not None else []
        self._index.touch(chain)

    # -- introspection -------------------------------------------------------------------

    def statistics(self) -> PrefixCacheStatistics:
        c, tiers = self._counts, self._tiers
        return PrefixCacheStatistics(
            num_lookups=c["lookups"],
            num_hits=c["hits"],
            num_hit_tokens=c["hit_tokens"],
            num_published_pages=c["published_pages"],
            num_tail_copies=c["tail_copies"],
            num_demotions=tiers.num_demotions,
            num_restores=tiers.num_restores,
            num_evictions=tiers.num_evictions,
            num_device_pages=tiers.num_device_pages(),
            num_host_pages=self._host.num_pages,
            host_bytes=self._host.num_bytes,
            host_budget_bytes=self._host.budget_bytes,
        )

    def holders(self) -> list[list[int]]:
        """The cache's references in the pool, one list per holder (for `PagePool.check_consistent`)."""
        return self._tiers.holders()

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        return list(self._index)

    def clear(self, pool: PagePool) -> None:
        """Drop every entry (no copies may be queued or running)."""
        self._tiers.bind(pool)
        if self._tiers.io or self._tiers.io_holds:
            raise ValueError("cannot clear the prefix cache while KV copies are queued")
        for entry in list(self._index):
            if entry in self._index:
                self._tiers.evict(entry, count=False)

    # -- internals -----------------------------------------------------------------------

    def _count(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            self._counts[name] += amount

    def _copy_tail(self, chain: list[CacheEntry], salt: bytes, wanted: np.ndarray):
        """(private page, tokens reused) copying the best partially matching page, or None."""
        if not wanted.size:
            return None
        source, num_tokens = self._index.best_tail(chain[-1] if chain else None, salt, wanted)
        if source is None or (source.tier is Tier.HOST and source.is_busy):
            return None
        self._index.touch([*chain, source])  # the page taken below must be older than the source
        page_id = self._tiers.take_page(source.last_used)  # the new holder's own page
        if page_id is None:
            return None
        self._tiers.copy_into(source, page_id)
        self._count(tail_copies=1)
        return page_id, num_tokens

    def _keep(self, parent, salt: bytes, tokens: bytes, page_id: int) -> CacheEntry | None:
        """The entry for this full page, created on the holder's page if new; None on a collision."""
        key, entry = self._index.find(parent, salt, tokens)
        if entry is None:
            if self._index.is_taken(key):
                return None
            entry = CacheEntry(key, parent, salt, tokens, page_id=page_id)
            self._drop_covered_tails(parent, salt, tokens)
            self._index.add(entry)
            self._tiers.pool.retain([page_id])
            self._count(published_pages=1)
        elif entry.tier is Tier.HOST and not entry.is_busy:
            self._tiers.promote(entry, page_id)
        return entry

    def _keep_tail(self, parent, salt: bytes, tail_tokens: np.ndarray, page_id: int):
        """Keep a partial tail page unless a cached child already starts with its tokens."""
        _, num_common = self._index.best_tail(parent, salt, tail_tokens)
        if num_common == tail_tokens.size:
            return None
        return self._keep(parent, salt, token_bytes(tail_tokens), page_id)

    def _drop_covered_tails(self, parent, salt: bytes, tokens: bytes) -> None:
        """A new entry supersedes inactive partial tails its own tokens start with."""
        for child in self._index.children(parent, salt):
            is_covered = child.num_tokens < self.page_size and tokens.startswith(child.tokens)
            if is_covered and (child.tier is Tier.HOST or self._tiers.is_reclaimable(child)):
                self._tiers.evict(child)
