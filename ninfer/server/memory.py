"""The memory plan against the device's real figures (`GET /admin/vram`), refreshed in the
background so a request never waits for a device query or for the step task.

On CUDA the plan is the weights, the KV pool, the step's activation buffers and the reserve
(`--reserve-gib`) against the GPU's free and used memory (cudaMemGetInfo, device-wide, so other
processes count); what the device uses beyond the plan (CUDA graphs, the CUDA context, the
allocator's slack, other processes) is reported as `other_bytes`, since graphs do not say
what they hold. On the reference backend the "device" is host memory: the same plan against
MemTotal / MemAvailable and the process's resident set; activations are numpy temporaries of
each step (not planned, so null) and there are no graphs (0).
"""

from __future__ import annotations

import logging
import os
import time

import trio

from ninfer.runtime import device_memory

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0


class MemoryMonitor:
    """Measures in a worker thread every REFRESH_INTERVAL_S; `snapshot()` returns the last one."""

    def __init__(self, runner, backend: str, *, reserve_bytes: int, host_cache_bytes: int):
        self._runner = runner
        self.backend = backend
        self._reserve_bytes = reserve_bytes
        self._host_cache_bytes = host_cache_bytes
        self._last: dict | None = None
        self._measured_s = 0.0  # time.monotonic() of the last measurement
        self._error: str | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Measure once, report started, then keep refreshing until cancelled."""
        await self._refresh()
        task_status.started()
        while True:
            await trio.sleep(REFRESH_INTERVAL_S)
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            self._last = await trio.to_thread.run_sync(self.measure, abandon_on_cancel=True)
            self._measured_s, self._error = time.monotonic(), None
        except trio.Cancelled:
            raise
        except Exception as e:  # a failed query leaves the last figures, marked stale
            if self._error is None:
                log.warning("measuring device memory failed: %s", e)
            self._error = f"{type(e).__name__}: {e}"

    def snapshot(self) -> dict:
        """The last measurement with its age; never blocks."""
        if self._last is None:
            return {"device": self._device_name(), "error": self._error or "not measured yet", "age_s": None}
        body = {**self._last, "age_s": round(time.monotonic() - self._measured_s, 3)}
        if self._error is not None:
            body["error"] = self._error
        return body

    @property
    def used_bytes(self) -> int | None:
        return None if self._last is None else self._last["used_bytes"]

    def _device_name(self) -> str:
        return "cuda" if self.backend == "cuda" else "cpu"

    def measure(self) -> dict:
        """(in a worker thread) The plan and the device's figures now."""
        runner = self._runner
        free, total = device_memory(self.backend)
        weights = int(getattr(runner, "weight_nbytes", 0))
        kv_pool = int(runner.num_pages * runner.page_nbytes)
        is_cuda = self.backend == "cuda"
        activations = _device_arrays_nbytes(getattr(runner, "bufs", None)) if is_cuda else None
        planned = weights + kv_pool + (activations or 0)
        used = total - free
        body = {
            "device": self._device_name(), "measured_unix_s": round(time.time(), 3),
            "total_bytes": total, "free_bytes": free, "used_bytes": used,
            "plan": {
                "weights_bytes": weights, "kv_pool_bytes": kv_pool, "activations_bytes": activations,
                "graphs_bytes": None if is_cuda else 0, "reserve_bytes": self._reserve_bytes,
                "planned_bytes": planned,
            },
            "kv": {"num_pages": runner.num_pages, "page_size": runner.page_size, "page_nbytes": runner.page_nbytes},
            "host_tier_budget_bytes": self._host_cache_bytes,
        }  # fmt: skip
        if is_cuda:
            body["other_bytes"] = max(0, used - planned)  # graphs, context, slack, other processes
        else:
            body["process_rss_bytes"] = _process_rss_bytes()
        body["fits_reserve"] = free >= self._reserve_bytes
        return body


def _device_arrays_nbytes(buffers) -> int | None:
    """Bytes of the device arrays held as attributes of `buffers` (the CUDA runner's StepBuffers)."""
    if buffers is None:
        return None
    arrays = [v for v in vars(buffers).values() if hasattr(v, "__cuda_array_interface__")]
    return sum(int(a.nbytes) for a in arrays)


def _process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
