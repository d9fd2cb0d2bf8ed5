"""The seam where a prefix cache plugs into the scheduler (`ninfer/cache/prefix.py`).

A prefix cache shares full, read-only KV pages between sequences through the page pool's
reference counts. The scheduler calls it at these points:

- `attach(seq, pool)`: once per sequence, while it is at the head of the FIFO and before its
  admission is planned. A hit retains the cached pages for `seq` (`pool.retain`), sets
  `seq.pages`, `seq.num_cached` and `seq.num_cached_prompt`. Shared pages are whole pages; a
  partially reused last page must be the sequence's own copy (copy-on-write). At least the last
  prompt token stays uncomputed (that position yields the first sample), so a sequence never
  writes into a shared page.
- `publish(seq, pool)`: when a sequence ends with STOP or LENGTH, before its pages are
  released; the cache retains the pages it wants to keep.
- `num_reclaimable_pages()`: pages held only by the cache (no running sequence uses them).
- `reclaim(num_pages, pool)`: under pressure, before anyone is paused, release that many
  inactive pages back to the pool (least valuable first).

Optional methods (the scheduler checks for them, so a minimal hook needs only the four above):

- `detach(seq, pool)`: undo `attach` for a sequence that was not admitted this step (release
  its pages, reset its counts); without it the scheduler releases `seq.pages` itself.
- `publish_progress(seq, pool)`: a running sequence just completed more full pages; the cache
  may share them at once, so a request arriving meanwhile reuses a prefill still running.
- `take_io()` / `complete_io(io, result, pool)`: KV copies the cache queued (restores from its
  host tier, copy-on-write tails, demotions). The step task runs `result = io.run(runner)` off
  the event loop after attaching and after reclaiming, before the next forward pass.
- `statistics()`: a frozen record of the cache's counters (None when there is no cache).
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

    def take_io(self) -> None:
        return None

    def statistics(self) -> None:
        return None


def detach(prefix: PrefixCacheHook, seq: Sequence, pool: PagePool) -> None:
    """Give back what `attach` gave a sequence that stays in the queue (it is looked up again later)."""
    undo = getattr(prefix, "detach", None)
    if undo is not None:
        undo(seq, pool)
    else:
        pool.release(seq.pages)
        seq.pages = []
        seq.num_cached = seq.num_cached_prompt = 0
    seq.is_prefix_looked_up = False
