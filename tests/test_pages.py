"""The KV page pool: allocation, reference counts, the free list."""

import pytest

from ninfer.cache.pages import OutOfPages, PagePool, pages_for_tokens


@pytest.mark.parametrize(
    ("tokens", "page_size", "pages"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (8192, 16, 512), (5, 1, 5)],
)
def test_pages_for_tokens_rounds_up(tokens, page_size, pages):
    assert pages_for_tokens(tokens, page_size) == pages


def test_pages_for_tokens_rejects_nonsense():
    with pytest.raises(ValueError, match="page_size"):
        pages_for_tokens(4, 0)
    with pytest.raises(ValueError, match="negative"):
        pages_for_tokens(-1, 16)


def test_allocate_and_release_return_every_page():
    pool = PagePool(6)
    first = pool.allocate(4)
    assert len(set(first)) == 4 and pool.num_free == 2 and pool.num_used == 4
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(3)
    second = pool.allocate(2)
    assert not set(first) & set(second)
    pool.release(first)
    pool.release(second)
    assert pool.num_free == 6
    pool.check_consistent(holders=[])


def test_shared_pages_free_only_with_their_last_holder():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.retain(pages[:1])  # a second holder, e.g. a prefix-cache hit
    assert pool.refcount(pages[0]) == 2 and pool.is_shared(pages[0])
    assert pool.statistics().num_shared == 1
    pool.check_consistent(holders=[pages, pages[:1]])
    pool.release(pages)
    assert pool.num_free == 3 and pool.refcount(pages[0]) == 1
    pool.release(pages[:1])
    assert pool.num_free == 4
    pool.check_consistent(holders=[])


def test_misuse_is_caught():
    pool = PagePool(2)
    (page,) = pool.allocate(1)
    pool.release([page])
    with pytest.raises(ValueError, match="double release"):
        pool.release([page])
    with pytest.raises(ValueError, match="free"):
        pool.retain([page])
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0)


def test_consistency_check_detects_a_leak():
    pool = PagePool(3)
    held = pool.allocate(2)
    with pytest.raises(AssertionError, match="holders"):
        pool.check_consistent(holders=[held[:1]])
