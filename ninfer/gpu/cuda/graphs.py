"""CUDA graphs of numba launches through the driver API (`cuda.bindings.driver`).

Capture begins on the numba stream's own handle, the numba kernels are launched on that
stream as usual, and the captured graph is instantiated once; a replay (`cuGraphLaunch`) then
costs about a microsecond per kernel instead of ~25 us of Python launch overhead. Everything
captured must read static buffers only (the step's inputs are copied in before the replay).
Before instantiation, edges into PDL-aware kernels become programmatic (`programmatic_edges`,
pdl.py): the next kernel launches while the one before still runs. A graph that differs from
one already captured only in the host buffers its copies read and write (the runner's host
mirror sets) is cloned from it (`twin`) instead of captured again: a capture costs the
Python launch sequence, a clone a few driver calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from cuda.bindings import driver

from ninfer.gpu.cuda.kernels import pdl
from ninfer.gpu.cuda.kernels.intrinsics import pdl_supported


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
    """Instantiated graphs by key (the decode batch bucket), replayed on one stream.
    `programmatic`: PDL edges in captured graphs (KernelPlan.pdl; False: edges as captured)."""

    def __init__(self, stream, programmatic: bool = True):
        self._stream = stream
        self._programmatic = programmatic
        self._graphs: dict[object, tuple] = {}
        self.programmatic: dict[object, int] = {}  # programmatic edges per graph (pdl.py)

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
        self.programmatic[key] = programmatic_edges(graph) if self._programmatic and pdl_supported() else 0
        exe = check(driver.cuGraphInstantiate(graph, 0))
        self._graphs[key] = (graph, exe)

    def twin(self, key, new_key, remap: Callable[[int], int | None]) -> int:
        """Instantiate a clone of graph `key` as `new_key`, its copy nodes' addresses moved by
        `remap` (an address -> the new one, None: keep); returns how many nodes moved."""
        graph, _ = self._graphs[key]
        clone = check(driver.cuGraphClone(graph))
        moved = 0
        for node in _nodes(graph):
            if check(driver.cuGraphNodeGetType(node)) != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY:
                continue
            params = check(driver.cuGraphMemcpyNodeGetParams(node))
            if _move_addresses(params, remap):
                check(driver.cuGraphMemcpyNodeSetParams(check(driver.cuGraphNodeFindInClone(node, clone)), params))
                moved += 1
        exe = check(driver.cuGraphInstantiate(clone, 0))
        self._graphs[new_key] = (clone, exe)
        self.programmatic[new_key] = self.programmatic[key]
        return moved

    def replay(self, key) -> None:
        check(driver.cuGraphLaunch(self._graphs[key][1], stream_handle(self._stream)))

    def num_nodes(self, key) -> int:
        return int(check(driver.cuGraphGetNodes(self._graphs[key][0], 0))[1])

    def discard(self, key) -> None:
        """Forget graph `key`, if there is one."""
        entry = self._graphs.pop(key, None)
        self.programmatic.pop(key, None)
        if entry is not None:
            driver.cuGraphExecDestroy(entry[1])
            driver.cuGraphDestroy(entry[0])

    def close(self) -> None:
        for graph, exe in self._graphs.values():
            driver.cuGraphExecDestroy(exe)
            driver.cuGraphDestroy(graph)
        self._graphs.clear()
        self.programmatic.clear()


def _nodes(graph) -> list:
    n = check(driver.cuGraphGetNodes(graph, 0))[1]
    nodes, n = check(driver.cuGraphGetNodes(graph, n))
    return list(nodes[:n])


_ADDRESS_FIELDS = ("srcHost", "srcDevice", "dstHost", "dstDevice")


def _move_addresses(params, remap: Callable[[int], int | None]) -> bool:
    """Rewrite the source and destination addresses of a memcpy node's parameters through
    `remap` (whichever field the capture filled: host, or device for unified addresses)."""
    moved = False
    for field in _ADDRESS_FIELDS:
        new = remap(int(getattr(params, field)))
        if new is not None:
            setattr(params, field, new)
            moved = True
    return moved


def address_remap(spans) -> Callable[[int], int | None]:
    """`spans`: (start, nbytes, new start) of buffers that move; the function maps an address
    inside one of them to the same offset in its new place, and any other address to None."""
    spans = sorted(spans)
    starts = [s for s, _, _ in spans]

    def remap(address: int) -> int | None:
        i = bisect.bisect_right(starts, address) - 1
        if i < 0:
            return None
        start, nbytes, new = spans[i]
        return new + (address - start) if address < start + nbytes else None

    return remap


def _edges_api():
    """cuGraphGetEdges / Add / RemoveDependencies with edge data (the `_v2` names of CUDA 12)."""
    names = ("cuGraphGetEdges", "cuGraphAddDependencies", "cuGraphRemoveDependencies")
    return [getattr(driver, n + "_v2", None) or getattr(driver, n) for n in names]


def _kernel_name(node, cache: dict) -> str | None:
    """The mangled name of a kernel node's function (None for other nodes)."""
    if check(driver.cuGraphNodeGetType(node)) != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    func = check(driver.cuGraphKernelNodeGetParams(node)).func
    key = int(func)
    if key not in cache:
        name = check(driver.cuFuncGetName(func))
        cache[key] = name.decode() if isinstance(name, bytes) else str(name)
    return cache[key]


def programmatic_edges(graph) -> int:
    """Turn each kernel -> kernel edge of `graph` whose dependent kernel is PDL-aware (pdl.py)
    into a programmatic edge; returns how many were turned."""
    get_edges, add, remove = _edges_api()
    n = check(get_edges(graph, 0))[-1]
    frm, to, data, n = check(get_edges(graph, n))
    names: dict = {}
    turned = 0
    for a, b, d in zip(frm[:n], to[:n], data[:n], strict=True):
        if d.type != driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT:
            continue
        na, nb = _kernel_name(a, names), _kernel_name(b, names)
        if na is None or nb is None or not pdl.is_aware(nb):
            continue
        e = driver.CUgraphEdgeData()
        e.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        e.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        check(remove(graph, [a], [b], [d], 1))
        check(add(graph, [a], [b], [e], 1))
        turned += 1
    return turned


def memcpy_htod(dst_dev, src_host, nbytes: int, stream) -> None:
    """Async copy of the first `nbytes` of a pinned host array into a device array."""
    if nbytes:
        check(driver.cuMemcpyHtoDAsync(dst_dev.__cuda_array_interface__["data"][0], src_host.ctypes.data, nbytes,
                                       stream_handle(stream)))  # fmt: skip


def memcpy2d_htod(dst_dev, src_host, width: int, stream) -> None:
    """Async copy of the first `width` bytes of every row of a pinned 2-D host array into the
    device array of the same shape (one copy node when captured, whatever the row count)."""
    if not width:
        return
    c = driver.CUDA_MEMCPY2D()
    c.srcMemoryType, c.srcHost, c.srcPitch = driver.CUmemorytype.CU_MEMORYTYPE_HOST, src_host.ctypes.data, src_host.strides[0]
    c.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    c.dstDevice, c.dstPitch = dst_dev.__cuda_array_interface__["data"][0], dst_dev.strides[0]
    c.WidthInBytes, c.Height = width, src_host.shape[0]
    check(driver.cuMemcpy2DAsync(c, stream_handle(stream)))


def memcpy_dtoh(dst_host, src_dev, nbytes: int, stream) -> None:
    if nbytes:
        check(driver.cuMemcpyDtoHAsync(dst_host.ctypes.data, src_dev.__cuda_array_interface__["data"][0], nbytes,
                                       stream_handle(stream)))  # fmt: skip

