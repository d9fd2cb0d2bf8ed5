"""The KV page pool: which page ids are free, and how many holders each used page has.

Pure bookkeeping, no device memory: the runner owns the storage behind page ids
`0 .. num_pages - 1`, this pool only decides who may write which page. Pages are reference
counted from the start so a prefix cache can share full pages between sequences: a page
returns to the free list when its last holder releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import attrs


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` token positions (ceiling division)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if num_tokens < 0:
        raise ValueError(f"a token count cannot be negative, got {num_tokens}")
    return -(-num_tokens // page_size)


class OutOfPages(Exception):
    """An allocation asked for more pages than are free (a scheduler bug, never a client error)."""


@attrs.frozen
class PoolStatistics:
    num_pages: int
    num_free: int
    num_used: int
    num_shared: int  # used pages with more than one holder


class PagePool:
    """Free list and reference counts over `num_pages` page ids."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        # FIFO reuse spreads writes over the pool, which makes stale-page bugs visible in tests.
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages, each with one holder."""
        if num_pages > len(self._free):
            raise OutOfPages(f"asked for {num_pages} pages but only {len(self._free)} are free")
        page_ids = [self._free.popleft() for _ in range(num_pages)]
        for page_id in page_ids:
            self._refcounts[page_id] = 1
        return page_ids

    def retain(self, page_ids: Iterable[int]) -> None:
        """Add one holder to each (already used) page: sharing, e.g. a prefix-cache hit."""
        for page_id in page_ids:
            if self._refcounts[page_id] == 0:
                raise ValueError(f"page {page_id} is free and cannot be retained")
            self._refcounts[page_id] += 1

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop one holder from each page; pages without holders become free."""
        for page_id in page_ids:
            count = self._refcounts[page_id]
            if count == 0:
                raise ValueError(f"page {page_id} is already free (double release)")
            self._refcounts[page_id] = count - 1
            if count == 1:
                self._free.append(page_id)

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    def is_shared(self, page_id: int) -> bool:
        return self._refcounts[page_id] > 1

    def statistics(self) -> PoolStatistics:
        num_shared = sum(1 for count in self._refcounts if count > 1)
        return PoolStatistics(self.num_pages, self.num_free, self.num_used, num_shared)

    def check_consistent(self, holders: Sequence[Sequence[int]] | None = None) -> None:
        """Assert the free list and refcounts agree (and match `holders`' page lists if given)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page appears twice in the free list")
        for page_id, count in enumerate(self._refcounts):
            if (count == 0) != (page_id in free):
                raise AssertionError(f"page {page_id} has refcount {count} but free={page_id in free}")
        if holders is not None:
            expected = [0] * self.num_pages
            for page_ids in holders:
                for page_id in page_ids:
                    expected[page_id] += 1
            if expected != self._refcounts:
                raise AssertionError("page refcounts do not match the holders' page lists")
