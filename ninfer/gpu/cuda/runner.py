"""`CudaRunner`: the `Runner` protocol on numba.cuda, matching `ReferenceRunner`'s semantics.

Weights stay in stored form on the device; the KV pool is [layers, pages + 1, page_size,
kv_heads, head_dim] of `kv_dtype` (float16 by default, float32 for an exact pool), the extra
page absorbing the padding rows of graph buckets. A step is split into sub-steps that fit the
buffers; each sub-step fills a set of pinned host mirrors, then runs the inputs' copies up, the
forward pass and the sampled tokens' copy back, as a CUDA graph captured once per batch bucket
and mirror set (one graph launch a step on the host), or eagerly, and records an event that
`collect` waits on. Two mirror sets let `submit` stage and launch step N + 1 while step N still
runs; with `feed` its embedding gathers step N's samples where the sampler left them (its
tokens are staged as `embed.FED`), in the same graph as a step whose tokens come from the host.
Rows that ask for outputs at every position (all logits, per-layer hidden rows) get them
through `positions.py`; other rows' steps are untouched.

Hybrid (qwen35) models (hybrid.py) also keep each sequence's Gated DeltaNet state in a pool of
`max_sequences` device slots, by seq_id (a row at position 0 takes one, `release_sequence`
frees it); their decode steps run as graphs and the others eagerly, and only the
full-attention layers have KV pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
from numba import cuda

from ninfer.gpu import sampling
from ninfer.gpu.cuda.buckets import bucket as _bucket
from ninfer.gpu.cuda.buckets import token_bucket as _token_bucket
from ninfer.gpu.cuda.buckets import warm_rows as _warm_rows
from ninfer.gpu.cuda.buckets import zeros as _zeros
from ninfer.gpu.cuda import pages, positions
from ninfer.gpu.cuda.buffers import MIRRORS, Limits, StepBuffers
from ninfer.gpu.cuda.device_model import upload_model
from ninfer.gpu.cuda.forward import Forward, StepPlan
from ninfer.gpu.cuda.kernels import embed, jit
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.gpu.cuda.plan import KernelPlan
from ninfer.gpu.cuda.staging import (
    Extras, Piece, Staged, download, fetch_outputs, plan_pieces, queue_extras, stage_inputs, upload,
)
from ninfer.core.runner import PageSnapshot, Pending, SampledToken, StepRow, check_feed, check_hidden_layers, with_tokens


class _Sub:
    """One launched sub-step: what `collect` needs to wrap its results."""

    __slots__ = ("rows", "batch", "staged", "mirror", "extras", "every", "results")

    def __init__(self, rows, batch: list[Piece], staged: Staged, mirror: int, extras: Extras, every: dict):
        self.rows, self.batch, self.staged, self.mirror, self.extras = rows, batch, staged, mirror, extras
        self.every = every  # piece index -> its outputs at every position (positions.queue_positions)
        self.results: list[SampledToken | None] | None = None


class CudaRunner:
    """`Runner` on one CUDA GPU (or, at tiny shapes, numba's CUDA simulator)."""

    pipelined = True  # submit returns once the step is queued

    def __init__(
        self,
        model,
        *,
        num_pages: int,
        page_size: int = 16,
        max_batch_rows: int = 64,
        max_tokens_per_step: int = 4096,
        max_context: int | None = None,
        kv_dtype=np.float16,
        activations: str = "f32",
        use_graphs: bool = True,
        split_len: int | None = None,
        sampler_threads: int | None = None,
        progress: bool = False,
        plan: KernelPlan | None = None,
        max_sequences: int | None = None,
        checkpoint_slots: int = 0,
    ):
        """`activations`: 'f32' (default) runs the decode linears on float activations (logits
        within ~1e-3 of the reference); 'q8' on int8 activations with dp4a, llama.cpp's
        scheme (fewer instructions, logits a few percent off). Prefill (more than 8 tokens)
        always uses the f16 tensor-core GEMM. `max_context` (default the model's) sizes the
        page tables, RoPE tables and attention scratch; longer positions are rejected. `plan`:
        the kernel choices (default `KernelPlan()`, the measured defaults). `max_sequences`
        (hybrid models; default max_batch_rows): sequences whose recurrent state the runner
        holds at once, running or waiting between steps; `checkpoint_slots` (hybrid models):
        device slots for the prefix cache's newest state checkpoints (`save_checkpoint`)."""
        from ninfer.gpu.reference import rope_angles, spec_and_weights

        spec, weights = spec_and_weights(model)
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        if spec.head_dim % 32:
            raise ValueError(f"the CUDA kernels need head_dim to be a multiple of 32, got {spec.head_dim}")
        self.spec = spec
        if spec.is_hybrid and spec.head_dim > 1024:
            raise ValueError(f"the gated attention kernels need head_dim <= 1024, got {spec.head_dim}")
        self.max_context = min(max_context or spec.max_context, spec.max_context)
        split_len = split_len or _split_len(self.max_context)
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_dtype = np.dtype(kv_dtype)
        self.stream = cuda.stream()
        self.model = upload_model(spec, weights, stream=self.stream, progress=progress)
        self._final_norm = np.asarray(weights["final_norm"].dequantize(), np.float32)  # hidden rows, on the host
        max_tokens = max(max_tokens_per_step, max_batch_rows)
        self.limits = Limits(
            alloc_tokens=_token_bucket(max_tokens + max_batch_rows),
            max_tokens=max_tokens,
            max_rows=max_batch_rows,
            max_pages_per_row=-(-self.max_context // page_size),
            max_splits=-(-self.max_context // split_len),
        )
        self.bufs = StepBuffers(spec, self.limits)
        self._states = None
        if spec.is_hybrid:
            from ninfer.gpu.cuda.hybrid import HybridBuffers, StatePool

            self._states = StatePool(spec, max_sequences or max_batch_rows, self.stream, checkpoint_slots)
            self._hybrid_bufs = HybridBuffers(spec, self.limits, self.bufs)
        kv_shape = (len(spec.attention_layers), num_pages + 1, page_size, spec.num_kv_heads, spec.head_dim)
        if math.prod(kv_shape[1:]) >= 2**32:  # the decode kernels' KV offsets are 32-bit (intrinsics.ld8)
            raise ValueError(f"{num_pages} KV pages of {page_size} tokens exceed 2**32 elements a layer: use fewer pages")
        self.k_pool = _zeros(kv_shape, self.kv_dtype, self.stream)
        self.v_pool = _zeros(kv_shape, self.kv_dtype, self.stream)
        cos, sin = rope_angles(spec, np.arange(self.max_context))
        self._cos = cuda.to_device(np.ascontiguousarray(cos), stream=self.stream)
        self._sin = cuda.to_device(np.ascontiguousarray(sin), stream=self.stream)
        self._forward_args = dict(q8=activations == "q8", split_len=split_len,
                                  sampler_threads=sampler_threads or (64 if SIMULATOR else 512))  # fmt: skip
        # Graph buckets pad batches to fixed shapes; the simulator pads too (no graphs there),
        # so the padding itself is tested without a GPU.
        self.use_graphs = use_graphs
        self._graphs = None
        self.set_plan(plan or KernelPlan())
        self._warm: set[int] = set()
        self._events = [cuda.event() if SIMULATOR else cuda.event(timing=False) for _ in range(MIRRORS)]
        self._owners: list[_Sub | None] = [None] * MIRRORS  # the sub-step each mirror set last took
        self._next_mirror = 0
        self._last: Pending | None = None  # the last submitted step (its rows and sub-steps), for `feed`
        self.stream.synchronize()

    def set_plan(self, plan: KernelPlan) -> None:
        """Launch later steps' kernels as `plan` chooses them (A/B timing: tools/profile.py);
        every captured graph is dropped and captured anew. Call between steps."""
        self.stream.synchronize()
        self.plan = plan
        forward, extra = Forward, {}
        if self._states is not None:
            from ninfer.gpu.cuda.hybrid import HybridForward

            forward, extra = HybridForward, dict(pool=self._states, hbufs=self._hybrid_bufs)
        self.forward = forward(self.spec, self.model, self.bufs, self.k_pool, self.v_pool, self._cos, self._sin, plan=plan,
                               **self._forward_args, **extra)  # fmt: skip
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
        if self.use_graphs and not SIMULATOR:
            from ninfer.gpu.cuda.graphs import GraphCache

            self._graphs = GraphCache(self.stream, programmatic=plan.pdl)

    # -- Runner protocol ------------------------------------------------------------------------

    @property
    def page_nbytes(self) -> int:
        """Bytes one page holds over all layers (K and V)."""
        return self.page_size * self.spec.kv_bytes_per_token(self.kv_dtype.itemsize)

    @property
    def weight_nbytes(self) -> int:
        return self.model.nbytes

    @property
    def step_weight_nbytes(self) -> int:
        """Weight bytes one decode step reads: the layers and the head, not the embedding table
        (a step gathers a few of its rows) unless the head is that table."""
        return self.model.step_bytes()

    def step(self, rows: Sequence[StepRow]) -> list[SampledToken | None]:
        """Run one forward over the batch; one result per row, None where row.sample is None."""
        return self.collect(self.submit(rows))

    def submit(self, rows: Sequence[StepRow], *, feed: bool = False) -> Pending:
        """Stage and launch the step's sub-steps; returns once they are queued on the stream.
        feed=True: the rows continue the last submitted step's rows, whose samples become
        their tokens on the device (through the host, after waiting for that step, where
        either step runs as several sub-steps)."""
        if feed:
            check_feed(self._last.rows if self._last else None, rows)
        self._validate(rows, check_tokens=not feed)
        batches = plan_pieces(rows, self.limits, self.page_size)
        if feed and (len(self._last.state) != 1 or len(batches) != 1):
            # the samples are not in one sub-step's outputs: take them through the host
            rows, feed = with_tokens(rows, self.collect(self._last)), False
        if self._states is None:
            self._last = Pending(rows, [self._launch(rows, batch, feed) for batch in batches])
            return self._last
        slots = self._states.begin(rows)  # raises before anything is queued
        try:
            self._last = Pending(rows, [self._launch(rows, batch, feed, slots) for batch in batches])
        except BaseException:
            self._states.abort(rows)
            raise
        self._states.commit(rows, slots)
        return self._last

    def collect(self, pending: Pending) -> list[SampledToken | None]:
        """Wait for a submitted step (not for any submitted after it); one result per row."""
        results: list[SampledToken | None] = [None] * len(pending.rows)
        every: dict[int, list[dict]] = {}  # row -> its pieces' every-position outputs, in order
        for sub in pending.state:
            for piece, token in zip(sub.batch, self._fetch(sub), strict=True):
                if token is not None:
                    results[piece.row] = token
            for i, entry in sub.every.items():
                every.setdefault(sub.batch[i].row, []).append(entry)
        for r, entries in every.items():
            if results[r] is not None:
                fields = positions.assemble(pending.rows[r].sample, entries, self._final_norm, self.spec.rms_eps)
                results[r] = attrs.evolve(results[r], **fields)
        return results

    def warm_up(self, *, max_rows: int, max_context: int | None = None, progress: bool = False) -> int:
        """Compile every kernel and capture every graph a server with `max_rows` lanes and
        `max_context` can need: decode steps (each row bucket x context bucket, fed by the step
        before and not) and prefill / mixed steps (each row bucket x token bucket). Writes
        garbage K/V into the first pages: call before any request. Returns the shapes run."""
        shapes = _warm_shapes(self, max_rows, max_context or self.max_context)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(shapes), desc="compiling kernels, capturing graphs", unit="shape")
        for kind, num_rows, length in shapes:
            if kind == "decode":  # one token a row, at context `length`; then the same fed
                first = _warm_rows(num_rows, [1] * num_rows, length - 2, self.page_size)
                pending = self.submit(first)
                self.collect(self.submit(_warm_rows(num_rows, [1] * num_rows, length - 1, self.page_size), feed=True))
                self.collect(pending)
            else:  # `length` tokens over the rows, from position 0
                counts = [length // num_rows + (i < length % num_rows) for i in range(num_rows)]
                self.collect(self.submit(_warm_rows(num_rows, counts, 0, self.page_size)))
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        self._last = None
        self.stream.synchronize()
        return len(shapes)

    def snapshot_pages(self, page_ids: Sequence[int]) -> PageSnapshot:
        """Copy the pages' KV to pinned host memory: (k, v) [layers, n, page_size, kv_heads, head_dim].

        Pinned (page-locked) buffers make both copies direct DMA transfers, and they are what
        the prefix cache's host tier and paused requests keep.
        """
        ids = self._page_ids(page_ids)
        n = ids.size
        shape = (self.k_pool.shape[0], n, *self.k_pool.shape[2:])
        if n == 0:
            return PageSnapshot((np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype)))
        d_ids = cuda.to_device(ids, stream=self.stream)
        out = []
        for pool in (self.k_pool, self.v_pool):
            stage = cuda.device_array((pool.shape[0], n, self._page_elems), self.kv_dtype, stream=self.stream)
            pages.page_gather(self._pool3(pool), d_ids, stage, n, self.stream)
            host = cuda.pinned_array(stage.shape, self.kv_dtype)
            stage.copy_to_host(ary=host, stream=self.stream)
            out.append(host.reshape(shape))
        self.stream.synchronize()
        return PageSnapshot(tuple(out))

    def restore_pages(self, page_ids: Sequence[int], snapshot: PageSnapshot) -> None:
        """Write a snapshot back into (possibly different) pages, in the same order."""
        ids = self._page_ids(page_ids)
        k, v = snapshot.arrays
        if k.shape[1] != ids.shape[0]:
            raise ValueError(f"snapshot holds {k.shape[1]} pages, restore asked for {ids.shape[0]}")
        d_ids = cuda.to_device(ids, stream=self.stream)
        for pool, arr in ((self.k_pool, k), (self.v_pool, v)):
            flat = np.ascontiguousarray(arr, self.kv_dtype).reshape(pool.shape[0], ids.size, self._page_elems)
            stage = cuda.to_device(flat, stream=self.stream)
            pages.page_scatter(stage, d_ids, self._pool3(pool), ids.size, self.stream)
        self.stream.synchronize()

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Device-side page copy src[i] -> dst[i] (copy-on-write of a shared tail page)."""
        src, dst = self._page_ids(src_ids), self._page_ids(dst_ids)
        if src.shape != dst.shape:
            raise ValueError(f"copy_pages got {src.shape[0]} sources and {dst.shape[0]} destinations")
        d_src, d_dst = cuda.to_device(src, stream=self.stream), cuda.to_device(dst, stream=self.stream)
        for pool in (self.k_pool, self.v_pool):
            pages.page_copy(self._pool3(pool), d_src, d_dst, src.size, self.stream)
        self.stream.synchronize()

    # -- recurrent state (hybrid models) -------------------------------------------------------

    def release_sequence(self, seq_id: int) -> None:
        """Free a sequence's recurrent-state slot (it finished, or paused to replay); no-op
        without one. A step already queued that uses the slot still runs first."""
        if self._states is not None:
            self._states.release(seq_id)

    @property
    def num_recurrent_states(self) -> int:
        """Sequences whose recurrent state this runner holds (0 for dense models)."""
        return 0 if self._states is None else len(self._states)

    def recurrent_state(self, seq_id: int):
        """A sequence's recurrent state copied to the host (`gdn.SequenceState`; tests and
        tools; waits for the queued steps), or None."""
        return None if self._states is None else self._states.read(seq_id, self.stream)

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (0 for dense models)."""
        return 0 if self._states is None else self._states.state_nbytes

    @property
    def max_states(self) -> int | None:
        """Sequences that may hold a recurrent state at once: the state pool's slots."""
        return None if self._states is None else self._states.num_slots

    def snapshot_state(self, seq_id: int):
        """The sequence's recurrent state copied to the host (`StateSnapshot`; hybrid.StatePool)."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        return self._states.snapshot(seq_id, self.stream)

    def restore_state(self, seq_id: int, snapshot) -> None:
        """Write a `StateSnapshot` into the sequence's state slot (hybrid.StatePool)."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        self._states.restore(seq_id, snapshot, self.stream)

    @property
    def num_checkpoint_slots(self) -> int:
        """Device slots for the prefix cache's newest state checkpoints (`checkpoint_slots`)."""
        return 0 if self._states is None else self._states.checkpoints.count

    @property
    def num_free_checkpoint_slots(self) -> int:
        return 0 if self._states is None else self._states.checkpoints.num_free

    def save_checkpoint(self, seq_id: int):
        """The sequence's state copied into a free checkpoint slot, on the device (hybrid.StatePool)."""
        if self._states is None:
            raise ValueError("a dense model keeps no recurrent state")
        return self._states.save_checkpoint(seq_id, self.stream)

    def demote_checkpoint(self, snapshot):
        """A checkpoint slot's state copied to the host; the slot is free afterwards."""
        return self._states.demote_checkpoint(snapshot, self.stream)

    def release_checkpoint(self, snapshot) -> None:
        self._states.release_checkpoint(snapshot)

    def warm_up_hybrid(self, *, max_rows: int, max_context: int | None = None, progress: bool = False) -> int:
        """`warm_up` for hybrid models, whose rows cannot start mid-sequence (the recurrent
        state): compiles their kernels and captures their decode graphs (hybrid.warm_up_hybrid)."""
        from ninfer.gpu.cuda.hybrid import warm_up_hybrid

        return warm_up_hybrid(self, max_rows=max_rows, max_context=max_context, progress=progress)

    def close(self) -> None:
        """Release graphs and device memory."""
        if self._graphs is not None:
            self._graphs.close()
        self.stream.synchronize()
        if self._states is not None:
            self._states.clear()
        self.k_pool = self.v_pool = self._states = None
        self.forward = self.bufs = self.model = None

    # -- one sub-step -----------------------------------------------------------------------------

    def _launch(self, rows: Sequence[StepRow], batch: list[Piece], feed: bool, slots=None) -> _Sub:
        """Stage one sub-step into the next host mirror set and queue it: the inputs' copies,
        the forward pass (feed: over the samples before), the outputs' copies back."""
        m = self._next_mirror
        self._next_mirror = (m + 1) % MIRRORS
        owner = self._owners[m]
        if owner is not None:
            self._fetch(owner)  # its outputs out of the mirror before this sub-step reuses it
        self.bufs.use_mirror(m)
        decode = all(p.count == 1 for p in batch)
        asks = positions.any_asks(rows, batch)  # rows that want outputs at every position (positions.py)
        hooked = positions.hooked_layers(rows, batch) if asks else frozenset()  # eager, hooked after those layers
        layer_rows: dict[int, np.ndarray] = {}
        after_layer = positions.layer_hook(self.bufs, rows, batch, hooked, self.stream, layer_rows) if hooked else None
        gdn = None
        if slots is not None:  # hybrids: each piece's state slot; only decode steps go in graphs
            from ninfer.gpu.cuda.hybrid import gdn_step

            gdn = gdn_step(rows, batch, slots)
        graphable = self.use_graphs and not hooked and (gdn is None or gdn.decode)
        key = (*self._graph_key(rows, batch, decode), m) if graphable else None
        pad_rows, pad_tokens = (key[1], key[2]) if key else (None, None)
        staged = stage_inputs(self.bufs, rows, batch, self.page_size, self.num_pages, self.stream, pad_rows, pad_tokens)
        if feed:  # each row's token is the step before's sample, row i's at out[i] on the device
            self.bufs.h_tok[0, : len(batch)] = embed.FED
        splits = key[3] if key else self._splits(_longest(rows, batch))
        plan = StepPlan(num_tokens=staged.num_tokens, num_rows=staged.num_rows, num_sampled=staged.num_sampled,
                        decode=decode, num_tiles=staged.num_tiles, num_splits=splits)  # fmt: skip
        copies = self.plan.copies_in_graph
        if gdn is not None:
            self.forward.stage(gdn, pad_rows)

        def launch():  # the inputs' copies, the forward pass, the sampled ids' copy back
            if copies:
                upload(self.bufs, staged, self.stream)
            self.forward.launch(plan, self.stream, after_layer)
            if copies:
                download(self.bufs, staged, self.stream)

        if not copies:
            upload(self.bufs, staged, self.stream)
        if key is None or self._graphs is None:
            launch()
        elif key in self._graphs:
            self._graphs.replay(key)
        else:
            self._record(key, launch, m)
        if not copies:
            download(self.bufs, staged, self.stream)
        extras = queue_extras(self.bufs, rows, batch, staged, self.stream)
        every = positions.queue_positions(self.forward, self.bufs, rows, batch, layer_rows, self.stream) if asks else {}
        sub = _Sub(rows, batch, staged, m, extras, every)
        self._events[m].record(self.stream)
        self._owners[m] = sub
        return sub

    def _record(self, key, launch, m: int) -> None:
        """First use of a bucket: capture its graph (the copies' sizes are the bucket's, so the
        graph's copy nodes fit every step of it) and replay it for this step. A capture that
        failed or loaded a kernel module (a kernel's first launch in this process) is redone
        after an eager run of the step. The other mirror sets' graphs are clones whose copies
        read and write their own host arrays, made now: a capture costs ~0.1 s on an 8B model,
        which must not land in a later step."""
        if not self.plan.capture_once:  # the eager run, then a capture per mirror set
            launch()
            for mm in range(MIRRORS):
                self.bufs.use_mirror(mm)
                self._graphs.capture((*key[:-1], mm), launch)
            self.bufs.use_mirror(m)
            return
        bound = jit.overloads_bound()
        try:
            self._graphs.capture(key, launch)
            clean = jit.overloads_bound() == bound
        except Exception:  # e.g. a module load the capture did not allow: eagerly, below
            clean = False
        if clean:
            self._graphs.replay(key)
        else:
            self._graphs.discard(key)
            launch()
            self._graphs.capture(key, launch)
        from ninfer.gpu.cuda.graphs import address_remap

        mirrors = self.bufs.mirrors
        for mm in range(MIRRORS):
            if mm != m:
                spans = [(getattr(mirrors[m], f).ctypes.data, getattr(mirrors[m], f).nbytes,
                          getattr(mirrors[mm], f).ctypes.data) for f in mirrors[m].fields]  # fmt: skip
                self._graphs.twin(key, (*key[:-1], mm), address_remap(spans))

    def _fetch(self, sub: _Sub) -> list[SampledToken | None]:
        """A sub-step's results, waiting for it (not for later sub-steps) the first time."""
        if sub.results is None:
            self._events[sub.mirror].synchronize()
            sub.results = fetch_outputs(self.bufs, self.bufs.mirrors[sub.mirror], sub.rows, sub.batch, sub.staged,
                                        sub.extras, self._final_norm, self.spec.rms_eps)  # fmt: skip
        return sub.results

    def _graph_key(self, rows, batch: list[Piece], decode: bool):
        """(kind, rows, tokens, splits) of the bucket this sub-batch is padded to and replayed in."""
        num_rows = _bucket(len(batch), self.limits.max_rows)
        if decode:
            # graphs per context bucket too: the decode attention launches only the splits a
            # context of that length needs, so short contexts run no empty blocks
            ctx = min(max(64, 1 << (_longest(rows, batch) - 1).bit_length()), self.max_context)
            return ("decode", num_rows, num_rows, self._splits(ctx))
        return ("prefill", num_rows, _token_bucket(sum(p.count for p in batch)), 0)

    def _splits(self, context: int) -> int:
        return min(-(-context // self.forward.split_len), self.limits.max_splits)

    # -- helpers ------------------------------------------------------------------------------------

    def _validate(self, rows: Sequence[StepRow], check_tokens: bool = True) -> None:
        for row in rows:
            n = len(row.token_ids)
            if n < 1:
                raise ValueError(f"row of sequence {row.seq_id} has no tokens")
            end = row.start_pos + n
            if end > self.max_context:
                raise ValueError(f"position {end - 1} is past the context limit {self.max_context}")
            if len(row.page_table) * self.page_size < end:
                raise ValueError(f"sequence {row.seq_id}: {len(row.page_table)} pages cannot hold {end} positions")
            ids = np.asarray(row.token_ids)
            if check_tokens and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
                raise ValueError(f"sequence {row.seq_id}: token ids must be in [0, {self.spec.vocab_size})")
            s = row.sample
            if s is not None and s.allowed is not None and not np.asarray(s.allowed, bool).any():
                raise sampling.NoAllowedToken("the grammar allows no next token, so nothing can be sampled")
            if s is not None and s.hidden_layers:
                check_hidden_layers(s.hidden_layers, self.spec.num_layers)
            if s is not None and s.score_ids is not None:
                ids = np.asarray(s.score_ids)
                if ids.size and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
                    raise ValueError(f"sequence {row.seq_id}: score ids must be in [0, {self.spec.vocab_size})")

    def _page_ids(self, page_ids) -> np.ndarray:
        ids = np.asarray(page_ids, dtype=np.int32).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages):
            raise ValueError(f"page ids must be in [0, {self.num_pages})")
        return ids

    @property
    def _page_elems(self) -> int:
        return self.page_size * self.spec.num_kv_heads * self.spec.head_dim

    def _pool3(self, pool):
        return pool.reshape(pool.shape[0], pool.shape[1], self._page_elems)


def _warm_shapes(runner: CudaRunner, max_rows: int, max_context: int) -> list[tuple[str, int, int]]:
    """(kind, rows, context or tokens) of one step per graph key `runner` can be asked for."""
    top_rows = _bucket(min(max_rows, runner.limits.max_rows), runner.limits.max_rows)
    row_buckets = [1 << i for i in range(top_rows.bit_length())]
    room = runner.num_pages * runner.page_size  # warm rows share pages: one row's context at most
    top_context = min(max_context, runner.max_context, room)
    # a decode step's context bucket is that of its longest row (see _graph_key)
    contexts = {min(max(64, 1 << (n - 1).bit_length()), runner.max_context) for n in range(3, top_context + 1)}
    top_tokens = min(runner.limits.max_tokens, room)
    tokens = {_token_bucket(n) for n in range(2, top_tokens + 1)}
    shapes = [("decode", r, min(ctx, top_context)) for r in row_buckets for ctx in sorted(contexts)]
    for r in row_buckets:  # n rows in bucket r, t tokens (n < t: some row has several), at most top_context a row
        for t in sorted({min(t, top_tokens) for t in tokens}):
            n = r if t > r else r - 1
            if n > r // 2 and n < t <= n * top_context:
                shapes.append(("prefill", n, t))
    return shapes


def _longest(rows, batch) -> int:
    """Context length of the longest row of a sub-batch after it."""
    return max(rows[p.row].start_pos + p.offset + p.count for p in batch)


def _split_len(max_context: int) -> int:
    """Positions per decode-attention split: 32 (each warp walks 8), or more so there are at
    most 256 splits. Short splits keep the serial chain of dependent loads per warp short."""
    return max(32, -(-max_context // (256 * 32)) * 32)


def auto_num_pages(spec, page_size: int, *, memory_fraction: float = 0.5, kv_dtype=np.float16) -> int:
    """KV pages for `memory_fraction` of the GPU memory free now (call before loading the
    model), capped at 64 full-context sequences and at least one."""
    free, _total = cuda.current_context().get_memory_info()
    page_bytes = page_size * spec.kv_bytes_per_token(np.dtype(kv_dtype).itemsize)
    per_seq = -(-min(spec.max_context, 8192) // page_size)
    return int(max(per_seq, min(int(free * memory_fraction) // page_bytes, 64 * per_seq)))

