"""PTX instructions numba does not wrap, and warp reductions, each with a simulator twin.

GPU builds reach `dp4a`, 16-, 8- and 4-byte vector loads (`ld8`: eight f16 / f32 as float32),
bit casts, f16x2 packing and `mma.sync` through `@intrinsic`s whose codegen emits llvmlite
`InlineAsm`. numba's CUDA simulator runs kernels as Python and has no warp shuffles, so under
`NUMBA_ENABLE_CUDASIM=1` every name here is a plain-Python (or shared-memory) version with the
same result. Rules for callers:

* call the warp / group reductions from uniform control flow with the whole block active
  (the simulator twins use `syncthreads`, the GPU versions full-warp shuffles);
* blocks are one-dimensional (lane = threadIdx.x % 32).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import config, cuda, float32, int32, int64, types, uint32, uint64

SIMULATOR = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF


@functools.cache
def pdl_supported() -> bool:
    """Whether kernels get the `griddepcontrol` instructions: compute capability 9.0 or newer,
    or no GPU at all (PTX built on a CPU machine for sm_90 / sm_120a)."""
    if SIMULATOR or not cuda.is_available():
        return True
    return cuda.get_current_device().compute_capability >= (9, 0)


def device(fn):
    """`cuda.jit(device=True)` on the GPU; under the simulator the plain function, because a
    simulated call of a jitted device function swaps module globals on every call (slow)."""
    return fn if SIMULATOR else cuda.jit(device=True)(fn)


# splitmix64 constants of ninfer.gpu.sampling.uniform
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

if not SIMULATOR:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _asm_call(builder, ret_ir, arg_irs, text, constraints, args, side_effect=False):
        fnty = ir.FunctionType(ret_ir, arg_irs)
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def _as_i32(context, builder, sig, args):
        return [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]

    @intrinsic
    def dp4a(typingctx, a, b, c):
        """Sum of the four signed-byte products of a and b, plus c (int32)."""
        sig = types.int32(a, b, c)

        def codegen(context, builder, signature, args):
            vals = _as_i32(context, builder, signature, args)
            return _asm_call(builder, _I32, [_I32] * 3, "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", vals)

        return sig, codegen

    def _elem_addr(context, builder, signature, args, idx32=False):
        """The address of arr[i0, i1, ...] (no wraparound). `idx32` (C-contiguous arrays of
        fewer than 2**32 elements): the element offset in 32-bit unsigned arithmetic, which
        lets LLVM narrow the caller's index math too (64-bit multiplies and sign handling are
        most of a small kernel's instructions otherwise)."""
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        if idx32 and aryty.layout == "C":
            inds = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[1:], signature.args[1:])]
            shapes = cgutils.unpack_tuple(builder, ary.shape, aryty.ndim)
            lin = inds[0]
            for ind, dim in zip(inds[1:], shapes[1:]):
                lin = builder.add(builder.mul(lin, builder.trunc(dim, _I32), flags=["nuw"]), ind, flags=["nuw"])
            ptr = builder.gep(ary.data, [builder.zext(lin, ir.IntType(64))], inbounds=True)
            return builder.ptrtoint(ptr, ir.IntType(64))
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _make_ld4(elem_type, elem_ir, reg, ptx_type, space="global.nc", pinned=False, evict_first=False):
        """A 16-byte load; `pinned`: a side-effecting asm that stays where the source puts it;
        `evict_first`: its L2 lines are the first to go (a stream read once a step: weights)."""

        @intrinsic
        def ld4(typingctx, arr, row, col):
            """Four consecutive elements arr[row, col:col+4] in one 16-byte load (col % 4 == 0)."""
            ret = types.UniTuple(elem_type, 4)
            sig = ret(arr, row, col)

            def codegen(context, builder, signature, args):
                addr = _elem_addr(context, builder, signature, args)
                st = ir.LiteralStructType([elem_ir] * 4)
                text = f"ld.{space}.v4.{ptx_type} {{$0,$1,$2,$3}}, [$4];"
                if evict_first:
                    text = ("{ .reg .b64 pol; createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
                            f"ld.{space}.L2::cache_hint.v4.{ptx_type} {{$0,$1,$2,$3}}, [$4], pol; }}")
                cons = f"={reg},={reg},={reg},={reg},l"
                res = _asm_call(builder, st, [ir.IntType(64)], text, cons, [addr], side_effect=pinned)
                return context.make_tuple(builder, ret, [builder.extract_value(res, i) for i in range(4)])

            return sig, codegen

        return ld4

    ld4_u32 = _make_ld4(types.uint32, _I32, "r", "u32")
    ld4_u32_stream = _make_ld4(types.uint32, _I32, "r", "u32", evict_first=True)
    ld4_f32 = _make_ld4(types.float32, _F32, "f", "f32")
    # a coherent load that ptxas keeps on its side of a barrier (the `.nc` one may move across
    # bar.sync; the GEMM needs its activation loads issued before the barrier and the mma)
    ld4_f32_pinned = _make_ld4(types.float32, _F32, "f", "f32", space="global", pinned=True)
    # Programmatic dependent launch (pdl.py): a kernel may start before the one whose output it
    # reads has finished, so that output is not read-only during its lifetime and `.nc` loads of
    # it (which ptxas may also move above griddepcontrol.wait) can return stale data. Aware
    # kernels read predecessors' outputs with these coherent, pinned loads; weights stay `.nc`.
    ld4_u32_pinned = _make_ld4(types.uint32, _I32, "r", "u32", space="global", pinned=True)

    def _pair_codegen(text, pinned=False):
        def codegen(context, builder, signature, args):
            addr = _elem_addr(context, builder, signature, args)
            st = ir.LiteralStructType([_F32, _F32])
            res = _asm_call(builder, st, [ir.IntType(64)], text, "=f,=f,l", [addr], side_effect=pinned)
            ret = types.UniTuple(types.float32, 2)
            return context.make_tuple(builder, ret, [builder.extract_value(res, i) for i in range(2)])

        return codegen

    def _grid_dep(text):
        """A `griddepcontrol` instruction (sm_90+; nothing where the GPU present is older)."""

        def codegen(context, builder, signature, args):
            if pdl_supported():
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def grid_dep_wait(typingctx):
        """Programmatic dependent launch: block until the grids this one depends on through a
        programmatic graph edge have completed and their memory is visible (at once where there
        is no such edge). Every read of a predecessor's output and every write a predecessor
        may still read must come after it."""
        return _grid_dep("griddepcontrol.wait;")

    @intrinsic
    def grid_dep_launch(typingctx):
        """Programmatic dependent launch: this block lets the next grid of a programmatic edge
        start (it starts once every block of this grid has called this or exited)."""
        return _grid_dep("griddepcontrol.launch_dependents;")

    @intrinsic
    def ld_f32_cg(typingctx, arr, i0, i1, i2, i3):
        """arr[i0, i1, i2, i3] (float32; C-contiguous, fewer than 2**32 elements) from L2, never
        L1: data other blocks of this kernel, or the kernel before under PDL, wrote."""
        sig = types.float32(arr, i0, i1, i2, i3)

        def codegen(context, builder, signature, args):
            addr = _elem_addr(context, builder, signature, args, idx32=True)
            return _asm_call(builder, _F32, [ir.IntType(64)], "ld.global.cg.f32 $0, [$1];", "=f,l", [addr], True)

        return sig, codegen

    @intrinsic
    def ld2_f32(typingctx, arr, row, col):
        """arr[row, col], arr[row, col + 1] (float32, col even) in one 8-byte load."""
        sig = types.UniTuple(types.float32, 2)(arr, row, col)
        return sig, _pair_codegen("ld.global.nc.v2.f32 {$0,$1}, [$2];")

    @intrinsic
    def ld2_f32_pinned(typingctx, arr, row, col):
        """ld2_f32 as a coherent, pinned load (a predecessor's output under PDL: see ld4_u32_pinned)."""
        sig = types.UniTuple(types.float32, 2)(arr, row, col)
        return sig, _pair_codegen("ld.global.v2.f32 {$0,$1}, [$2];", pinned=True)

    @intrinsic
    def ld_h2(typingctx, arr, row, col):
        """arr[row, col], arr[row, col + 1] (float16, col even) as float32, in one 4-byte load."""
        sig = types.UniTuple(types.float32, 2)(arr, row, col)
        text = ("{ .reg .b32 t; .reg .b16 lo, hi; ld.global.nc.b32 t, [$2]; mov.b32 {lo, hi}, t; "
                "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")
        return sig, _pair_codegen(text)

    @intrinsic
    def bits_to_f32(typingctx, bits):
        """Reinterpret a 32-bit integer as float32."""
        sig = types.float32(bits)

        def codegen(context, builder, signature, args):
            (v,) = _as_i32(context, builder, signature, args)
            return builder.bitcast(v, _F32)

        return sig, codegen

    @intrinsic
    def f32_to_bits(typingctx, x):
        """Reinterpret a float32 as uint32."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.float32)
            return builder.bitcast(v, _I32)

        return sig, codegen

    @intrinsic
    def pack_half2(typingctx, lo, hi):
        """Two float32 rounded to f16 and packed: lo in bits 0-15, hi in bits 16-31."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            return _asm_call(builder, _I32, [_F32, _F32], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [args[1], args[0]])

        return sig, codegen

    @intrinsic
    def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        ret = types.UniTuple(types.float32, 4)
        sig = ret(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, signature, args):
            st = ir.LiteralStructType([_F32] * 4)
            text = (
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
            )
            cons = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)
            res = _asm_call(builder, st, [_I32] * 6 + [_F32] * 4, text, cons, list(args))
            return context.make_tuple(builder, ret, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    mma_m16n8k16 = _mma

    def _make_ld8(space="global.nc", pinned=False):
        """`ld8` on the read-only path, or (`pinned`) a coherent one that stays where the source
        puts it: for data the same kernel wrote before a barrier (`.nc` may serve stale lines
        and may be moved across bar.sync)."""

        @intrinsic
        def ld8(typingctx, arr, i0, i1, i2, i3):
            """arr[i0, i1, i2, i3 : i3 + 8] as eight float32 (a float16 or float32 array; the first
            element 16-byte aligned): one 16-byte load (float16) or two (float32). The array is
            C-contiguous with fewer than 2**32 elements (a KV pool layer; the offset is 32-bit)."""
            if not isinstance(arr, types.Array) or arr.dtype not in (types.float16, types.float32):
                return None
            ret = types.UniTuple(types.float32, 8)
            sig = ret(arr, i0, i1, i2, i3)
            if arr.dtype == types.float16:
                text = (
                    "{ .reg .b32 t0, t1, t2, t3; .reg .b16 h0, h1, h2, h3, h4, h5, h6, h7; "
                    f"ld.{space}.v4.b32 {{t0, t1, t2, t3}}, [$8]; "
                    "mov.b32 {h0, h1}, t0; mov.b32 {h2, h3}, t1; mov.b32 {h4, h5}, t2; mov.b32 {h6, h7}, t3; "
                    + " ".join(f"cvt.f32.f16 ${k}, h{k};" for k in range(8))
                    + " }"
                )
            else:
                text = f"ld.{space}.v4.f32 {{$0, $1, $2, $3}}, [$8]; ld.{space}.v4.f32 {{$4, $5, $6, $7}}, [$8+16];"

            def codegen(context, builder, signature, args):
                addr = _elem_addr(context, builder, signature, args, idx32=True)
                st = ir.LiteralStructType([ir.FloatType()] * 8)
                res = _asm_call(builder, st, [ir.IntType(64)], text, "=f," * 8 + "l", [addr], side_effect=pinned)
                return context.make_tuple(builder, ret, [builder.extract_value(res, k) for k in range(8)])

            return sig, codegen

        return ld8

    ld8 = _make_ld8()
    ld8_pinned = _make_ld8("global", pinned=True)
    ld8_cg = _make_ld8("global.cg", pinned=True)  # from L2, never L1 (a line the kernel may hold stale)

    @intrinsic
    def st8_f32(typingctx, arr, i0, i1, i2, i3, vals):
        """arr[i0, i1, i2, i3 : i3 + 8] = vals (eight float32; a C-contiguous float32 array of
        fewer than 2**32 elements, the first element 16-byte aligned): two 16-byte stores."""
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and isinstance(vals, types.UniTuple)
                and vals.count == 8 and vals.dtype == types.float32):  # fmt: skip
            return None
        sig = types.void(arr, i0, i1, i2, i3, vals)

        def codegen(context, builder, signature, args):
            addr = _elem_addr(context, builder, signature.replace(args=signature.args[:5]), args[:5], idx32=True)
            vs = [builder.extract_value(args[5], k) for k in range(8)]
            text = "st.global.v4.f32 [$0], {$1, $2, $3, $4}; st.global.v4.f32 [$0+16], {$5, $6, $7, $8};"
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [_F32] * 8)
            builder.call(ir.InlineAsm(fnty, text, "l" + ",f" * 8, side_effect=True), [addr, *vs])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def shfl_xor(v, off):
        """v of lane ^ off (the whole warp takes part)."""
        return cuda.shfl_xor_sync(FULL_MASK, v, off)

    @cuda.jit(device=True, inline=True)
    def group_sum(v, width):
        """Sum of v over each aligned group of `width` lanes (width a power of two <= 32)."""
        off = width >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        return v

    @cuda.jit(device=True, inline=True)
    def group_max(v, width):
        off = width >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        return v

    @cuda.jit(device=True, inline=True)
    def warp_max_u64(v):
        """Largest uint64 over the warp (keys for arg-max with tie rules)."""
        off = 16
        while off > 0:
            v = max(v, uint64(cuda.shfl_xor_sync(FULL_MASK, int64(v), off)))
            off >>= 1
        return v

    @cuda.jit(device=True, inline=True)
    def warp_sum_u64(v):
        """Sum of a uint64 over the warp (exact: fixed-point weights in the sampler)."""
        off = 16
        while off > 0:
            v = v + uint64(cuda.shfl_xor_sync(FULL_MASK, int64(v), off))
            off >>= 1
        return v

