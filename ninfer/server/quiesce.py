"""Quiescing: drain the engine and hold it idle for a while (`POST /admin/quiesce`).

Every request that runs the model passes the `AdmissionGate` just before it is submitted to
the engine, and counts as inside until its engine work ended. Closing the gate holds new
requests at it (they wait, nothing is refused); the ones inside finish as usual. Once none is
inside the engine is idle: nothing runs, waits or is paused. `Quiescer.quiesce` closes the gate,
waits for that (within a bound), keeps the gate closed for `hold_s` in the background and
opens it again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio


class QuiesceConflict(Exception):
    """The engine cannot be quiesced now (answered 409 with this message)."""


class AdmissionGate:
    """Where requests wait while the engine is held idle; counts those inside."""

    def __init__(self) -> None:
        self.num_inside = 0
        self.num_held = 0  # requests waiting at the closed gate
        self._open = trio.Event()
        self._open.set()
        self._empty = trio.Event()
        self._empty.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @asynccontextmanager
    async def entered(self) -> AsyncIterator[None]:
        """Wait until the gate is open, then count as inside for the block."""
        if not self._open.is_set():
            self.num_held += 1
            try:
                while not self._open.is_set():  # a new hold may close it again before we run
                    await self._open.wait()
            finally:
                self.num_held -= 1
        self.num_inside += 1
        self._empty = trio.Event() if self._empty.is_set() else self._empty
        try:
            yield
        finally:
            self.num_inside -= 1
            if self.num_inside == 0:
                self._empty.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_empty(self) -> None:
        while self.num_inside:
            await self._empty.wait()


@attrs.frozen(kw_only=True)
class Quiesced:
    drain_s: float  # from the call until nothing was inside
    hold_s: float
    held_until_unix_s: float  # wall-clock time the gate opens again


class Quiescer:
    """Runs holds in `nursery`; one at a time."""

    def __init__(self, gate: AdmissionGate, nursery: trio.Nursery):
        self.gate = gate
        self._nursery = nursery
        self._hold_scope: trio.CancelScope | None = None
        self._held_until_unix_s = 0.0

    @property
    def is_quiesced(self) -> bool:
        return not self.gate.is_open

    @property
    def held_until_unix_s(self) -> float | None:
        return self._held_until_unix_s if self.is_quiesced else None

    async def quiesce(self, hold_s: float, max_drain_s: float) -> Quiesced:
        """Close the gate, wait until nothing is inside, hold `hold_s` (in the background).

        Raises QuiesceConflict when a quiesce is already draining or holding, or when the
        drain takes longer than `max_drain_s` (the gate then opens again at once).
        """
        if self.is_quiesced:
            raise QuiesceConflict("The engine is already quiesced (draining or held); wait for the hold to end "
                                  "or POST /admin/resume.")  # fmt: skip
        self.gate.close()
        started_s = trio.current_time()
        with trio.move_on_after(max_drain_s) as scope:
            await self.gate.wait_empty()
        if scope.cancelled_caught:
            self.gate.open()
            raise QuiesceConflict(f"The engine did not drain within {max_drain_s * 1000:g} ms "
                                  f"({self.gate.num_inside} requests still running); it was not held.")  # fmt: skip
        if self.gate.is_open:
            raise QuiesceConflict("The engine was resumed while it drained; it was not held.")
        drain_s = trio.current_time() - started_s
        self._held_until_unix_s = time.time() + hold_s
        self._hold_scope = trio.CancelScope()
        self._nursery.start_soon(self._hold, self._hold_scope, hold_s)
        return Quiesced(drain_s=drain_s, hold_s=hold_s, held_until_unix_s=self._held_until_unix_s)

    def resume(self) -> bool:
        """End a hold (or a drain in progress) early; whether one was on."""
        was_on = self.is_quiesced
        if self._hold_scope is not None:
            self._hold_scope.cancel()
        self.gate.open()
        return was_on

    async def _hold(self, scope: trio.CancelScope, hold_s: float) -> None:
        with scope:
            await trio.sleep(hold_s)
        if scope is self._hold_scope:
            self.gate.open()
