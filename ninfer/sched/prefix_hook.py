"""The seam where a prefix cache plugs into the scheduler (`ninfer/cache/prefix.py`, later).

A prefix cache shares full, read-only KV pages between sequences through the page pool's
reference counts. The scheduler calls it at four points:

- `attach(seq, pool)`: once per sequence, while it is at the head of the FIFO and before its
  admission is planned. A hit retains the cached pages for `seq` (`pool.retain`), sets
  `seq.pages`, `seq.num_cached` and `seq.num_cached_prompt`. It must attach whole pages only
  and leave at least the last prompt token uncomputed (that position yields the first sample),
  so a sequence never writes into a shared page.
- `publish(seq, pool)`: when a sequence ends with STOP or LENGTH, before its pages are
  released; the cache retains the pages it wants to keep.
- `num_reclaimable_pages()`: pages held only by the cache (no running sequence uses them).
- `reclaim(num_pages, pool)`: under pressure, before anyone is paused, release that many
  inactive pages back to the pool (least valuable first).
"""

from __future__ import annotations

from typing import Protocol

from ninfer.cache.pages import PagePool
from ninfer.sched.sequence import Sequence


class PrefixCacheHook(Protocol):
    def attach(self, seq: Sequence, pool: PagePool) -> None: ...

    def publish(self, seq: Sequence, pool: PagePool) -> None: ...

    def num_reclaimable_pages(self) -> int: ...

    def reclaim(self, num_pages: int, pool: PagePool) -> None: ...


class NoPrefixCache:
    """The default: every prompt is computed; nothing is retained."""

    def attach(self, seq: Sequence, pool: PagePool) -> None:
        pass

    def publish(self, seq: Sequence, pool: PagePool) -> None:
        pass

    def num_reclaimable_pages(self) -> int:
        return 0

    def reclaim(self, num_pages: int, pool: PagePool) -> None:
        if num_pages:
            raise ValueError("NoPrefixCache holds no pages to reclaim")
