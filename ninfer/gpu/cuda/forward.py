"""The launch sequence of one forward over staged inputs: the recipe a CUDA graph captures.

`Forward.launch(step)` issues every kernel of a step on one stream, reading only the static
buffers (buffers.py), so the same calls can run eagerly or be captured once per batch bucket.
Per layer (activations `act` = int8 blocks for the dp4a GEMV, or float32):

    rmsnorm(x) -> act ; QKV linear ; bias / q-k norm / RoPE / K-V write ; attention -> act
    x += O linear ; rmsnorm(x) -> act ; gate+up linear ; SwiGLU -> act ; x += down linear

then the final norm of each sampled row's last token, the LM head (its columns past the
tokenizer's ids set to -inf where the vocabulary is padded) and the sampler. One-token
q8 steps fold small kernels into the GEMVs next to them (gemv_folds.py), as the `KernelPlan`
allows: where every layer's matrices are small enough, each RMSNorm into the QKV / gate+up
GEMV after it and SwiGLU into the down GEMV (`folds`: three kernels fewer a layer); where they
are too large (an 8B model), bias / RoPE / K-V write into the QKV GEMV and SwiGLU into the
gate+up GEMV before it (`epilogues`: two fewer).
"""

from __future__ import annotations

import attrs

from ninfer.gpu.cuda.kernels import (
    act_quant, attn_decode, attn_lp, attn_prefill, embed, flash, gated_attn, gemm, gemv, gemv_folds, norm, rope, sampler,
    swiglu,
)
from ninfer.gpu.cuda.kernels.qdot import SPLIT_QTYPES
from ninfer.gpu.cuda.plan import DEFAULT, KernelPlan


@attrs.frozen(kw_only=True)
class StepPlan:
    num_tokens: int
    num_rows: int
    num_sampled: int  # rows whose last token goes through the head (head inputs: last_tok[:S])
    decode: bool  # every row has one token: split-K decode attention
    num_tiles: int = 0  # prefill attention tiles (general path)
    num_splits: int = 0  # decode attention splits to launch (0: every split the buffers hold)

    @property
    def act(self) -> str:
        return "q8" if self.num_tokens <= gemv.MAX_M else "f32"


@attrs.frozen(kw_only=True)
class _QkvPost:
    """rope.qkv_post's per-layer arguments (absent bias / norms: a dummy array and False)."""

    bias: object
    q_norm: object
    k_norm: object
    has_bias: bool
    has_qk_norm: bool
    interleaved: bool = False


