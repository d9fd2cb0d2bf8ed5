"""The graph twin's address rewrite (graphs.py), on CPU: the runner captures a bucket's graph
once and clones it for its other host mirror sets, moving each copy node's host address into
the same place of the other set's array. A wrong move would make a mirror's graph read another
step's inputs (tests/test_gpu_runner.py checks the replays against eager launches on a GPU)."""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver

from ninfer.gpu.cuda.graphs import _move_addresses, address_remap


def test_address_remap_moves_addresses_inside_the_spans_only():
    remap = address_remap([(5000, 100, 9000), (1000, 64, 20000)])
    assert remap(1000) == 20000
    assert remap(1063) == 20063
    assert remap(1064) is None  # one past the end
    assert remap(999) is None
    assert remap(5050) == 9050
    assert remap(5100) is None
    assert remap(0) is None
    assert remap(7000) is None


def test_address_remap_follows_real_arrays_offsets():
    a, b = np.zeros((3, 40), np.int32), np.zeros((3, 40), np.int32)
    c, d = np.zeros(7, np.float32), np.zeros(7, np.float32)
    remap = address_remap([(x.ctypes.data, x.nbytes, y.ctypes.data) for x, y in ((a, b), (c, d))])
    assert remap(a[2, 5:].ctypes.data) == b[2, 5:].ctypes.data
    assert remap(c[6:].ctypes.data) == d[6:].ctypes.data
    assert remap(b.ctypes.data) is None


def test_a_copy_node_moves_its_host_side_and_keeps_its_device_side():
    host_a, host_b = np.zeros(16, np.int32), np.zeros(16, np.int32)
    remap = address_remap([(host_a.ctypes.data, host_a.nbytes, host_b.ctypes.data)])
    up = driver.CUDA_MEMCPY3D()  # host -> device, as a captured upload records it
    up.srcMemoryType, up.srcHost = driver.CUmemorytype.CU_MEMORYTYPE_HOST, host_a.ctypes.data + 8
    up.dstMemoryType, up.dstDevice = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE, 0x7F0000001000
    assert _move_addresses(up, remap)
    assert up.srcHost == host_b.ctypes.data + 8
    assert int(up.dstDevice) == 0x7F0000001000

    down = driver.CUDA_MEMCPY3D()  # device -> host through a unified address
    down.srcMemoryType, down.srcDevice = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE, 0x7F0000002000
    down.dstMemoryType, down.dstDevice = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED, host_a.ctypes.data
    assert _move_addresses(down, remap)
    assert int(down.dstDevice) == host_b.ctypes.data
    assert int(down.srcDevice) == 0x7F0000002000

    other = driver.CUDA_MEMCPY3D()  # device -> device: nothing to move
    other.srcDevice, other.dstDevice = 0x7F0000003000, 0x7F0000004000
    assert not _move_addresses(other, remap)
