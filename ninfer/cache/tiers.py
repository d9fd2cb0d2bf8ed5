"""Retention tiers of the prefix cache: where each cached page lives, and how it moves.

A cached entry lives on the *device* (a pool page the cache holds one reference on) or on the
*host* (a snapshot within the host tier's byte budget). Entries only the cache holds are
inactive; under pressure the least recently used of them are demoted to host or, when the host
tier is off or holds only more recent pages, evicted. A hit on a host entry restores it into a
free page or, with none free, into the page of a strictly older inactive entry, which is
demoted (its snapshot is taken first, in the same `CacheIO` batch) or evicted.

Nothing here blocks: every copy is queued in a `CacheIO` for the owner of the runner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from itertools import islice

from ninfer.cache.host_tier import CacheIO, HostTier
from ninfer.cache.pages import PagePool
from ninfer.cache.prefix_index import CacheEntry, PrefixIndex, Tier
from ninfer.core.runner import PageSnapshot, StateSnapshot


class Tiers:
    """Moves a `PrefixIndex`'s entries between the page pool and the host tier."""

    def __init__(self, index: PrefixIndex, host: HostTier, *, num_reserved_pages: int = 0,
                 checkpoint_budget_bytes: int = 0):  # fmt: skip
        self.index = index
        self.host = host
        # Hybrid models: recurrent-state checkpoints beside entries: host copies within their own
        # byte budget, and (runners with checkpoint slots) device ones, each freed through
        # `release_checkpoint` when dropped.
        self.checkpoint_budget_bytes = checkpoint_budget_bytes
        self.checkpoint_bytes = 0
        self.num_checkpoints = 0
        self.num_device_checkpoints = 0
        self.release_checkpoint: Callable[[StateSnapshot], None] | None = None
        self.num_reserved_pages = num_reserved_pages
        self.pool: PagePool | None = None
        self.io = CacheIO()
        # References held for queued or running copies, outside the index: pinned copy
        # sources, and pages of entries evicted while their demotion was running.
        self.io_holds: Counter[int] = Counter()
        self.num_demotions = self.num_restores = self.num_evictions = 0

    def bind(self, pool: PagePool) -> None:
        if self.pool is None:
            self.pool = pool
        elif pool is not self.pool:
            raise ValueError("a prefix cache serves exactly one page pool")

    # -- what is where -------------------------------------------------------------------

    def is_reclaimable(self, entry: CacheEntry) -> bool:
        """On the device, held by the cache alone, no demotion in flight."""
        return entry.page_id is not None and not entry.is_busy and self.pool.refcount(entry.page_id) == 1

    def num_reclaimable(self, at_most: int | None = None) -> int:
        """Reclaimable entries, counted up to `at_most` (None: all of them). The planner asks
        for a few pages each step while the cache fills the pool: counting every entry (there
        are thousands) took a quarter of a busy server's event loop."""
        if self.pool is None:
            return 0
        return sum(1 for _ in islice(self._reclaimable(), at_most))

    def _reclaimable(self) -> Iterator[CacheEntry]:
        """The reclaimable entries, least recently used first."""
        return (e for e in self.index.on_device() if self.is_reclaimable(e))

    def num_device_pages(self) -> int:
        return self.index.num_on_device

    def holders(self) -> list[list[int]]:
        """The cache's references in the pool, one list per holder (for `PagePool.check_consistent`)."""
        held = [e.page_id for e in self.index if e.page_id is not None]
        return [held, list(self.io_holds.elements())]

    # -- pressure ------------------------------------------------------------------------

    def reclaim(self, num_pages: int) -> None:
        """Free `num_pages` inactive pages, least recently used first (demoted pages once their IO ran)."""
        victims = list(islice(self._reclaimable(), num_pages))
        num_freed = 0
        # The most recent victims get the host room; the least recent are evicted outright.
        for entry in reversed(victims):
            if entry not in self.index:
                continue  # evicted with an ancestor (and counted then)
            has_room, num_freed_for_room = self.make_host_room(entry.last_used)
            num_freed += num_freed_for_room
            if entry in self.index:
                num_freed += self.demote(entry) if has_room else self.evict(entry)
        if num_freed < num_pages:
            raise ValueError(f"asked to reclaim {num_pages} pages but only {num_freed} were inactive")

    def make_host_room(self, last_used: int) -> tuple[bool, int]:
        """Evict host entries used before `last_used` until one more page fits.

        Returns (whether it fits, pages freed on the way). A host entry more recent than the
        page being demoted is worth more than it, so that page is evicted instead.
        """
        if not self.host.is_enabled:
            return False, 0
        num_freed = 0
        while not self.host.has_room:
            victim = next((e for e in self.index if e.tier is Tier.HOST and not e.is_busy), None)
            if victim is None or victim.last_used > last_used:
                return False, num_freed
            num_freed += self.evict(victim)
        return True, num_freed

    def demote(self, entry: CacheEntry, *, hand_over: bool = False) -> int:
        """Queue the entry's snapshot; returns 1 (the page freed), or with `hand_over` the page id.

        A handed-over page leaves the entry at once (it moves to the host tier, busy until its
        snapshot is stored) and goes to a restore queued after the snapshot.
        """
        self.host.reserve()
        entry.is_busy = True
        page_id = entry.page_id
        self.io.demotions.append((entry, page_id, hand_over))
        self.num_demotions += 1
        if hand_over:
            self.index.set_page(entry, None)
            return page_id
        return 1

    def evict(self, entry: CacheEntry, *, count: bool = True) -> int:
        """Remove the entry and its descendants; returns the pages that became free."""
        num_freed = 0
        for removed in self.index.remove(entry):
            if removed.is_busy:
                removed.is_removed = True  # complete_io frees its page once the snapshot ran
                if removed.page_id is not None:  # (unless the page was handed over)
                    self.io_holds[removed.page_id] += 1
            elif removed.page_id is not None:
                num_freed += self.pool.refcount(removed.page_id) == 1
                self.pool.release([removed.page_id])
                removed.page_id = None
            elif removed.snapshot is not None:
                self.host.drop(removed.snapshot)
                removed.snapshot = None
            self.drop_checkpoint(removed)
            self.num_evictions += int(count)
        return num_freed

    # -- state checkpoints (hybrid models) -----------------------------------------------

    def keep_checkpoint(self, entry: CacheEntry, snapshot: StateSnapshot) -> bool:
        """Keep `snapshot` beside the entry. A device checkpoint (in a runner's checkpoint slot)
        is kept as it is; a host one drops the least recently used other host checkpoints until
        it fits the budget, and is not kept (False) when it is larger than the budget."""
        if snapshot.on_device:
            self.drop_checkpoint(entry)
            entry.checkpoint = snapshot
            self.num_checkpoints += 1
            self.num_device_checkpoints += 1
            return True
        if snapshot.nbytes > self.checkpoint_budget_bytes:
            return False
        self.drop_checkpoint(entry)
        for victim in list(self.index):  # least recently used first
            if self.checkpoint_bytes + snapshot.nbytes <= self.checkpoint_budget_bytes:
                break
            if victim is not entry and victim.checkpoint is not None and not victim.checkpoint.on_device:
                self.drop_checkpoint(victim)
        entry.checkpoint = snapshot
        self.checkpoint_bytes += snapshot.nbytes
        self.num_checkpoints += 1
        return True

    def drop_checkpoint(self, entry: CacheEntry) -> None:
        """Forget the entry's checkpoint (a device one's slot is released)."""
        snapshot = self.take_checkpoint(entry)
        if snapshot is not None and snapshot.on_device:
            self.release_checkpoint(snapshot)

    def take_checkpoint(self, entry: CacheEntry) -> StateSnapshot | None:
        """The entry's checkpoint, taken out of the cache (a device one's slot is the caller's)."""
        snapshot, entry.checkpoint = entry.checkpoint, None
        if snapshot is not None:
            self.num_checkpoints -= 1
            if snapshot.on_device:
                self.num_device_checkpoints -= 1
            else:
                self.checkpoint_bytes -= snapshot.nbytes
        return snapshot

    def oldest_device_checkpoint(self) -> CacheEntry | None:
        """The least recently used entry whose checkpoint is in a device slot."""
        return next((e for e in self.index if e.checkpoint is not None and e.checkpoint.on_device), None)

    # -- hits ----------------------------------------------------------------------------

    def restore(self, entry: CacheEntry, floor: int | None) -> bool:
        """Bring a host entry back onto the device for a hit (its KV copied by the next IO)."""
        if entry.is_busy:
            return False  # its snapshot is still being taken
        snapshot, entry.snapshot = entry.snapshot, None
        self.host.drop(snapshot)  # before finding a page: its room may take a demotion
        page_id = self.take_page(floor)
        if page_id is None:
            self.host.add(snapshot)
            entry.snapshot = snapshot
            return False
        self.index.set_page(entry, page_id)  # the cache's reference
        self.io.restores.append((page_id, snapshot))
        self.num_restores += 1
        return True

    def take_page(self, floor: int | None) -> int | None:
        """A page for a hit: a free one, else one of an inactive entry used before `floor`.

        The older entry is demoted (its page handed over once its snapshot ran: `CacheIO` takes
        snapshots before it restores) or, with no host room, evicted. Free pages below the
        reserve are left to running sequences.
        """
        if self.pool.can_allocate(1 + self.num_reserved_pages):
            return self.pool.allocate(1)[0]
        victim = next(self._reclaimable(), None)  # least recent
        if victim is None or (floor is not None and victim.last_used >= floor):
            return None
        has_room, _ = self.make_host_room(victim.last_used)
        if has_room:
            return self.demote(victim, hand_over=True)
        self.evict(victim)
        return self.pool.allocate(1)[0]

    def copy_into(self, source: CacheEntry, page_id: int) -> None:
        """Queue copying a cached page's KV into another page (copy-on-write of a tail)."""
        if source.tier is Tier.HOST:
            self.io.restores.append((page_id, source.snapshot))
            return
        self.pool.retain([source.page_id])  # pinned: a reclaim must not free it before the copy ran
        self.io.pins.append(source.page_id)
        self.io_holds[source.page_id] += 1
        self.io.copies.append((source.page_id, page_id))

    def promote(self, entry: CacheEntry, page_id: int) -> None:
        """A holder computed a host entry's KV again: keep its page, drop the host copy (the
        caller, `PrefixCache.insert`, touches the entry next)."""
        self.host.drop(entry.snapshot)
        entry.snapshot = None
        self.index.set_page(entry, page_id, touch_follows=True)
        self.pool.retain([page_id])

    # -- the copies ----------------------------------------------------------------------

    def take_io(self) -> CacheIO:
        io, self.io = self.io, CacheIO()
        return io

    def complete_io(self, io: CacheIO, snapshots: list[PageSnapshot]) -> None:
        if len(snapshots) != len(io.demotions):
            raise ValueError(f"{len(io.demotions)} demotions ran but {len(snapshots)} snapshots came back")
        for (entry, page_id, is_handed_over), snapshot in zip(io.demotions, snapshots, strict=True):
            entry.is_busy = False
            self.index.set_page(entry, None)
            if entry.is_removed:
                self.host.cancel_reservation()
            else:
                self.host.store(snapshot)
                entry.snapshot = snapshot
            if not is_handed_over:  # a handed-over page belongs to the restored entry now
                self.io_holds[page_id] -= int(entry.is_removed)
                self.pool.release([page_id])
        self.io_holds.subtract(io.pins)
        self.pool.release(io.pins)
        self.io_holds = +self.io_holds  # drop zero counts
