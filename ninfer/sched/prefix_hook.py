"""The seam where a prefix cache plugs into the scheduler (`ninfer/cache/prefix.py`).

A prefix cache shares full, read-only KV pages between sequences through the page pool's
reference counts. The scheduler calls every method of `PrefixCacheHook`, at these points:

- `attach(seq, pool)`: before its admission is planned, for every queued sequence that could
  take a free lane this step, in FIFO order (so every admitted sequence was looked up). A hit
  retains the cached pages for `seq` (`pool.retain`), sets `seq.pages`, `seq.num_cached` and
  `seq.num_cached_prompt`. Shared pages are whole pages; a partially reused last page must be
  the sequence's own copy (copy-on-write). At least the last prompt token stays uncomputed
  (that position yields the first sample), so a sequence never writes into a shared page.
  Single flight: when the next pages `seq` lacks are being computed by another sequence (they
  were claimed), `attach` holds nothing and sets `seq.prefix_wait` instead; the sequence is not
  a candidate this step (younger ones may be), and it is attached again at every step until an
  attach finds the wait over (the owner published the pages, or stopped computing them) and
  clears `seq.prefix_wait`.
- `claim(seq)`: right after an `attach` that did not wait: `seq` will compute the rest of its
  prompt, so later attaches that need those pages wait for it.
- `detach(seq, pool)`: undo `attach` (and `claim`) for a sequence that was not admitted this
  step (release its pages, reset its counts); it is looked up again later.
- `forget(seq)`: `seq` stopped computing: it finished (after `publish`), was paused, or left
  the queue. Its claims end, so the requests waiting for them look up again (and compute
  whatever it did not publish).
- `publish(seq, pool)`: when a sequence ends with STOP or LENGTH, before its pages are
  released; the cache retains the pages it wants to keep.
- `publish_progress(seq, pool)`: a running sequence just completed more full pages; the cache
  may share them at once, so a request arriving meanwhile reuses a prefill still running.
- `num_reclaimable_pages(at_most=None)`: pages held only by the cache (no running sequence
  uses them), counted up to `at_most` (the planner asks for what it needs, not the total).
- `reclaim(num_pages, pool)`: under pressure, before anyone is paused, release that many
  inactive pages back to the pool (least valuable first).
- `take_io()` / `complete_io(io, snapshots, pool)`: KV copies the cache queued (restores from
  its host tier, copy-on-write tails, demotions). The step task runs `snapshots =
  io.run(runner)` off the event loop after attaching and after reclaiming, before the next
  forward pass, when the batch is not empty.
- Hybrid models (recurrent state): a hit may also set `seq.start_state`, the checkpoint of the
  state after its `num_cached` tokens (the step task restores it into the runner when the
  sequence is admitted), and `seq.checkpoint_at`, a prompt position where the cache wants the
  state (prefill rows end there). `keep_checkpoint(seq, snapshot)`: the step task hands over
  the state the sequence reached at `checkpoint_at`, right after that row (False: not kept,
  and a device checkpoint's slot is the step task's to release). Runners with checkpoint
  slots: the step task takes the oldest device checkpoint out (`take_oldest_device_checkpoint`)
  when every slot is full, demotes it to a host copy and hands that back (`keep_demoted`).
- `statistics()`: a frozen record of the cache's counters (None when there is no cache).

`NoPrefixCache` implements all of them for "no cache" (nothing is ever shared); a hook that
needs only some of them (a test's, say) subclasses it.
"""

from __future__ import annotations

from typing import Protocol

from ninfer.cache.host_tier import CacheIO
from ninfer.cache.pages import PagePool
from ninfer.cache.prefix import PrefixCacheStatistics
from ninfer.core.runner import PageSnapshot, StateSnapshot
from ninfer.sched.sequence import Sequence


class PrefixCacheHook(Protocol):
    def attach(self, seq: Sequence, pool: PagePool) -> None: ...

    def claim(self, seq: Sequence) -> None: ...

    def detach(self, seq: Sequence, pool: PagePool) -> None: ...

    def forget(self, seq: Sequence) -> None: ...

    def publish(self, seq: Sequence, pool: PagePool) -> None: ...

    def publish_progress(self, seq: Sequence, pool: PagePool) -> None: ...

    def num_reclaimable_pages(self, at_most: int | None = None) -> int: ...

    def reclaim(self, num_pages: int, pool: PagePool) -> None: ...

    def keep_checkpoint(self, seq: Sequence, snapshot: StateSnapshot) -> bool: ...

    def take_oldest_device_checkpoint(self) -> tuple[object, StateSnapshot] | None: ...

    def keep_demoted(self, entry: object, snapshot: StateSnapshot) -> bool: ...

    def take_io(self) -> CacheIO: ...

    def complete_io(self, io: CacheIO, snapshots: list[PageSnapshot], pool: PagePool) -> None: ...

    def statistics(self) -> PrefixCacheStatistics | None: ...


class NoPrefixCache:
    """The default without a cache: every prompt is computed; nothing is retained."""

    def attach(self, seq: Sequence, pool: PagePool) -> None:
        pass

    def claim(self, seq: Sequence) -> None:
        pass

    def detach(self, seq: Sequence, pool: PagePool) -> None:
        pool.release(seq.pages)
        seq.pages = []
        seq.num_cached = seq.num_cached_prompt = 0
        seq.start_state, seq.checkpoint_at = None, 0

    def forget(self, seq: Sequence) -> None:
        pass

    def publish(self, seq: Sequence, pool: PagePool) -> None:
        pass

    def publish_progress(self, seq: Sequence, pool: PagePool) -> None:
        pass

    def num_reclaimable_pages(self, at_most: int | None = None) -> int:
        return 0

    def reclaim(self, num_pages: int, pool: PagePool) -> None:
        if num_pages:
            raise ValueError("NoPrefixCache holds no pages to reclaim")

    def keep_checkpoint(self, seq: Sequence, snapshot: StateSnapshot) -> bool:
        return False

    def take_oldest_device_checkpoint(self) -> tuple[object, StateSnapshot] | None:
        return None

    def keep_demoted(self, entry: object, snapshot: StateSnapshot) -> bool:
        return False

    def take_io(self) -> CacheIO:
        return CacheIO()

    def complete_io(self, io: CacheIO, snapshots: list[PageSnapshot], pool: PagePool) -> None:
        if io:
            raise ValueError("NoPrefixCache queues no KV copies")

    def statistics(self) -> None:
        return None
