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
- Single flight: `claim` registers the full prompt pages a sequence is about to compute (keyed
  like the index). An `attach` whose next uncached page is claimed by another sequence attaches
  nothing and sets `seq.prefix_wait`: the request waits for those pages instead of computing
  them again. The claims end as the pages are published (`publish_progress`), or all at once
  when the owner stops computing (`forget`: finished, paused or cancelled; `detach`: not
  admitted); the waiter's next `attach` then looks up again and either finds the pages or,
  when the owner went away first, computes them itself (claiming them for the next waiter).

Hybrid models (recurrent state; `checkpoint_budget_bytes` set): KV pages alone cannot resume a
sequence, which also needs the Gated DeltaNet state after exactly those tokens. The cache keeps
*checkpoints* of that state (`StateSnapshot`: a host copy, or a state in one of the runner's
checkpoint slots, device memory) beside full-page entries, and a hit
reuses only the longest walked chain whose last page has one: pages past it are left to compute
(and no partial tail is ever copied or kept, as no checkpoint lies mid-page). The hit hands the
checkpoint to the sequence (`seq.start_state`), which the runner restores into its state before
its first row. The rule for taking checkpoints: one per request, at its *prompt boundary*, the
last page boundary before its last prompt token, B = ((prompt length - 1) // page_size) *
page_size, when B lies past what its own hit reused. The attach sets `seq.checkpoint_at = B`, so
its prefill rows end there and the step task hands the state at B to `keep_checkpoint`, which
stores it beside the entry of the page ending at B (published as that row completed it). B is
as far as a lookup of the same prompt walks, and the next turn of a conversation (this prompt,
the reply, a new message) walks past it: it reuses everything up to B and computes the rest of
the previous prompt, the reply and its new message, then checkpoints its own prompt boundary.
Host copies have their own byte budget (`checkpoint_budget_bytes`); a new one drops the least
recently used others until it fits, and evicting an entry drops its checkpoint (a device one's
slot is released: `set_checkpoint_release`). With checkpoint slots the step task saves each new
checkpoint into a slot, first demoting the least recently used device one to a host copy when
every slot is taken (`take_oldest_device_checkpoint`, `keep_demoted`). Read-only requests take
none.

Every KV copy this needs is queued in a `CacheIO` batch (see `host_tier.py`): the owner of the
runner calls `take_io()`, runs the batch off the event loop and hands the result back to
`complete_io()`, after `attach` and after `reclaim`, before the next forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from ninfer.cache.host_tier import CacheIO, HostTier
from ninfer.cache.pages import PagePool
from ninfer.cache.prefix_index import DEFAULT_KEY_BYTES, CacheEntry, PrefixIndex, Tier
from ninfer.cache.prefix_index import salt_bytes, token_bytes
from ninfer.cache.tiers import Tiers
from ninfer.core.runner import PageSnapshot, Runner, StateSnapshot


def model_salt(spec, runner_name: str, prefix_salt: str = "") -> str:
    """The prefix cache's salt for a model: KV depends only on the model and the tokens, so the
    spec (its shapes), the runner class that computes it and the operator's `prefix_salt`
    (a revision, say). A router that keys requests as the cache does uses the same."""
    return f"{spec!r}|{runner_name}|{prefix_salt}"


@attrs.frozen(kw_only=True)
class PrefixCacheStatistics:
    """Counters (only grow) and gauges of one prefix cache."""

    num_lookups: int  # prompts looked up (of admitted requests: `detach` takes a lookup back)
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
    num_waits: int = 0  # requests that waited for pages another request was computing
    num_checkpoints: int = 0  # hybrid models: recurrent-state checkpoints held now
    num_device_checkpoints: int = 0  # of those, in the runner's checkpoint slots
    checkpoint_bytes: int = 0  # the host ones' bytes
    checkpoint_budget_bytes: int = 0


@attrs.frozen
class Hit:
    """What a lookup reused: pages for positions 0 .. num_tokens - 1, now held by the caller."""

    page_ids: tuple[int, ...]
    num_tokens: int
    state: StateSnapshot | None = None  # hybrid models: the recurrent state after num_tokens (None at 0)


@attrs.define(eq=False)
class _Claim:
    """The pages one sequence is computing: its prompt, and page index -> key of each page."""

    prompt: np.ndarray
    keys: dict[int, bytes] = attrs.Factory(dict)


@attrs.frozen
class PrefixWait:
    """An `attach` that found its next pages being computed by another sequence (single flight)."""

    owner_id: int  # the seq_id of the sequence computing them
    key: bytes  # the last page of the run it shares with the owner: the wait lasts while it is claimed
    num_tokens: int  # prompt tokens the waiter finds cached once those pages are published


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
        checkpoint_budget_bytes: int | None = None,
    ):
        """`salt` names the model (KV from another model must never match).

        `num_reserved_pages`: free pages a hit must leave when it allocates (a restore or a tail
        copy), so cache traffic never takes the last pages running sequences grow into.

        `checkpoint_budget_bytes`: None for dense models; for models with recurrent state the
        host bytes of state checkpoints, and hits only reuse checkpointed prefixes (module doc).
        """
        if checkpoint_budget_bytes is not None and checkpoint_budget_bytes < 0:
            raise ValueError(f"the checkpoint budget must be >= 0, got {checkpoint_budget_bytes}")
        self.page_size = page_size
        self.is_recurrent = checkpoint_budget_bytes is not None
        self._salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self._index = PrefixIndex(page_size, key_bytes=key_bytes)
        self._host = HostTier(host_budget_bytes, page_nbytes)
        self._tiers = Tiers(self._index, self._host, num_reserved_pages=num_reserved_pages,
                            checkpoint_budget_bytes=checkpoint_budget_bytes or 0)  # fmt: skip
        self._counts = dict.fromkeys(("lookups", "hits", "hit_tokens", "published_pages", "tail_copies", "waits"), 0)
        # Single flight: page key -> seq_id of the sequence computing that page, and per
        # sequence its claims; where each attach left off (for the claim that follows it).
        self._claims: dict[bytes, int] = {}
        self._claimed: dict[int, _Claim] = {}
        self._frontiers: dict[int, tuple[bytes, int]] = {}  # seq_id -> (parent key, first uncached page)
        # A running sequence's pages published so far (their entries, root first): the next
        # `publish_progress` hashes only the pages completed since.
        self._published: dict[int, list[CacheEntry]] = {}

    # -- the scheduler's hook ------------------------------------------------------------

    def attach(self, seq, pool: PagePool) -> None:
        """Give a waiting sequence its cached prefix (sets pages, num_cached, num_cached_prompt),
        or, when its next uncached pages are claimed by another sequence, nothing: it then sets
        `seq.prefix_wait` (cleared by the attach that finds the wait over)."""
        if seq.pages or seq.num_cached:
            raise ValueError(f"sequence {seq.seq_id} already holds KV; attach it before it runs")
        self._tiers.bind(pool)
        wait = getattr(seq, "prefix_wait", None)
        if wait is not None and self._claims.get(wait.key) == wait.owner_id:
            return  # still being computed: nothing to look up yet
        prompt = np.asarray(seq.token_ids[: seq.num_prompt], dtype=np.int64)
        salt = salt_bytes(self._salt, seq.request.cache_salt)
        chain = self._index.walk(salt, prompt, (len(prompt) - 1) // self.page_size)
        parent_key = chain[-1].key if chain else self._index.root_key(salt)
        new_wait = self._in_flight(seq.seq_id, parent_key, len(chain), prompt)
        if new_wait is not None:
            self._count(waits=int(wait is None))
            seq.prefix_wait = new_wait
            return
        if wait is not None:
            seq.prefix_wait = None
        hit = self._hold(chain, salt, prompt, pool)
        seq.pages = list(hit.page_ids)
        seq.num_cached = seq.num_cached_prompt = hit.num_tokens
        self._frontiers[seq.seq_id] = (parent_key, len(chain))
        if self.is_recurrent:
            seq.start_state = hit.state
            seq.checkpoint_at = self._checkpoint_boundary(seq, hit.num_tokens)

    def claim(self, seq) -> None:
        """`seq` (just attached) will compute the rest of its prompt: an `attach` of another
        sequence whose next uncached page is one of these waits for it instead of computing it."""
        frontier = self._frontiers.pop(seq.seq_id, None)
        if frontier is None or seq.request.cache_read_only:
            return
        parent_key, first_page = frontier
        claim = _Claim(np.asarray(seq.token_ids[: seq.num_prompt], dtype=np.int64))
        for index, key in enumerate(self._index.keys_after(parent_key, claim.prompt, first_page), start=first_page):
            if self._claims.setdefault(key, seq.seq_id) == seq.seq_id:  # the first claimant computes it
                claim.keys[index] = key
        if claim.keys:
            self._claimed[seq.seq_id] = claim

    def forget(self, seq) -> None:
        """`seq` stopped computing (finished, paused, cancelled, left the queue): its claims end,
        so whoever waits for them looks up again at its next attach."""
        self._frontiers.pop(seq.seq_id, None)
        self._published.pop(seq.seq_id, None)
        self._end_claims(seq.seq_id, None)

    def detach(self, seq, pool: PagePool) -> None:
        """Undo `attach` for a sequence that stays queued (its lookup is not counted, its claims end)."""
        self.forget(seq)
        pool.release(seq.pages)
        self._count(lookups=-1, hits=-int(seq.num_cached_prompt > 0), hit_tokens=-seq.num_cached_prompt)
        seq.pages = []
        seq.num_cached = seq.num_cached_prompt = 0
        seq.start_state, seq.checkpoint_at = None, 0

    def keep_checkpoint(self, seq, snapshot: StateSnapshot) -> bool:
        """Keep the recurrent state `seq` reached at a page boundary (its `checkpoint_at`) beside
        the entry of the page ending there (published as the row completed it); nothing (False:
        a device checkpoint's slot stays the caller's) when that page is not cached (a
        collision, an eviction) or the budget is too small."""
        size = self.page_size
        if not self.is_recurrent or seq.request.cache_read_only or snapshot.num_tokens % size:
            return False
        chain = self._published.get(seq.seq_id) or []
        index = snapshot.num_tokens // size - 1
        if 0 <= index < len(chain) and chain[index] in self._index:
            return self._tiers.keep_checkpoint(chain[index], snapshot)
        return False

    def set_checkpoint_release(self, release: Callable[[StateSnapshot], None]) -> None:
        """Where dropped device checkpoints go (the runner's `release_checkpoint`)."""
        self._tiers.release_checkpoint = release

    def take_oldest_device_checkpoint(self) -> tuple[CacheEntry, StateSnapshot] | None:
        """The least recently used checkpoint in a device slot, taken out of the cache with its
        entry (to be demoted to a host copy and handed back to `keep_demoted`), or None."""
        entry = self._tiers.oldest_device_checkpoint()
        return None if entry is None else (entry, self._tiers.take_checkpoint(entry))

    def keep_demoted(self, entry: CacheEntry, snapshot: StateSnapshot) -> bool:
        """A demoted checkpoint's host copy back beside its entry, if the entry is still cached
        and the host budget takes it."""
        return entry in self._index and self._tiers.keep_checkpoint(entry, snapshot)

    def publish(self, seq, pool: PagePool) -> None:
        """Keep a finished sequence's computed pages (before it releases them)."""
        try:
            if not seq.request.cache_read_only:
                resume = self._published.pop(seq.seq_id, None)
                self.insert(seq.token_ids[: seq.num_cached], seq.pages, seq.request.cache_salt, pool, resume=resume)
        finally:
            self._end_claims(seq.seq_id, seq.num_cached // self.page_size)

    def publish_progress(self, seq, pool: PagePool) -> None:
        """Share a running sequence's completed full pages now (its tail page is still written)."""
        num_full_pages = seq.num_cached // self.page_size
        try:
            if not seq.request.cache_read_only:
                num_full_tokens = num_full_pages * self.page_size
                resume = self._published.get(seq.seq_id)
                chain = self.insert(seq.token_ids[:num_full_tokens], seq.pages, seq.request.cache_salt, pool, resume=resume)
                self._published[seq.seq_id] = chain
        finally:
            self._end_claims(seq.seq_id, num_full_pages)  # computed: claimed no more, cached or not

    def num_reclaimable_pages(self, at_most: int | None = None) -> int:
        """Pages held only by the cache, which `reclaim` may free (counted up to `at_most`)."""
        return self._tiers.num_reclaimable(at_most)

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
        # The last prompt token is computed: it yields the first sample.
        chain = self._index.walk(salt, prompt, (len(prompt) - 1) // self.page_size)
        return self._hold(chain, salt, prompt, pool)

    def _hold(self, chain: list[CacheEntry], salt: bytes, prompt: np.ndarray, pool: PagePool) -> Hit:
        """Hold the pages of a walked chain (restoring host entries) plus a copied tail; count the lookup."""
        max_tokens = len(prompt) - 1
        if self.is_recurrent:  # a hybrid prefix is reusable only up to a state checkpoint
            chain = chain[: _last_checkpoint(chain)]
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
        if self.is_recurrent:  # only up to the last checkpoint (a restore may have stopped early)
            keep = _last_checkpoint(chain[:held])
            pool.release(page_ids[keep:])
            num_tokens = keep * self.page_size
            self._count(lookups=1, hits=int(num_tokens > 0), hit_tokens=num_tokens)
            return Hit(tuple(page_ids[:keep]), num_tokens, chain[keep - 1].checkpoint if keep else None)
        num_tokens = held * self.page_size
        tail = self._copy_tail(chain[:held], salt, prompt[num_tokens:max_tokens])
        if tail is not None:
            page_ids.append(tail[0])
            num_tokens += tail[1]
        self._count(lookups=1, hits=int(num_tokens > 0), hit_tokens=num_tokens)
        return Hit(tuple(page_ids), num_tokens)

    def insert(
        self, token_ids, page_ids, cache_salt: str | None, pool: PagePool, *, resume: list[CacheEntry] | None = None
    ) -> list[CacheEntry]:
        """Take a reference on the pages holding `token_ids`' KV (full pages, then a partial tail);
        returns the chain of full-page entries. `resume`: the chain an earlier insert of the same
        sequence returned (a prefix of these tokens): its pages are not hashed again while its
        last entry is still cached (an eviction takes an entry's descendants with it)."""
        self._tiers.bind(pool)
        size = self.page_size
        salt = salt_bytes(self._salt, cache_salt)
        num_full = min(len(token_ids) // size, len(page_ids))
        chain: list[CacheEntry] = list(resume) if resume and len(resume) <= num_full and resume[-1] in self._index else []
        parent = chain[-1] if chain else None
        start = len(chain)
        tokens = np.asarray(token_ids[start * size :], dtype=np.int64)  # from the first page not chained yet
        for i in range(start, num_full):
            page_tokens = tokens[(i - start) * size : (i - start + 1) * size]
            parent = self._keep(parent, salt, token_bytes(page_tokens), page_ids[i])
            if parent is None:
                break  # a hash collision holds this key: the rest cannot be found either
            chain.append(parent)
        else:
            tail_tokens = tokens[(num_full - start) * size :]
            # (hybrids keep no tails: no checkpoint lies mid-page, so none could be reused)
            if tail_tokens.size and num_full < len(page_ids) and not self.is_recurrent:
                tail = self._keep_tail(parent, salt, tail_tokens, page_ids[num_full])
                self._index.touch([*chain, tail] if tail is not None else chain)
                return chain
        self._index.touch(chain)
        return chain

    # -- introspection -------------------------------------------------------------------

    def statistics(self) -> PrefixCacheStatistics:
        c, tiers = self._counts, self._tiers
        return PrefixCacheStatistics(
            num_lookups=c["lookups"],
            num_hits=c["hits"],
            num_hit_tokens=c["hit_tokens"],
            num_published_pages=c["published_pages"],
            num_tail_copies=c["tail_copies"],
            num_waits=c["waits"],
            num_demotions=tiers.num_demotions,
            num_restores=tiers.num_restores,
            num_evictions=tiers.num_evictions,
            num_device_pages=tiers.num_device_pages(),
            num_host_pages=self._host.num_pages,
            host_bytes=self._host.num_bytes,
            host_budget_bytes=self._host.budget_bytes,
            num_checkpoints=tiers.num_checkpoints,
            num_device_checkpoints=tiers.num_device_checkpoints,
            checkpoint_bytes=tiers.checkpoint_bytes,
            checkpoint_budget_bytes=tiers.checkpoint_budget_bytes,
        )

    def unreachable(self) -> list[CacheEntry]:
        """Entries whose parent is no longer cached (none, when the index is consistent: an
        eviction takes the descendants, and an insert chains only from cached entries)."""
        return [e for e in self._index if e.parent is not None and e.parent not in self._index]

    def holders(self) -> list[list[int]]:
        """The cache's references in the pool, one list per holder (for `PagePool.check_consistent`)."""
        return self._tiers.holders()

    def claimants(self) -> dict[int, int]:
        """Sequences with claimed pages: seq_id -> how many pages it claims (single flight)."""
        owners: dict[int, int] = {}
        for owner in self._claims.values():
            owners[owner] = owners.get(owner, 0) + 1
        by_sequence = {seq_id: claim.keys for seq_id, claim in self._claimed.items()}
        if owners != {seq_id: len(keys) for seq_id, keys in by_sequence.items()} or any(
            self._claims[key] != seq_id for seq_id, keys in by_sequence.items() for key in keys.values()
        ):
            raise AssertionError("the claims by page and by sequence disagree")
        return owners

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

    def _in_flight(self, seq_id: int, parent_key: bytes, first_page: int, prompt: np.ndarray) -> PrefixWait | None:
        """The wait for the pages from `first_page` on (the first not cached) while another
        sequence claims them, up to the last page both prompts share; None if nobody does."""
        max_pages = (len(prompt) - 1) // self.page_size  # as the lookup: never the last token's page
        if first_page >= max_pages:
            return None
        key = next(self._index.keys_after(parent_key, prompt[: (first_page + 1) * self.page_size], first_page))
        owner = self._claims.get(key)
        if owner is None or owner == seq_id:
            return None
        # The same key: the same salt and tokens up to here. How much further do they agree?
        claim = self._claimed[owner]
        n = min(len(prompt), len(claim.prompt))
        mismatch = np.flatnonzero(prompt[:n] != claim.prompt[:n])
        num_pages = min((int(mismatch[0]) if mismatch.size else n) // self.page_size, max_pages)
        last = max((index for index in claim.keys if first_page <= index < num_pages), default=None)
        if last is None:  # (a hash collision: the tokens differ after all)
            return None
        return PrefixWait(owner, claim.keys[last], (last + 1) * self.page_size)

    def _end_claims(self, seq_id: int, num_pages: int | None) -> None:
        """End the sequence's claims on its first `num_pages` pages (None: all of them)."""
        claim = self._claimed.get(seq_id)
        if claim is None:
            return
        for index in [i for i in claim.keys if num_pages is None or i < num_pages]:
            key = claim.keys.pop(index)
            if self._claims.get(key) == seq_id:
                del self._claims[key]
        if not claim.keys:
            del self._claimed[seq_id]

    def _checkpoint_boundary(self, seq, num_hit: int) -> int:
        """Where `seq` should checkpoint its state (module doc: its prompt boundary), or 0."""
        if seq.request.cache_read_only or self._tiers.checkpoint_budget_bytes <= 0:
            return 0
        boundary = (seq.num_prompt - 1) // self.page_size * self.page_size
        return boundary if boundary > num_hit else 0

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


def _last_checkpoint(chain: list[CacheEntry]) -> int:
    """The length of the longest prefix of `chain` whose last entry holds a state checkpoint (0: none)."""
    return next((i + 1 for i in range(len(chain) - 1, -1, -1) if chain[i].checkpoint is not None), 0)
