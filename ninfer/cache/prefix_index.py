"""The prefix index: cached KV pages keyed by chained hashes of their token ids.

A page's key is blake2b(parent key | the page's token ids); the first page's parent is a root
key derived from the salt (the model / template salt and the request's `cache_salt`), so one
key names a whole prefix and tenants with different salts never share a page. A key only finds
a candidate: a hit also checks that the entry's parent is the verified entry before it, its salt
is the request's and its token ids are the page's, so a hash collision can never change output.

Entries hold full pages, plus the partially filled tail pages of finished sequences (leaves a
later prompt reuses by copy-on-write). The index keeps entries in least-recently-used order and
a parent is always more recent than its children (a touch moves the leaf first, the root last),
so an LRU scan meets leaves before the prefixes they grow from. Removing an entry removes its
descendants with it: they are unreachable without it.

Pure data: no page pool, no runner; `ninfer.cache.prefix` adds those.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from ninfer.core.runner import PageSnapshot, StateSnapshot

DEFAULT_KEY_BYTES = 16  # 128-bit keys: collisions are astronomically rare (and verified anyway)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The canonical bytes of token ids (int32, little-endian) that keys hash and entries store."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def salt_bytes(model_salt: bytes, cache_salt: str | None) -> bytes:
    """One salt for a request: the engine's model / template salt, then the tenant's cache_salt."""
    tenant = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return len(model_salt).to_bytes(4, "little") + model_salt + tenant


class Tier(enum.Enum):
    DEVICE = "device"  # the KV lives in a pool page the cache holds
    HOST = "host"  # the KV lives in a host snapshot; a hit restores it into a fresh page


@attrs.define(eq=False, repr=False)
class CacheEntry:
    """One cached page: where its KV lives and which prefix it continues."""

    key: bytes
    parent: CacheEntry | None  # None: the first page of a prompt
    salt: bytes
    tokens: bytes  # token_bytes of the page's tokens (fewer than page_size for a tail)
    page_id: int | None = None  # set on the device tier
    snapshot: PageSnapshot | None = None  # set on the host tier
    is_busy: bool = False  # a demotion to host is in flight: the page is still held
    is_removed: bool = False  # evicted while busy: the finished demotion is dropped
    last_used: int = 0  # the index's clock at the last touch: larger is more recent
    # hybrid models: the recurrent state after this page's last token (host memory), if kept
    checkpoint: StateSnapshot | None = None

    def __repr__(self) -> str:
        return f"CacheEntry({self.key.hex()[:8]}, {self.tier.value}, tokens={self.num_tokens})"

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def tier(self) -> Tier:
        return Tier.DEVICE if self.page_id is not None else Tier.HOST

    @property
    def parent_key(self) -> bytes | None:
        return None if self.parent is None else self.parent.key

    def continues(self, parent: CacheEntry | None, salt: bytes, tokens: bytes) -> bool:
        """True when this entry is exactly `tokens` after the verified prefix `parent`."""
        return self.parent is parent and self.salt == salt and self.tokens == tokens


class PrefixIndex:
    """Entries by key, in LRU order, with each parent's children for tail matching."""

    def __init__(self, page_size: int, *, key_bytes: int = DEFAULT_KEY_BYTES):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 1 <= key_bytes <= 64:
            raise ValueError(f"key_bytes must be between 1 and 64 (blake2b), got {key_bytes}")
        self.page_size = page_size
        self.key_bytes = key_bytes
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # least recent first
        # ... and those on the device (page_id set), in the same order: reclaiming walks these
        # alone, not the host entries before them (thousands on a busy server, every step)
        self._device: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._children: dict[bytes, dict[bytes, CacheEntry]] = {}  # parent or root key -> children
        self._clock = 0  # counts touches; orders recency across both tiers

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CacheEntry]:
        """Entries from least to most recently used."""
        return iter(self._entries.values())

    def on_device(self) -> Iterator[CacheEntry]:
        """The entries holding a page, from least to most recently used."""
        return iter(self._device.values())

    @property
    def num_on_device(self) -> int:
        return len(self._device)

    def set_page(self, entry: CacheEntry, page_id: int | None, *, touch_follows: bool = False) -> None:
        """Give an entry a page (it is on the device) or take it (None: on the host).
        `touch_follows`: the caller touches the entry next, which puts it last anyway."""
        entry.page_id = page_id
        if self._device.get(entry.key) is entry:
            del self._device[entry.key]
        if page_id is not None and self._entries.get(entry.key) is entry:
            if touch_follows:
                self._device[entry.key] = entry
            else:
                self._place_on_device(entry)

    def _place_on_device(self, entry: CacheEntry) -> None:
        """Into `_device` at its place by `last_used` (mostly the end: a page comes with a touch)."""
        later = []
        while self._device:
            last = next(reversed(self._device.values()))
            if last.last_used <= entry.last_used:
                break
            later.append(self._device.popitem()[1])
        self._device[entry.key] = entry
        for other in reversed(later):
            self._device[other.key] = other

    def __contains__(self, entry: CacheEntry) -> bool:
        return self._entries.get(entry.key) is entry

    # -- keys ----------------------------------------------------------------------------

    def root_key(self, salt: bytes) -> bytes:
        return hashlib.blake2b(salt, digest_size=self.key_bytes, person=b"ninfer-root").digest()

    def child_key(self, parent: CacheEntry | None, salt: bytes, tokens: bytes) -> bytes:
        parent_key = self.root_key(salt) if parent is None else parent.key
        return self._page_key(parent_key, tokens)

    def _page_key(self, parent_key: bytes, tokens: bytes) -> bytes:
        return hashlib.blake2b(parent_key + tokens, digest_size=self.key_bytes, person=b"ninfer-page").digest()

    def keys_after(self, parent_key: bytes, token_ids: np.ndarray, first_page: int) -> Iterator[bytes]:
        """The keys of the full pages of `token_ids` from page `first_page` on, cached or not,
        chained from `parent_key` (the key of page `first_page - 1`, or the root key)."""
        size = self.page_size
        for i in range(first_page, len(token_ids) // size):
            parent_key = self._page_key(parent_key, token_bytes(token_ids[i * size : (i + 1) * size]))
            yield parent_key

    # -- lookups -------------------------------------------------------------------------

    def find(self, parent: CacheEntry | None, salt: bytes, tokens: bytes) -> tuple[bytes, CacheEntry | None]:
        """(key, the verified entry or None). An entry under the key that fails to verify is a collision."""
        key = self.child_key(parent, salt, tokens)
        entry = self._entries.get(key)
        if entry is not None and not entry.continues(parent, salt, tokens):
            return key, None
        return key, entry

    def is_taken(self, key: bytes) -> bool:
        return key in self._entries

    def walk(self, salt: bytes, token_ids: np.ndarray, max_pages: int) -> list[CacheEntry]:
        """The chain of cached full pages that the tokens start with (at most `max_pages`)."""
        chain: list[CacheEntry] = []
        parent = None
        size = self.page_size
        for i in range(max_pages):
            _, entry = self.find(parent, salt, token_bytes(token_ids[i * size : (i + 1) * size]))
            if entry is None or entry.num_tokens != size:
                break
            chain.append(entry)
            parent = entry
        return chain

    def best_tail(
        self, parent: CacheEntry | None, salt: bytes, token_ids: np.ndarray
    ) -> tuple[CacheEntry | None, int]:
        """The child of `parent` sharing the longest run of leading tokens with `token_ids`."""
        best, best_len = None, 0
        wanted = np.asarray(token_ids[: self.page_size], dtype="<i4")
        for child in self._children_of(parent, salt).values():
            if child.salt != salt or child.parent is not parent:
                continue
            have = np.frombuffer(child.tokens, dtype="<i4")
            n = min(len(have), len(wanted))
            mismatch = np.flatnonzero(have[:n] != wanted[:n])
            common = int(mismatch[0]) if mismatch.size else n
            if common > best_len:
                best, best_len = child, common
        return best, best_len

    def children(self, parent: CacheEntry | None, salt: bytes) -> list[CacheEntry]:
        return list(self._children_of(parent, salt).values())

    def _children_of(self, parent: CacheEntry | None, salt: bytes) -> dict[bytes, CacheEntry]:
        parent_key = self.root_key(salt) if parent is None else parent.key
        return self._children.get(parent_key, {})

    # -- updates -------------------------------------------------------------------------

    def add(self, entry: CacheEntry) -> None:
        if entry.key in self._entries:
            raise ValueError(f"key {entry.key.hex()} is already cached")
        if entry.parent is not None and entry.parent not in self:
            raise ValueError("an entry's parent must be cached before it")
        self._entries[entry.key] = entry
        self._clock += 1
        entry.last_used = self._clock
        if entry.page_id is not None:
            self._device[entry.key] = entry
        self._children.setdefault(self._parent_key(entry), {})[entry.key] = entry

    def touch(self, chain: Sequence[CacheEntry]) -> None:
        """Mark a root-to-leaf chain most recently used, keeping each parent more recent than its children."""
        for entry in reversed(chain):
            self._entries.move_to_end(entry.key)
            if entry.page_id is not None:
                self._device.move_to_end(entry.key)
            self._clock += 1
            entry.last_used = self._clock

    def remove(self, entry: CacheEntry) -> list[CacheEntry]:
        """Remove the entry and every descendant; returns them, descendants first."""
        removed: list[CacheEntry] = []
        for child in list(self._children.get(entry.key, {}).values()):
            removed += self.remove(child)
        del self._entries[entry.key]
        if self._device.get(entry.key) is entry:
            del self._device[entry.key]
        self._children.pop(entry.key, None)
        siblings = self._children.get(self._parent_key(entry))
        if siblings is not None:
            siblings.pop(entry.key, None)
            if not siblings:
                del self._children[self._parent_key(entry)]
        removed.append(entry)
        return removed

    def _parent_key(self, entry: CacheEntry) -> bytes:
        return self.root_key(entry.salt) if entry.parent is None else entry.parent.key
