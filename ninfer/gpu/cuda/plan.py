"""`KernelPlan`: every kernel choice of the CUDA backend that is not fixed by the model shape.

The runner builds `KernelPlan()` (the measured defaults); an A/B comparison is two plans
(tools/profile.py `--variant LABEL:FIELD=VALUE;...`, read by `parse_plan`; tests). Kernel modules take a plan (or its fields) as an
argument and key their compiled kernels by the fields they read, so two plans can live in one
process. Where a default came from a measurement, docs/performance.md has the numbers.
"""

from __future__ import annotations

import ast

import attrs

FOLDS = ("attn_norm", "ffn_norm", "swiglu")  # RMSNorm -> QKV, RMSNorm -> gate+up, SwiGLU -> down
EPILOGUES = ("qkv_rope", "gate_swiglu")  # QKV + bias / RoPE / K-V write, gate+up + SwiGLU


def _names(allowed):
    def convert(value) -> frozenset:
        names = frozenset(value)
        bad = names - set(allowed)
        if bad:
            raise ValueError(f"unknown names {sorted(bad)}: choose among {', '.join(allowed)}")
        return names

    return convert


def _shape_map(value) -> tuple:
    """{qtype: (rows per lane group, unroll)} as a sorted tuple of pairs (hashable)."""
    items = value.items() if isinstance(value, dict) else value
    return tuple(sorted((str(q), (int(r), int(u))) for q, (r, u) in items))


@attrs.frozen(kw_only=True)
class KernelPlan:
    # -- one-token q8 steps (forward.py) ---------------------------------------------------------
    # prologue folds (gemv_fused: the kernel before a GEMV built by each of its blocks), taken
    # where every layer's matrices are small enough (gemv_folds.fusable); empty: separate kernels
    folds: frozenset = attrs.field(default=frozenset(FOLDS), converter=_names(FOLDS))
    # epilogue folds (gemv_rope, gemv_swiglu: the kernel after a GEMV in its last lines), where a
    # prologue fold does not already remove that kernel. H200, 8B Q8_0, one stream, ms a step:
    # neither 3.512, qkv_rope 3.580 (another run), both 3.447
    epilogues: frozenset = attrs.field(default=frozenset(EPILOGUES), converter=_names(EPILOGUES))

    # -- GEMV shapes (gemv.py, gemv_folds.py) ------------------------------------------------------
    # (rows per lane group, unroll) of the q8 one-activation-row GEMV
    one_row_shape: tuple = attrs.field(default=(2, 4), converter=tuple)
    # the same for rows of >= gemv.WIDE_BLOCKS int8 blocks (an 8B model's linears): of 11 shapes
    # gemv_tune timed on the H200, the least time over the four 8B linears together; Q8_0 (2, 4)
    # (was (1, 4)) took 0.16 ms off the 8B Q8_0 step on an H100 (3.606 vs 3.773 ms)
    # Q4_K (1, 4): H100, 8B shapes, 1,626 / 1,101 GB/s (gate+up / down) against (2, 4)'s 1,333 / 931
    wide_shape: tuple = attrs.field(default={"Q4_0": (2, 2), "Q4_1": (2, 2), "Q8_0": (2, 4), "Q4_K": (1, 4)},
                                    converter=_shape_map)  # fmt: skip
    # one weight row per lane group (the tall LM head) through the split loop, whose first weight
    # loads are issued before the PDL wait (False: the plain kernel, which waits first)
    one_row_split: bool = True
    rope_unroll: int = 2  # gemv_rope: (2, 2) timed best for the 8B QKV in Q4_1 and Q8_0
    swiglu_unroll: int = 2  # gemv_swiglu
    # gemv_swiglu over rows of >= WIDE_BLOCKS blocks: all four of a lane's first loads before
    # the PDL wait (8B Q8_0 one stream, H100: -0.10 ms a step alone)
    swiglu_wide_unroll: int = 4
    # weight loads mark their L2 lines evict-first: a one-row step's ~8 GB (8B Q8_0) would
    # otherwise sweep the 50 MB L2 clear of the KV pages and activations. 8B Q8_0 one stream,
    # H100, graph ms: 3.262 / 3.286 vs 3.326 / 3.324; 3.161 / 3.156 with lp_preload
    evict_first: bool = True

    # -- decode attention (attn_lp.py) ------------------------------------------------------------
    lp_over_one: bool = False  # take attn_decode_lp wherever supported, over the one-launch kernel too
    # attn_decode_lp loads K / V before the PDL wait (with evict_first: 3.161 / 3.156 vs 3.262 /
    # 3.286 ms a step, the early loads then hit L2)
    lp_preload: bool = True
    # the pools' page size compiled into attn_decode_lp (shifts and masks, not 64-bit division
    # calls): 3.326 / 3.324 vs 3.429 / 3.450 ms a step
    lp_const_page: bool = True

    # -- sampler (sampler.py) ---------------------------------------------------------------------
    # the statistics pass over a large vocabulary split over several blocks a row (one block over
    # Llama-3's 128,256 logits took 24.9 us on the H200); False: one block a row
    split_stats: bool = True

    # -- the step's graph (runner.py, graphs.py) ------------------------------------------------
    # the step's input copies and the sampled tokens' copy back inside the captured graph (one
    # graph launch and one synchronisation a decode step); False: issued around it
    copies_in_graph: bool = True
    # True: a new graph bucket is captured once and replayed, its other mirror set's graph
    # cloned with the copies re-pointed (runner._record, graphs.GraphCache.twin): one launch
    # sequence a bucket instead of three, for a faster warm-up (tests/test_gpu_runner.py checks
    # both paths against eager launches); False: run eagerly, then capture once per mirror set
    capture_once: bool = True
    # programmatic edges into PDL-aware kernels in captured graphs (pdl.py); False: as captured
    pdl: bool = True

    def wide_shape_of(self, qtype: str) -> tuple[int, int] | None:
        return dict(self.wide_shape).get(qtype)


DEFAULT = KernelPlan()


def parse_plan(text: str, base: KernelPlan = DEFAULT) -> KernelPlan:
    """`base` with the fields of `text` changed: "field=value; field=value" with Python
    literals, e.g. "one_row_split=False; wide_shape={'Q8_0': (2, 2)}" (a dict updates
    wide_shape's entries; the other fields are replaced). Empty text: `base`."""
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in attrs.fields_dict(KernelPlan):
            raise ValueError(f"{item!r}: expected FIELD=VALUE with FIELD one of {', '.join(attrs.fields_dict(KernelPlan))}")
        value = ast.literal_eval(value.strip())
        if name == "wide_shape" and isinstance(value, dict):
            value = {**dict(base.wide_shape), **value}
        changes[name] = value
    return attrs.evolve(base, **changes)