class Forward:
    """Owns references to the device model, buffers, KV pool and RoPE tables; launches a step's
    kernels as `plan` chooses them."""

    def __init__(self, spec, model, bufs, k_pool, v_pool, cos, sin, *, q8: bool, split_len: int, sampler_threads: int,
                 plan: KernelPlan = DEFAULT):  # fmt: skip
        self.spec = spec
        self.model = model
        self.bufs = bufs
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.cos = cos
        self.sin = sin
        self.plan = plan
        self.q8 = q8 and model.linears_quantized
        self.head_q8 = q8 and model.head.qtype not in gemv.FLOAT_QTYPES
        self.split_len = split_len
        self.sampler_threads = sampler_threads
        self.num_ids = spec.num_sampled_ids  # head columns past the tokenizer's ids are masked
        # the folds one-token q8 steps take: every layer's matrices must fit gemv_fused
        mats = {"attn_norm": lambda l: l.wqkv, "ffn_norm": lambda l: l.w_gate_up, "swiglu": lambda l: (l.w_down,)}
        self.folds = frozenset(
            f for f in plan.folds
            if self.q8 and all(gemv_folds.fusable(w) for layer in model.layers for w in mats[f](layer))
        )  # fmt: skip
        # the epilogue folds of one-token q8 steps, where the prologue folds above are not taken
        # (where a prologue fold is taken, it already removes that kernel)
        self.can_epilogue = self._epilogues(model, bufs)
        self.epilogues = self.epilogues_with(self.folds)
        self._make_views(k_pool, v_pool)
        d = spec.d_model
        self._norms2d = [(layer.attn_norm.reshape(1, d), layer.ffn_norm.reshape(1, d)) for layer in model.layers]
        self._posts = [self._post_args(layer) for layer in model.layers]

    def _make_views(self, k_pool, v_pool) -> None:
        """The per-layer K / V pool views (and, for float16 pools, the f16-pair words prefill
        attention reads on tensor cores), index j for the j-th layer with a KV pool. Device-array
        views are made once: numba slices a device array in ~30 us, and a step's launch sequence
        took hundreds of them (a third of the warm-up's capture time)."""
        self._kv_words = None
        if flash.supports(self.spec.head_dim, k_pool.dtype):
            self._kv_words = [(flash.words(k_pool[j]), flash.words(v_pool[j])) for j in range(k_pool.shape[0])]
        self._pools = [(k_pool[j], v_pool[j]) for j in range(k_pool.shape[0])]
        self._rows = {}  # `_row`'s views, made on first use

    def launch(self, step: StepPlan, stream, after_layer=None) -> None:
        """Queue the step's kernels; `after_layer(i)`, when given, is called once layer i's are
        queued (the residual x then holds that layer's output: per-layer hidden rows, eager
        launches only)."""
        b = self.bufs
        act = "q8" if (self.q8 and step.act == "q8") else "f32"
        t = step.num_tokens
        one = act == "q8" and t == 1
        folds = self.folds if one else frozenset()
        epi = self.epilogues if one else frozenset()
        embed.embed(self.model.embed, b.tokens, b.out, b.x, t, stream)  # FED tokens: out[t], the sampled ids
        for i, layer in enumerate(self.model.layers):
            attn_norm, ffn_norm = self._norms2d[i]
            if "attn_norm" in folds:
                self._fused(layer.wqkv, b.x, attn_norm, b.qkv, None, "norm", stream)
            else:
                self._norm(layer.attn_norm, t, act, stream)
                if "qkv_rope" in epi:  # the QKV GEMV does qkv_post's work itself
                    self._gemv_rope(i, layer, stream)
                else:
                    self._linear(layer.wqkv, t, act, b.qkv, None, stream)
            if "qkv_rope" not in epi:
                self._qkv_post(i, t, stream)
            self._attention(i, step, act, stream)
            self._linear((layer.wo,), t, act, b.x, b.x, stream)
            if "ffn_norm" in folds:
                self._fused(layer.w_gate_up, b.x, ffn_norm, b.gate_up, None, "norm", stream)
            else:
                self._norm(layer.ffn_norm, t, act, stream)
                if "gate_swiglu" in epi:  # h's int8 blocks into row 1
                    gemv_folds.gemv_swiglu(layer.w_gate_up[0], *self._row(0, 32), *self._row(1), stream, plan=self.plan)
                else:
                    self._linear(layer.w_gate_up, t, act, b.gate_up, None, stream)
            if "swiglu" in folds:
                self._fused((layer.w_down,), b.gate_up, b.dummy_f32, b.x, b.x, "swiglu", stream)
            elif "gate_swiglu" in epi:  # the down GEMV reads h from row 1
                gemv.gemv(layer.w_down, *self._row(1, 32), b.x, b.x, 1, "q8", stream, plan=self.plan)
            else:
                swiglu.swiglu(b.gate_up, b.xq8 if act == "q8" else b.h, b.xs, t, act, stream)
                self._linear((layer.w_down,), t, act, b.x, b.x, stream)
            if after_layer is not None:
                after_layer(i)
        self._head(step, stream)

    def _row(self, k: int, bits: int = 8):
        """Row k of the int8 activations (as int8, or as uint32 words: what GEMVs read) and of
        their scales, each a one-row view."""
        key = (k, bits)
        if key not in self._rows:
            b = self.bufs
            self._rows[key] = (b.xq8 if bits == 8 else b.xq32)[k : k + 1], b.xs[k : k + 1]
        return self._rows[key]

    def _epilogues(self, model, bufs) -> frozenset:
        """The plan's epilogue folds this model can take: q8 matrices of the split-loop types
        (Q4_0 / Q4_1 / Q8_0), a fused [gate; up] matrix, and a second token row in the buffers
        for h."""
        if not self.q8 or bufs.xq8.shape[0] < 2:
            return frozenset()
        ok = {
            "qkv_rope": all(len(l.wqkv) == 1 and l.wqkv[0].qtype in SPLIT_QTYPES for l in model.layers)
            and not self.spec.has_qk_norm,
            "gate_swiglu": all(len(l.w_gate_up) == 1 and l.w_gate_up[0].qtype in SPLIT_QTYPES for l in model.layers)
            and self.spec.d_ffn % gemv_folds.SWIGLU_GROUPS == 0,
        }
        return frozenset(e for e in self.plan.epilogues if ok[e])

    def epilogues_with(self, folds) -> frozenset:
        """The epilogue folds that can go with these prologue folds (a prologue fold replaces
        the kernel pair an epilogue would fold, or runs the GEMV whose epilogue it would be)."""
        clash = {"qkv_rope": {"attn_norm"}, "gate_swiglu": {"ffn_norm", "swiglu"}}
        return frozenset(e for e in self.can_epilogue if not clash[e] & set(folds))

    def _gemv_rope(self, i, layer, stream):
        b, p = self.bufs, self._posts[i]
        gemv_folds.gemv_rope(self.spec, layer.wqkv[0], b.xq32, b.xs, layer.bqkv, self.cos, self.sin, b.tok_pos,
                             b.tok_page, b.tok_slot, b.q, *self._pools[i], p.interleaved, stream,
                             plan=self.plan)  # fmt: skip

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
                gemv.gemv(w, b.xq32, b.xs, dst, res, num_m, "q8", stream, plan=self.plan)
            elif num_m <= gemv.MAX_M:
                gemv.gemv(w, b.h, b.dummy_f32, dst, res, num_m, "f32", stream, plan=self.plan)
            else:
                gemm.gemm(w, b.h, dst, res, num_m, stream)

    def _fused(self, parts, src, norm_w, out, res, prologue, stream):
        col = 0
        for w in parts:
            dst = out if len(parts) == 1 else out[:, col : col + w.rows]
            col += w.rows
            gemv_folds.gemv_fused(w, src, norm_w, self.spec.rms_eps, dst, res, prologue, stream, plan=self.plan)

    def _post_args(self, layer):
        dummy = self.bufs.dummy_f1
        return _QkvPost(
            bias=layer.bqkv if layer.bqkv is not None else dummy,
            q_norm=layer.q_norm if layer.q_norm is not None else dummy,
            k_norm=layer.k_norm if layer.k_norm is not None else dummy,
            has_bias=layer.bqkv is not None, has_qk_norm=layer.q_norm is not None,
        )  # fmt: skip

    def _qkv_post(self, i, t, stream):
        b, p = self.bufs, self._posts[i]
        rope.qkv_post(self.spec, b.qkv, p.bias, p.q_norm, p.k_norm, self.cos, self.sin, b.tok_pos, b.tok_page, b.tok_slot,
                      b.q, *self._pools[i], t, p.has_bias, p.has_qk_norm, stream)  # fmt: skip

    def _attention(self, i, step, act, stream):
        b, spec = self.bufs, self.spec
        if step.decode:
            out = b.xq8 if act == "q8" else b.h
            # one launch, lanes over positions or split + combine, by the bucket (rows, splits): fixed per graph key
            context = (step.num_splits or b.o_part.shape[2]) * self.split_len
            one = attn_decode.use_one_launch(spec.head_dim, spec.num_kv_heads, step.num_rows, context)
            if attn_lp.use_lp(spec.head_dim, self.split_len, step.num_rows, context, one, self.plan):
                attn_lp.attn_decode_lp(spec, b.q, *self._pools[i], b.tables, b.seq_lens, b.o_part,
                                       b.ml_part, out, b.xs, step.num_rows, act, stream, step.num_splits or None,
                                       plan=self.plan)  # fmt: skip
            elif one:
                attn_decode.attn_decode_one(spec, b.q, *self._pools[i], b.tables, b.seq_lens, out, b.xs,
                                            step.num_rows, act, stream)  # fmt: skip
            else:
                attn_decode.attn_decode(spec, b.q, *self._pools[i], b.tables, b.seq_lens, b.o_part,
                                        b.ml_part, out, b.xs, step.num_rows, self.split_len, act, stream,
                                        step.num_splits or None)  # fmt: skip
            return
        if self._kv_words is not None:
            kw, vw = self._kv_words[i]
            flash.flash_prefill(spec, b.q, kw, vw, b.tables, b.tiles, b.h, step.num_tiles, self.k_pool.shape[2], stream)
        else:
            attn_prefill.attn_prefill(spec, b.q, *self._pools[i], b.tables, b.tiles, b.h, step.num_tiles,
                                      stream)  # fmt: skip
        if act == "q8":
            act_quant.quantize_rows(b.h, b.xq8, b.xs, step.num_tokens, spec.q_dim, stream)

    def _head(self, step, stream):
        b = self.bufs
        s = step.num_sampled
        if s == 0:
            return
        act = "q8" if (self.head_q8 and s <= gemv.MAX_M) else "f32"
        self._norm(self.model.final_norm, s, act, stream, rows=b.last_tok)
        self._linear((self.model.head,), s, act, b.logits, None, stream)
        gated_attn.mask_logits(b.logits, self.num_ids, s, stream)  # padded vocabularies only
        sampler.sample(b.sampler_args, s, stream, self.sampler_threads, plan=self.plan)
