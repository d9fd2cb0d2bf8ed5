"""The launch sequence of one forward over staged inputs: the recipe a CUDA graph captures.

`Forward.launch(plan)` issues every kernel of a step on one stream, reading only the static
buffers (buffers.py), so the same calls can run eagerly or be captured once per batch bucket.
Per layer (activations `act` = int8 blocks for the dp4a GEMV, or float32):

    rmsnorm(x) -> act ; QKV linear ; bias / q-k norm / RoPE / K-V write ; attention -> act
    (with POST_IN_ATTENTION, decode steps do bias ... K-V write inside the attention kernel)
    x += O linear ; rmsnorm(x) -> act ; gate+up linear ; SwiGLU -> act ; x += down linear

then the final norm of each sampled row's last token, the LM head and the sampler. One-token
q8 steps fold each RMSNorm into the QKV / gate+up GEMV after it and SwiGLU into the down GEMV
(gemv.gemv_fused: each block builds its int8 input in shared memory while its first weights
load), where the matrices are small enough (gemv.fusable): three kernels fewer per layer.
Where they are too large (an 8B model), small kernels fold into the end of the GEMV before them
instead (EPILOGUES: gemv.gemv_rope does bias / RoPE / K-V write, gemv.gemv_swiglu pairs gate
and up rows): two kernels fewer. Two more folds are there, measured neutral or slower on the
8B step and off by default: the split decode attention merging its splits itself
(MERGE_IN_ATTENTION) and the O / down GEMVs writing the next RMSNorm's int8 input (NORM_OUT,
gemv.gemv_norm); and one unmeasured, off: the RMSNorm before gate+up built by each
gemv_swiglu block itself (FOLD_FFN_NORM).
"""

from __future__ import annotations

import attrs

from ninfer.gpu.cuda import act_quant, attention, embed, flash, gemm, gemv, norm, rope, sampler, swiglu
from ninfer.gpu.cuda.qdot import WLOAD


@attrs.frozen(kw_only=True)
class StepPlan:
    num_tokens: int
    num_rows: int
    num_sampled: int  # rows whose last token goes through the head (head inputs: last_tok[:S])
    decode: bool  # every row has one token: split-K decode attention
    num_tiles: int = 0  # prefill attention tiles (general path)
    num_splits: int = 0  # decode attention splits to launch (0: every split the buffers hold)
    feed: bool = False  # the tokens are the step before's samples: embed reads them from the sampler's output

    @property
    def act(self) -> str:
        return "q8" if self.num_tokens <= gemv.MAX_M else "f32"


FUSE_ONE_ROW = True  # gemv_fused for one-token q8 steps (False: the separate kernels, for A/B timing)
FOLDS = ("attn_norm", "ffn_norm", "swiglu")  # RMSNorm -> QKV, RMSNorm -> gate+up, SwiGLU -> down
POST_IN_ATTENTION = False  # True: decode steps do rope.qkv_post inside the decode attention (measured neutral)
# one-row decode steps: the split decode attention merges in its last split where that takes one
# round of loads (at most attention.MERGE_UNROLL splits; False: always the attn_combine launch).
# H200, 8B Q8_0 one stream (8 splits), ms a step, merged vs combine launch: 3.696 vs 3.794 in the
# fourth session, but 3.598 vs 3.488, 3.447 vs 3.307 and 3.462 vs 3.281 in three A/Bs of the
# fifth (attn_tune alone: 14.6 vs 12.7 us a layer): the fence + atomic + merge tail costs more
# than the launch. Off; the path stays checked (attn_decode check, `counters=`).
MERGE_IN_ATTENTION = False
EPILOGUES_ONE_ROW = True  # the epilogue folds below for one-token q8 steps (False: separate kernels, for A/B)
# QKV GEMV + bias / RoPE / K-V write (models without q/k norm), gate+up GEMV + SwiGLU. H200, 8B
# Q8_0, one stream, ms a step: neither 3.512, qkv_rope 3.580 (another run), both 3.447
EPILOGUES = ("qkv_rope", "gate_swiglu")
# with both epilogues: the O and down GEMVs write the next RMSNorm's int8 input themselves
# (gemv.gemv_norm; the consumer applies the norm's factor), so no RMSNorm launch but layer 0's.
# int8 rows then: attention -> 0 -> O -> 1 -> gate+up -> 2 -> down -> 0 (the next layer's QKV).
# H200, 8B Q8_0 one stream, ms a step, on vs off: 3.447 vs 3.462 (merge on), 3.307 vs 3.281
# (merge off) with 32 lanes a row; 3.598 vs 3.437 with 16. Neutral: the 64 RMSNorm launches it
# saves (~4 us each) go into the GEMVs, whose blocks must own 32 whole rows (one int8 block),
# so O / down run 128 blocks of 1,024 threads instead of 1,024 of 128. Off; checked (runner).
NORM_OUT = False
# with the gate_swiglu epilogue and without NORM_OUT: the RMSNorm before gate+up folded into
# it, each gemv_swiglu block building its int8 input from x in shared memory (gemv.py
# `_make_folded_sums`): one launch fewer a layer for 16 KB of x (+ the weight) read from L2
# by each of the 8B's 448 blocks (~0.1 byte a weight byte; QKV's 768 blocks would read ~1).
# Unmeasured (no GPU in the ninth session): A/B it (scripts/device_run.sh steps8b).
FOLD_FFN_NORM = False


