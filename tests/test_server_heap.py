"""ninfer.server.heap: the collector settings a server applies while it runs, and the pauses it
counts. Real `gc` calls in this process; each test leaves Python's settings as it found them."""

from __future__ import annotations

import gc

import pytest

from ninfer.server import heap


@pytest.fixture(autouse=True)
def python_defaults():
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0 and heap.PAUSES not in gc.callbacks, "a server of another test is still running"
    yield threshold
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0 and heap.PAUSES not in gc.callbacks


def test_quiet_freezes_the_live_heap_raises_the_young_threshold_and_restores_both(python_defaults):
    alive = [[i] for i in range(1000)]  # containers alive at entry join the frozen part
    with heap.quiet(freeze=True):
        assert gc.get_freeze_count() >= len(alive)
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *python_defaults[1:])
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == python_defaults


def test_overlapping_servers_restore_pythons_settings_when_the_last_one_leaves(python_defaults):
    first, second = heap.quiet(freeze=True), heap.quiet(freeze=True)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not last in, first out: the second still runs frozen
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    assert heap.PAUSES in gc.callbacks
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == python_defaults


def test_collections_are_counted_only_while_a_server_runs(python_defaults):
    before = list(heap.PAUSES.collections)
    gc.collect()
    assert heap.PAUSES.collections == before  # no server: no callback
    with heap.quiet(freeze=False) as pauses:
        assert gc.get_threshold() == python_defaults and gc.get_freeze_count() == 0  # --no-gc-freeze
        seconds = pauses.seconds[2]
        gc.collect()
        gc.collect(0)
    assert pauses.collections[2] == before[2] + 1 and pauses.collections[0] >= before[0] + 1
    assert pauses.seconds[2] > seconds
