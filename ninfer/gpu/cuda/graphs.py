"""CUDA graphs of numba launches through the driver API (`cuda.bindings.driver`).

Capture begins on the numba stream's own handle, the numba kernels are launched on that
stream as usual, and the captured graph is instantiated once; a replay (`cuGraphLaunch`) then
costs about a microsecond per kernel instead of ~25 us of Python launch overhead. Everything
captured must read static buffers only (the step's inputs are copied in before the replay).
"""

from __future__ import annotations

from collections.abc import Callable

from cuda.bindings import driver


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed."""


def check(result):
    """Unwrap a cuda.bindings result tuple, raising on an error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaDriverError(f"CUDA driver call failed: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def stream_handle(stream) -> int:
    return int(stream.handle)


class GraphCache:
    """Instantiated graphs by key (the decode batch bucket), replayed on one stream."""

    def __init__(self, stream):
        self._stream = stream
        self._graphs: dict[object, tuple] = {}

    def __contains__(self, key) -> bool:
        return key in self._graphs

    def keys(self) -> list:
        return list(self._graphs)

    def capture(self, key, launch: Callable[[], None]) -> None:
        """Record `launch()`'s kernels on the stream as graph `key` (nothing runs now)."""
        h = stream_handle(self._stream)
        check(driver.cuStreamBeginCapture(h, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            launch()
        finally:
            graph = check(driver.cuStreamEndCapture(h))
        exe = check(driver.cuGraphInstantiate(graph, 0))
        self._graphs[key] = (graph, exe)

    def replay(self, key) -> None:
        check(driver.cuGraphLaunch(self._graphs[key][1], stream_handle(self._stream)))

    def num_nodes(self, key) -> int:
        return int(check(driver.cuGraphGetNodes(self._graphs[key][0], 0))[1])

    def close(self) -> None:
        for graph, exe in self._graphs.values():
            driver.cuGraphExecDestroy(exe)
            driver.cuGraphDestroy(graph)
        self._graphs.clear()


def memcpy_htod(dst_dev, src_host, nbytes: int, stream) -> None:
    """Async copy of the first `nbytes` of a pinned host array into a device array."""
    if nbytes:
        check(driver.cuMemcpyHtoDAsync(dst_dev.__cuda_array_interface__["data"][0], src_host.ctypes.data, nbytes,
                                       stream_handle(stream)))  # fmt: skip


def memcpy_dtoh(dst_host, src_dev, nbytes: int, stream) -> None:
    if nbytes:
        check(driver.cuMemcpyDtoHAsync(dst_host.ctypes.data, src_dev.__cuda_array_interface__["data"][0], nbytes,
                                       stream_handle(stream)))  # fmt: skip