class Forward:
    """Owns references to the device model, buffers, KV pool and RoPE tables."""

    def __init__(self, spec, model, bufs, k_pool, v_pool, cos, sin, *, q8: bool, split_len: int, sampler_threads: int):
        self._init_args = ((spec, model, bufs, k_pool, v_pool, cos, sin),
                           dict(q8=q8, split_len=split_len, sampler_threads=sampler_threads))  # fmt: skip
        self.spec = spec
        self.model = model
        self.bufs = bufs
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.cos = cos
        self.sin = sin
        self.q8 = q8 and model.linears_quantized
        self.head_q8 = q8 and model.head.qtype not in gemv.FLOAT_QTYPES
        self.split_len = split_len
        self.sampler_threads = sampler_threads
        # the folds one-token q8 steps may take: every layer's matrices must fit gemv_fused
        mats = {"attn_norm": lambda l: l.wqkv, "ffn_norm": lambda l: l.w_gate_up, "swiglu": lambda l: (l.w_down,)}
        self.can_fold = frozenset(
            f for f in FOLDS if self.q8 and all(gemv.fusable(w) for layer in model.layers for w in mats[f](layer))
        )
        self.folds = self.can_fold if FUSE_ONE_ROW else frozenset()
        # the epilogue folds of one-token q8 steps, where the prologue folds above are not taken
        # (where a prologue fold is taken, it already removes that kernel)
        self.can_epilogue = self._epilogues(model, bufs)
        self.epilogues = self.epilogues_with(self.folds) if EPILOGUES_ONE_ROW else frozenset()
        self.can_norm_out = (bufs.xq8.shape[0] >= 3 and spec.d_model % gemv.NORM_GROUPS == 0
                             and all(w.qtype in WLOAD for l in model.layers for w in (l.wo, l.w_down)))  # fmt: skip
        self.norm_out = NORM_OUT
        self.fold_ffn_norm = FOLD_FFN_NORM and spec.d_model % 32 == 0 and spec.d_model <= gemv.FUSE_MAX_COLS
        # float16 pools: prefill attention on tensor cores over the pools' f16 pairs
        self._kv_words = None
        if flash.supports(spec.head_dim, k_pool.dtype):
            self._kv_words = [(flash.words(k_pool[i]), flash.words(v_pool[i])) for i in range(spec.num_layers)]
        d = spec.d_model
        self._norms2d = [(layer.attn_norm.reshape(1, d), layer.ffn_norm.reshape(1, d)) for layer in model.layers]
        self._posts = [self._post_args(layer) for layer in model.layers]
        self.post_in_attention = POST_IN_ATTENTION  # read at launch: set it before the first step
        self.merge_in_attention = MERGE_IN_ATTENTION

    def rebuilt(self) -> Forward:
        """A Forward over the same model and buffers that reads the module's switches anew
        (A/B timing: profile --variant)."""
        args, kwargs = self._init_args
        return Forward(*args, **kwargs)

    def launch(self, plan: StepPlan, stream) -> None:
        b = self.bufs
        act = "q8" if (self.q8 and plan.act == "q8") else "f32"
        t = plan.num_tokens
        one = act == "q8" and t == 1
        folds = self.folds if one else frozenset()
        epi = self.epilogues if one else frozenset()
        norm_out = one and self.norm_out_taken
        tokens = b.out if plan.feed else b.tokens  # out[:rows]: the sampled ids, row i's at i
        embed.embed(self.model.embed, tokens, b.x, t, stream, clear=b.norm_sums if norm_out else b.dummy_f1)
        # int8 rows of a one-token step (see NORM_OUT): the FFN's input and h
        ffn_in, h_row = (1, 2) if norm_out else (0, 1)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            attn_norm, ffn_norm = self._norms2d[i]
            rope_fold = "qkv_rope" in epi  # the QKV GEMV does qkv_post's work itself
            if "attn_norm" in folds:
                self._fused(layer.wqkv, b.x, attn_norm, b.qkv, None, "norm", stream)
            else:
                normed = norm_out and i > 0  # the previous down GEMV wrote this input
                if not normed:
                    self._norm(layer.attn_norm, t, act, stream)
                if rope_fold:
                    self._gemv_rope(i, layer, stream, self._norm_slot(2 * i - 1) if normed else None)
                else:
                    self._linear(layer.wqkv, t, act, b.qkv, None, stream)
            post_in_attention = plan.decode and self.post_in_attention and not rope_fold
            if not (rope_fold or post_in_attention):
                self._qkv_post(i, t, stream)
            self._attention(i, plan, act, stream, post_in_attention)
            if norm_out:
                gemv.gemv_norm(layer.wo, *self._q_in, b.x, b.x, layer.ffn_norm, *self._row(ffn_in), b.norm_sums,
                               2 * i, stream)  # fmt: skip
            else:
                self._linear((layer.wo,), t, act, b.x, b.x, stream)
            if "ffn_norm" in folds:
                self._fused(layer.w_gate_up, b.x, ffn_norm, b.gate_up, None, "norm", stream)
            else:
                fold_norm = one and self.ffn_norm_folded
                if not (norm_out or fold_norm):
                    self._norm(layer.ffn_norm, t, act, stream)
                if "gate_swiglu" in epi:  # h's int8 blocks into row h_row
                    gemv.gemv_swiglu(layer.w_gate_up[0], *self._row(ffn_in, 32), *self._row(h_row), stream,
                                     norm=self._norm_slot(2 * i) if norm_out else None,
                                     fold=(b.x, ffn_norm, self.spec.rms_eps) if fold_norm else None)  # fmt: skip
                else:
                    self._linear(layer.w_gate_up, t, act, b.gate_up, None, stream)
            if "swiglu" in folds:
                self._fused((layer.w_down,), b.gate_up, b.dummy_f32, b.x, b.x, "swiglu", stream)
                continue
            if "gate_swiglu" in epi:  # the down GEMV reads h from row h_row
                if norm_out and i < last:  # and writes the next layer's QKV input into row 0
                    gemv.gemv_norm(layer.w_down, *self._row(h_row, 32), b.x, b.x, self.model.layers[i + 1].attn_norm,
                                   *self._row(0), b.norm_sums, 2 * i + 1, stream)  # fmt: skip
                else:
                    gemv.gemv(layer.w_down, *self._row(h_row, 32), b.x, b.x, 1, "q8", stream)
            else:
                swiglu.swiglu(b.gate_up, b.xq8 if act == "q8" else b.h, b.xs, t, act, stream)
                self._linear((layer.w_down,), t, act, b.x, b.x, stream)
        self._head(plan, stream)

    @property
    def norm_out_taken(self) -> bool:
        """Whether one-token q8 steps take NORM_OUT: it needs both epilogue folds."""
        return self.norm_out and self.can_norm_out and {"qkv_rope", "gate_swiglu"} <= self.epilogues

    @property
    def ffn_norm_folded(self) -> bool:
        """Whether one-token q8 steps take FOLD_FFN_NORM: it needs the gate_swiglu epilogue,
        and NORM_OUT (which has no RMSNorm launch to fold) not taken."""
        return self.fold_ffn_norm and "gate_swiglu" in self.epilogues and not self.norm_out_taken

    def _row(self, k: int, bits: int = 8):
        """Row k of the int8 activations (as int8, or as uint32 words: what GEMVs read) and of
        their scales, each a one-row view."""
        b = self.bufs
        return (b.xq8 if bits == 8 else b.xq32)[k : k + 1], b.xs[k : k + 1]

    def _norm_slot(self, slot: int):
        """A consumer's `norm=` argument: gemv_norm's sum of squares in norm_sums[slot]."""
        return self.bufs.norm_sums, slot, self.spec.rms_eps

    def _epilogues(self, model, bufs) -> frozenset:
        """EPILOGUES this model takes: q8 matrices of the split-loop types (Q4_0 / Q4_1 / Q8_0),
        a fused [gate; up] matrix, and a second token row in the buffers for h."""
        if not self.q8 or bufs.xq8.shape[0] < 2:
            return frozenset()
        ok = {
            "qkv_rope": all(len(l.wqkv) == 1 and l.wqkv[0].qtype in WLOAD for l in model.layers)
            and not self.spec.has_qk_norm,
            "gate_swiglu": all(len(l.w_gate_up) == 1 and l.w_gate_up[0].qtype in WLOAD for l in model.layers)
            and self.spec.d_ffn % gemv.SWIGLU_GROUPS == 0,
        }
        return frozenset(e for e in EPILOGUES if ok[e])

    def epilogues_with(self, folds) -> frozenset:
        """The epilogue folds that can go with these prologue folds (a prologue fold replaces
        the kernel pair an epilogue would fold, or runs the GEMV whose epilogue it would be)."""
        clash = {"qkv_rope": {"attn_norm"}, "gate_swiglu": {"ffn_norm", "swiglu"}}
        return frozenset(e for e in self.can_epilogue if not clash[e] & set(folds))

    @property
    def _q_in(self):
        """Row 0 of the int8 activations and scales: the input of every q8 GEMV of a step."""
        return self.bufs.xq32, self.bufs.xs

    def _gemv_rope(self, i, layer, stream, norm=None):
        b, p = self.bufs, self._posts[i]
        gemv.gemv_rope(self.spec, layer.wqkv[0], *self._q_in, layer.bqkv, self.cos, self.sin, b.tok_pos, b.tok_page,
                       b.tok_slot, b.q, self.k_pool[i], self.v_pool[i], p.interleaved, stream, norm=norm)  # fmt: skip

    # -- pieces ------------------------------------------------------------------------------

    def _norm(self, w, num_rows, act, stream, rows=None):
        b = self.bufs
        out = b.xq8 if act == "q8" else b.h
        has_rows = rows is not None
        norm.rmsnorm(b.x, b.x, w, self.spec.rms_eps, rows if has_rows else b.last_tok, out, b.xs, num_rows, act,
                     False, has_rows, stream)  # fmt: skip

    def _linear(self, parts, num_m, act, out, res, stream):
        b = self.bufs
        col = 0
        for w in parts:
            dst = out if len(parts) == 1 else out[:, col : col + w.rows]
            col += w.rows
            if act == "q8":
                gemv.gemv(w, b.xq32, b.xs, dst, res, num_m, "q8", stream)
            elif num_m <= gemv.MAX_M:
                gemv.gemv(w, b.h, b.dummy_f32, dst, res, num_m, "f32", stream)
            else:
                gemm.gemm(w, b.h, dst, res, num_m, stream)

    def _fused(self, parts, src, norm_w, out, res, prologue, stream):
        col = 0
        for w in parts:
            dst = out if len(parts) == 1 else out[:, col : col + w.rows]
            col += w.rows
            gemv.gemv_fused(w, src, norm_w, self.spec.rms_eps, dst, res, prologue, stream)

    def _post_args(self, layer):
        b, dummy = self.bufs, self.bufs.dummy_f1
        return rope.DecodePost(
            qkv=b.qkv, bias=layer.bqkv if layer.bqkv is not None else dummy,
            q_norm=layer.q_norm if layer.q_norm is not None else dummy,
            k_norm=layer.k_norm if layer.k_norm is not None else dummy, cos=self.cos, sin=self.sin, tok_pos=b.tok_pos,
            tok_page=b.tok_page, tok_slot=b.tok_slot, eps=self.spec.rms_eps, has_bias=layer.bqkv is not None,
            has_qk_norm=layer.q_norm is not None,
        )  # fmt: skip

    def _qkv_post(self, i, t, stream):
        b, p = self.bufs, self._posts[i]
        rope.qkv_post(self.spec, p.qkv, p.bias, p.q_norm, p.k_norm, p.cos, p.sin, p.tok_pos, p.tok_page, p.tok_slot, b.q,
                      self.k_pool[i], self.v_pool[i], t, p.has_bias, p.has_qk_norm, stream)  # fmt: skip

    def _attention(self, i, plan, act, stream, post_in_attention=False):
        b, spec = self.bufs, self.spec
        if plan.decode:
            out = b.xq8 if act == "q8" else b.h
            post = self._posts[i] if post_in_attention else None  # bias / norms / RoPE / K-V write inside
            # one launch or split + combine, by the bucket (rows, splits): fixed per graph key
            context = (plan.num_splits or b.o_part.shape[2]) * self.split_len
            one = attention.use_one_launch(spec.head_dim, spec.num_kv_heads, plan.num_rows, context)
            if post is None and attention.use_lpm(spec.head_dim, self.split_len, plan.num_rows, context,
                                                  self.k_pool.dtype):  # fmt: skip
                attention.attn_decode_lpm(spec, b.q, self.k_pool[i], self.v_pool[i], b.tables, b.seq_lens, out, b.xs,
                                          plan.num_rows, act, -(-context // attention.LP_SPLIT), stream)  # fmt: skip
                return
            if post is None and attention.use_lp(spec.head_dim, self.split_len, plan.num_rows, context, one):
                attention.attn_decode_lp(spec, b.q, self.k_pool[i], self.v_pool[i], b.tables, b.seq_lens, b.o_part,
                                         b.ml_part, out, b.xs, plan.num_rows, act, stream, plan.num_splits or None)  # fmt: skip
                return
            if one:
                attention.attn_decode_one(spec, b.q, self.k_pool[i], self.v_pool[i], b.tables, b.seq_lens, out, b.xs,
                                          plan.num_rows, act, stream, post=post)  # fmt: skip
                return
            # no combine launch for one row whose last split merges in one round (MERGE_UNROLL splits;
            # not with `post`: that pairing is unchecked)
            merge = (self.merge_in_attention and post is None and plan.num_rows == 1
                     and 0 < plan.num_splits <= attention.MERGE_UNROLL)  # fmt: skip
            counters = b.attn_counters if merge else None
            attention.attn_decode(spec, b.q, self.k_pool[i], self.v_pool[i], b.tables, b.seq_lens, b.o_part,
                                  b.ml_part, out, b.xs, plan.num_rows, self.split_len, act, stream,
                                  plan.num_splits or None, post=post, counters=counters)  # fmt: skip
            return
        if self._kv_words is not None:
            kw, vw = self._kv_words[i]
            flash.flash_prefill(spec, b.q, kw, vw, b.tables, b.tiles, b.h, plan.num_tiles, self.k_pool.shape[2], stream)
        else:
            attention.attn_prefill(spec, b.q, self.k_pool[i], self.v_pool[i], b.tables, b.tiles, b.h, plan.num_tiles,
                                   stream)  # fmt: skip
        if act == "q8":
            act_quant.quantize_rows(b.h, b.xq8, b.xs, plan.num_tokens, spec.q_dim, stream)

    def _head(self, plan, stream):
        b = self.bufs
        s = plan.num_sampled
        if s == 0:
            return
        act = "q8" if (self.head_q8 and s <= gemv.MAX_M) else "f32"
        self._norm(self.model.final_norm, s, act, stream, rows=b.last_tok)
        self._linear((self.model.head,), s, act, b.logits, None, stream)
        sampler.sample(b.sampler_args(), s, stream, self.sampler_threads)
