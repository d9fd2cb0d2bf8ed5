"""The host tier's byte budget, and the KV copies that move pages between tiers.

The prefix cache is a synchronous data structure, but moving KV needs the runner, whose calls
block (a device copy, a large memcpy). So the cache only *plans* copies: it queues them in a
`CacheIO` batch, and the one owner of the runner (the engine's step task) runs the batch off
the event loop with `io.run(runner)` before its next forward pass, then hands the result back
with `PrefixCache.complete_io`. Until then every page a copy reads or writes stays held.
"""

from __future__ import annotations

import attrs

from ninfer.core.runner import PageSnapshot, Runner


class HostTier:
    """Bytes of host snapshots the cache holds, against a fixed budget.

    A demotion reserves room before its snapshot exists (its size is the runner's page size),
    so planning never overshoots the budget while copies are in flight.
    """

    def __init__(self, budget_bytes: int, page_nbytes: int):
        if budget_bytes < 0 or page_nbytes < 1:
            raise ValueError(
                f"the host tier needs a budget >= 0 and page_nbytes >= 1, got {budget_bytes} and {page_nbytes}"
            )
        self.budget_bytes = budget_bytes
        self.page_nbytes = page_nbytes
        self.num_bytes = 0  # held by stored snapshots
        self.num_reserved_bytes = 0  # promised to demotions in flight
        self.num_pages = 0

    @property
    def is_enabled(self) -> bool:
        return self.budget_bytes >= self.page_nbytes

    @property
    def has_room(self) -> bool:
        """One more page fits without evicting anything."""
        return self.num_bytes + self.num_reserved_bytes + self.page_nbytes <= self.budget_bytes

    def reserve(self) -> None:
        if not self.has_room:
            raise ValueError("the host tier has no room to reserve a page")
        self.num_reserved_bytes += self.page_nbytes

    def store(self, snapshot: PageSnapshot) -> None:
        """A reserved demotion finished: its snapshot now counts instead of the reservation."""
        self.num_reserved_bytes -= self.page_nbytes
        self.add(snapshot)

    def add(self, snapshot: PageSnapshot) -> None:
        self.num_bytes += snapshot.nbytes
        self.num_pages += 1

    def cancel_reservation(self) -> None:
        self.num_reserved_bytes -= self.page_nbytes

    def drop(self, snapshot: PageSnapshot) -> None:
        self.num_bytes -= snapshot.nbytes
        self.num_pages -= 1


@attrs.define(eq=False)
class CacheIO:
    """KV copies queued by the cache; run them (in this order) before the next forward pass.

    - `demotions`: pages to snapshot to host; the cache holds them until `complete_io`, or has
      handed them over to a restore of this batch (which therefore runs after the snapshots).
    - `restores`: (page id, snapshot) — host-tier KV written back into a page for a hit (a
      restored entry, or a tail page copied from a host entry).
    - `copies`: (source page, destination page) — copy-on-write of a cached tail page into a
      sequence's private page; each source is pinned (retained) until `complete_io`.
    """

    demotions: list = attrs.Factory(list)  # (the cache's entry, page id, handed over?)
    restores: list[tuple[int, PageSnapshot]] = attrs.Factory(list)
    copies: list[tuple[int, int]] = attrs.Factory(list)
    pins: list[int] = attrs.Factory(list)  # copy sources the cache retained for this batch

    def __bool__(self) -> bool:
        return bool(self.restores or self.copies or self.demotions)

    @property
    def demote_page_ids(self) -> list[int]:
        return [page_id for _, page_id, _ in self.demotions]

    def run(self, runner: Runner) -> list[PageSnapshot]:
        """Do the copies (blocking), in this order; returns one snapshot per demoted page."""
        # Snapshots first: a restore may write a page whose old contents are being demoted.
        # One snapshot per page, so the host tier can evict pages one at a time.
        snapshots = [runner.snapshot_pages([page_id]) for page_id in self.demote_page_ids]
        # Restores before copies: a copy may read a page another sequence's hit just restored.
        for page_id, snapshot in self.restores:
            runner.restore_pages([page_id], snapshot)
        if self.copies:
            runner.copy_pages([src for src, _ in self.copies], [dst for _, dst in self.copies])
        return snapshots