else:
    _M32 = 0xFFFFFFFF

    def _i8(x):
        return x - 256 if x > 127 else x

    def dp4a(a, b, c):
        a = int(a) & _M32
        b = int(b) & _M32
        s = int(c)
        for i in range(4):
            s += _i8((a >> (8 * i)) & 0xFF) * _i8((b >> (8 * i)) & 0xFF)
        return np.int32(((s + 2**31) & _M32) - 2**31)

    def ld4_u32(arr, row, col):
        return (uint32(arr[row, col]), uint32(arr[row, col + 1]), uint32(arr[row, col + 2]), uint32(arr[row, col + 3]))

    def ld4_f32(arr, row, col):
        return (float32(arr[row, col]), float32(arr[row, col + 1]), float32(arr[row, col + 2]), float32(arr[row, col + 3]))

    ld4_f32_pinned = ld4_f32
    ld4_u32_pinned = ld4_u32
    ld4_u32_stream = ld4_u32

    def ld_f32_cg(arr, i0, i1, i2, i3):
        return float32(arr[i0, i1, i2, i3])

    def ld2_f32(arr, row, col):
        return (float32(arr[row, col]), float32(arr[row, col + 1]))

    ld_h2 = ld2_f32
    ld2_f32_pinned = ld2_f32

    def grid_dep_wait():
        pass  # the simulator runs one grid at a time

    def grid_dep_launch():
        pass

    def bits_to_f32(bits):
        return np.array([int(bits) & _M32], dtype=np.uint32).view(np.float32)[0]

    def f32_to_bits(x):
        return np.array([x], dtype=np.float32).view(np.uint32)[0]

    def pack_half2(lo, hi):
        h = np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
        return np.uint32(h[0] | (h[1] << 16))

    def _halves(word):
        w = int(word) & _M32
        return np.array([w & 0xFFFF, w >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)

    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """The warp-wide product through a lane exchange, with PTX's fragment layout (lane =
        4 * g + t): A 16x16 row-major {a0: (g, 2t..), a1: (g+8, 2t..), a2: (g, 2t+8..), a3:
        (g+8, 2t+8..)}, B 16x8 {b0: (k 2t.., n g), b1: (k 2t+8.., n g)}, C 16x8 {c0, c1: (g,
        2t..), c2, c3: (g+8, 2t..)}. Every lane of the warp must call it."""
        vals, lane = _warp_values((a0, a1, a2, a3, b0, b1))
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        for ln, regs in enumerate(vals):
            g, t = ln // 4, ln % 4
            for reg, (r, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                a[r, k : k + 2] = _halves(regs[reg])
            for reg, k in enumerate((2 * t, 2 * t + 8)):
                b[k : k + 2, g] = _halves(regs[4 + reg])
        g, t = lane // 4, lane % 4
        c = a[[g, g + 8]][:, :] @ b[:, [2 * t, 2 * t + 1]]
        return (float32(c0 + c[0, 0]), float32(c1 + c[0, 1]), float32(c2 + c[1, 0]), float32(c3 + c[1, 1]))

    import threading

    _exchanges_lock = threading.Lock()

    def _warp_values(v):
        """All 32 lanes' values of v (every lane of the warp must call): a warp-local
        exchange through a Python barrier, much cheaper in the simulator than syncthreads.
        The exchange lives on the block's manager, so no state outlives the block."""
        t = threading.current_thread()
        lane = t.thread_id % 32
        warp = t.thread_id // 32
        with _exchanges_lock:
            table = t._manager.__dict__.setdefault("_ninfer_warps", {})
            ex = table.get(warp)
            if ex is None:
                bx, by, bz = t._manager._block_dim
                lanes = min(32, bx * by * bz - 32 * warp)
                ex = table[warp] = ([None] * 32, threading.Barrier(lanes, timeout=120))
        vals, barrier = ex
        vals[lane] = v
        barrier.wait()
        out = list(vals)
        barrier.wait()  # nobody overwrites a value before every lane has read it
        return out, lane

    def group_sum(v, width):
        vals, lane = _warp_values(v)
        base = lane - lane % width
        acc = vals[base]
        for i in range(1, width):
            if vals[base + i] is None:  # a partial warp: missing lanes contribute nothing
                break
            acc = acc + vals[base + i]
        return type(v)(acc) if isinstance(v, np.generic) else float32(acc)

    def group_max(v, width):
        vals, lane = _warp_values(v)
        base = lane - lane % width
        return max(x for x in vals[base : base + width] if x is not None)

    def warp_max_u64(v):
        vals, _ = _warp_values(v)
        return uint64(max(int(x) for x in vals if x is not None))

    def warp_sum_u64(v):
        vals, _ = _warp_values(v)
        return uint64(sum(int(x) for x in vals if x is not None))

    def ld8(arr, i0, i1, i2, i3):
        return tuple(float32(arr[i0, i1, i2, i3 + k]) for k in range(8))

    ld8_pinned = ld8
    ld8_cg = ld8

    def st8_f32(arr, i0, i1, i2, i3, vals):
        for k in range(8):
            arr[i0, i1, i2, i3 + k] = vals[k]

    def shfl_xor(v, off):
        vals, lane = _warp_values(v)
        return vals[lane ^ off]


@device
def warp_sum(v):
    return group_sum(v, 32)


@device
def warp_max(v):
    return group_max(v, 32)


@cuda.jit(device=True)
def block_sum(v, scratch):
    """Sum of v over the block; every thread gets it. scratch: shared float32[>= 33]."""
    lane = cuda.threadIdx.x % 32
    warp = cuda.threadIdx.x // 32
    nwarps = (cuda.blockDim.x + 31) // 32
    s = warp_sum(v)
    if lane == 0:
        scratch[warp] = s
    cuda.syncthreads()
    t = scratch[lane] if lane < nwarps else float32(0.0)
    t = warp_sum(t)
    if cuda.threadIdx.x == 0:
        scratch[32] = t
    cuda.syncthreads()
    out = scratch[32]
    cuda.syncthreads()
    return out


@cuda.jit(device=True)
def block_max(v, scratch):
    """Max of v over the block; every thread gets it. scratch: shared float32[>= 33]."""
    lane = cuda.threadIdx.x % 32
    warp = cuda.threadIdx.x // 32
    nwarps = (cuda.blockDim.x + 31) // 32
    s = warp_max(v)
    if lane == 0:
        scratch[warp] = s
    cuda.syncthreads()
    t = scratch[lane] if lane < nwarps else float32(-np.inf)
    t = warp_max(t)
    if cuda.threadIdx.x == 0:
        scratch[32] = t
    cuda.syncthreads()
    out = scratch[32]
    cuda.syncthreads()
    return out


@cuda.jit(device=True)
def block_max_u64(v, scratch):
    """Max of a uint64 over the block; every thread gets it. scratch: shared uint64[>= 33]."""
    lane = cuda.threadIdx.x % 32
    warp = cuda.threadIdx.x // 32
    nwarps = (cuda.blockDim.x + 31) // 32
    s = warp_max_u64(v)
    if lane == 0:
        scratch[warp] = s
    cuda.syncthreads()
    t = scratch[lane] if lane < nwarps else uint64(0)
    t = warp_max_u64(t)
    if cuda.threadIdx.x == 0:
        scratch[32] = t
    cuda.syncthreads()
    out = scratch[32]
    cuda.syncthreads()
    return out


@cuda.jit(device=True)
def block_sum_u64(v, scratch):
    """Exact sum of a uint64 over the block; every thread gets it. scratch: shared uint64[>= 33]."""
    lane = cuda.threadIdx.x % 32
    warp = cuda.threadIdx.x // 32
    nwarps = (cuda.blockDim.x + 31) // 32
    s = warp_sum_u64(v)
    if lane == 0:
        scratch[warp] = s
    cuda.syncthreads()
    t = scratch[lane] if lane < nwarps else uint64(0)
    t = warp_sum_u64(t)
    if cuda.threadIdx.x == 0:
        scratch[32] = t
    cuda.syncthreads()
    out = scratch[32]
    cuda.syncthreads()
    return out


if SIMULATOR:

    def uniform(seed, index):
        m = (1 << 64) - 1
        x = (int(seed) + (int(index) + 1) * _GOLDEN_GAMMA) & m
        x = ((x ^ (x >> 30)) * _MIX1) & m
        x = ((x ^ (x >> 27)) * _MIX2) & m
        x ^= x >> 31
        return np.float32((x >> 40) / float(1 << 24))

else:

    @device
    def uniform(seed, index):
        """ninfer.gpu.sampling.uniform in wrapping uint64 arithmetic (seed: uint64)."""
        x = uint64(seed) + (uint64(index) + uint64(1)) * uint64(_GOLDEN_GAMMA)
        x = (x ^ (x >> uint64(30))) * uint64(_MIX1)
        x = (x ^ (x >> uint64(27))) * uint64(_MIX2)
        x = x ^ (x >> uint64(31))
        return float32(int32(x >> uint64(40))) * float32(1.0 / (1 << 24))


@device
def order_key(z, index):
    """A uint64 that sorts (z descending, index ascending) as larger-first.

    Floats map to uint32 monotonically (flip all bits of negatives, the sign bit of
    non-negatives); -inf and NaN never reach here as candidates.
    """
    b = f32_to_bits(z)
    if b & uint32(0x80000000):
        b = ~b
    else:
        b = b | uint32(0x80000000)
    return (uint64(b) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(index))
