"""Every device buffer a step touches, allocated once from the model shape and the limits.

A step only fills prefixes of these arrays, so kernel arguments (and therefore captured CUDA
graphs) never change. Inputs are written by the host into pinned mirrors and copied up with
one copy per segment; outputs come back the same way (a captured step holds those copies).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
from numba import cuda

from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.core.params import MAX_TOP_LOGPROBS
from ninfer.gpu.cuda.kernels import sampler
from ninfer.gpu.cuda.kernels.sampler import NUM_FPAR, NUM_IPAR

TOKEN_FIELDS = 4  # token id, position, page, slot
ROW_FIELDS = 4  # seq_len, last token index, row's first token, row's start position
MAX_PENALTY_ENTRIES = 1 << 16


@attrs.frozen(kw_only=True)
class Limits:
    """Sizes the buffers are allocated for."""

    max_tokens: int  # tokens in one forward (prefill chunk + decode rows)
    max_rows: int  # rows (sequences) in one forward
    max_pages_per_row: int
    max_splits: int  # decode attention splits (max_context / split_len)
    alloc_tokens: int = 0  # token rows allocated: room for graph-bucket padding (>= max_tokens)


def _dev(shape, dtype):
    """Uninitialized on the GPU. Zeroed under the simulator: rows a step only pads (graph
    buckets) are quantized like the others, and the simulator raises on the NaN -> int a
    recycled NaN-filled host allocation gives (the GPU's conversion does not; such rows are
    never read back)."""
    if SIMULATOR:
        return cuda.to_device(np.zeros(shape, dtype))
    return cuda.device_array(shape, dtype=dtype)


def _pinned(shape, dtype):
    return np.zeros(shape, dtype) if SIMULATOR else cuda.pinned_array(shape, dtype=dtype)


MIRRORS = 2  # host mirror sets: a step in flight and the next one being staged


# The step's inputs and outputs: (device name, host mirror name, shape, dtype). Each has a
# device array (StepBuffers) and a pinned copy in every host mirror set (HostMirror).
def _io_arrays(spec, limits: Limits) -> list[tuple]:
    t, r = max(limits.alloc_tokens, limits.max_tokens), limits.max_rows
    return [
        ("tok_in", "h_tok", (TOKEN_FIELDS, t), np.int32),  # per token
        ("row_in", "h_row", (ROW_FIELDS, r), np.int32),  # per row
        ("tiles_in", "h_tiles", (3, t + r), np.int32),
        ("tables", "h_tables", (r, limits.max_pages_per_row), np.int32),  # page tables
        ("fpar", "h_fpar", (r, NUM_FPAR), np.float32),  # sampling
        ("ipar", "h_ipar", (r, NUM_IPAR), np.int32),
        ("seeds", "h_seeds", (r, 2), np.uint64),
        ("pen_ids", "h_pen_ids", MAX_PENALTY_ENTRIES, np.int32),
        ("pen_counts", "h_pen_counts", MAX_PENALTY_ENTRIES, np.int32),
        ("masks", "h_masks", (r, (spec.vocab_size + 31) // 32), np.uint32),
        # outputs in one int32 allocation: tokens [r] | logprob bits [r] | top ids [r, K] | top bits [r, K]
        ("out", "h_out", r * (2 + 2 * MAX_TOP_LOGPROBS), np.int32),
        # hybrid models: each row's first token, GDN state slot and fresh flag (hybrid.gdn_step)
        *([("gdn_rows", "h_gdn_rows", (3, r + 1), np.int32)] if spec.is_hybrid else []),
    ]  # fmt: skip


class HostMirror:
    """One set of pinned host arrays a step is staged in and its outputs come back to."""

    def __init__(self, spec, limits: Limits):
        self.fields = []
        for _, name, shape, dtype in _io_arrays(spec, limits):
            setattr(self, name, _pinned(shape, dtype))
            self.fields.append(name)


class StepBuffers:
    """Device activations and I/O for one forward, plus their host mirrors."""

    def __init__(self, spec, limits: Limits):
        t, r = max(limits.alloc_tokens, limits.max_tokens), limits.max_rows
        d = spec.d_model
        wide = max(d, spec.q_dim, spec.d_ffn, spec.gdn.value_dim if spec.is_hybrid else 0)
        qkv_dim = spec.q_dim + 2 * spec.kv_dim
        self.limits = limits
        self.is_hybrid = spec.is_hybrid
        # activations
        self.x = _dev((t, d), np.float32)  # the residual stream
        self.h = _dev((t, wide), np.float32)  # float inputs of the linears
        self.xq8 = _dev((t, wide), np.int8)  # int8 inputs of the linears ...
        self.xs = _dev((t, 2 * (wide // 32)), np.float32)  # ... and their block scales
        self.qkv = _dev((t, qkv_dim), np.float32)
        self.q = _dev((t, spec.q_dim), np.float32)
        self.gate_up = _dev((t, 2 * spec.d_ffn), np.float32)
        self.o_part = _dev((r, spec.num_heads, limits.max_splits, spec.head_dim), np.float32)
        self.ml_part = _dev((r, spec.num_heads, limits.max_splits, 2), np.float32)
        self.logits = _dev((r, spec.vocab_size), np.float32)
        self.scores = _dev((r, spec.vocab_size), np.float32)
        for name, _, shape, dtype in _io_arrays(spec, limits):  # inputs and outputs
            setattr(self, name, _dev(shape, dtype))
        self.sampler_scratch = sampler.scratch(r)  # the split statistics pass's partials and counts
        self.dummy_f32 = _dev((1, 1), np.float32)
        self.dummy_f1 = _dev(1, np.float32)
        # host mirrors: MIRRORS sets, so a step can be staged while the one before is in flight
        self.mirrors = tuple(HostMirror(spec, limits) for _ in range(MIRRORS))
        self.use_mirror(0)

    def use_mirror(self, i: int) -> HostMirror:
        """Point the `h_*` attributes (what staging fills and a captured graph's copies read) at
        host mirror `i`."""
        m = self.mirrors[i]
        for name in m.fields:
            setattr(self, name, getattr(m, name))
        return m

    # named views the kernels take, made once (slicing a device array costs ~30 us)
    @functools.cached_property
    def tokens(self):
        return self.tok_in[0]

    @functools.cached_property
    def tok_pos(self):
        return self.tok_in[1]

    @functools.cached_property
    def tok_page(self):
        return self.tok_in[2]

    @functools.cached_property
    def tok_slot(self):
        return self.tok_in[3]

    @functools.cached_property
    def seq_lens(self):
        return self.row_in[0]

    @functools.cached_property
    def last_tok(self):
        return self.row_in[1]

    @functools.cached_property
    def tiles(self):
        """(tile_row, tile_tok0, tile_ntok, row_tok0, row_start) for the prefill attention."""
        return (self.tiles_in[0], self.tiles_in[1], self.tiles_in[2], self.row_in[2], self.row_in[3])

    @functools.cached_property
    def sampler_args(self):
        """The sampler kernels' arguments (`sampler.sample`), in their order."""
        r, k = self.limits.max_rows, MAX_TOP_LOGPROBS
        out_f32 = self.out.view(np.float32)
        return (
            self.logits, self.scores, self.fpar, self.ipar, self.seeds, self.pen_ids, self.pen_counts, self.masks,
            self.out[0:r], out_f32[r : 2 * r], self.out[2 * r : (2 + k) * r].reshape(r, k),
            out_f32[(2 + k) * r :].reshape(r, k), *self.sampler_scratch,
        )  # fmt: skip

    def host_outputs(self, mirror: HostMirror):
        """(tokens, logprobs, top ids, top logprobs) views of a pinned output mirror."""
        r, k = self.limits.max_rows, MAX_TOP_LOGPROBS
        f = mirror.h_out.view(np.float32)
        return mirror.h_out[:r], f[r : 2 * r], mirror.h_out[2 * r : (2 + k) * r].reshape(r, k), f[(2 + k) * r :].reshape(r, k)

    @functools.cached_property
    def xq32(self):
        return self.xq8.view(np.uint32)
