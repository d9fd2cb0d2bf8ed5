"""Hybrid (qwen35) models on the CUDA runner against the ReferenceRunner.

Under numba's CUDA simulator (a child process: the simulator must be switched on before numba
is imported, and the PTX tests of the same pytest run need the real target), on a tiny random
hybrid (GDN, gated attention, GDN; float32 weights and KV, so tokens must match exactly):

* a prompt in one chunk beside its first chunk and a one-token prompt, the second chunk beside
  the others' decode rows (a mixed step), then 8 greedy decode steps of the three (padded to
  a graph bucket of 4): identical tokens, close logits and recurrent states (so two chunks ==
  one chunk, as the reference's are; the simulator takes 3 decode steps);
* a prompt split over sub-steps (max_tokens_per_step) beside another; slots: the pool full, a release, the slot reused by a new sequence (which must start from
  zeros, not from the slot's old state); rows that do not continue their state are refused
  before anything runs;
* a padded vocabulary: ids past tokenizer_vocab_size are never sampled nor in the top
  logprobs, even where the head favours them;
* int8 activations (the served default; Q8_0 weights): logits within q8's tolerance of the
  reference over a prefill and six decode steps (the simulator: three).

The same checks run at a real shape (Qwen3.5's layer shapes, Q8_0, a float16 KV pool) on a
GPU (skipped here).

    python tests/test_cuda_hybrid.py tiny|real    # prints {check: "ok" | traceback}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import attrs
import numpy as np
import pytest

import child_jobs

CHECKS = ("decode", "slots", "padded_vocab", "warm_up", "q8")


# -- the checks (run in the child, or on the GPU) ---------------------------------------------------


def _setup(scale, num_layers=None, tiny_qtype="F32"):
    """(spec, model, KV dtype, logits rtol); tiny: GDN, attention, GDN (num_layers=2: GDN,
    attention), float32 weights unless `tiny_qtype` says otherwise."""
    from ninfer.gpu.cuda.random_model import random_model, random_spec

    if scale == "tiny":
        spec = random_spec("tiny-hybrid", num_layers=num_layers or 3)
        return spec, random_model(spec, tiny_qtype, embed_qtype=tiny_qtype, seed=7), np.float32, 1e-4
    # the served configuration: Q8_0 weights, a float16 KV pool (the tensor-core prefill attention)
    # (every fourth layer is full attention: a short model keeps at least one, 4 layers)
    spec = random_spec("qwen35-like", max_context=512, num_layers=max(num_layers or 8, 4))
    return spec, random_model(spec, "Q8_0", embed_qtype="Q8_0", seed=7), np.float16, 2e-2


def _runners(model, kv_dtype, **kw):
    from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    kw = dict(dict(max_batch_rows=4, max_tokens_per_step=16, max_sequences=3), **kw)
    if SIMULATOR:
        kw["split_len"] = 8  # several decode-attention splits at tiny contexts
    cr = CudaRunner(model, num_pages=32, page_size=4, kv_dtype=kv_dtype, **kw)
    return cr, ReferenceRunner(model, num_pages=32, page_size=4)


def _spec(index=0, **kw):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec

    return SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=index, want_logits=True, **kw)


def _row(seq_id, tokens, start, **kw):
    from ninfer.core.runner import StepRow

    table = np.arange(8, dtype=np.int32) + 8 * seq_id % 32  # 8 pages (32 positions) a sequence
    return StepRow(seq_id=seq_id, token_ids=np.asarray(tokens, np.int32), start_pos=start, page_table=table,
                   sample=_spec(**kw))  # fmt: skip


def _same(cr, rr, rows, rtol, what):
    """One step on both runners: equal tokens, close logits; returns the tokens."""
    got, want = cr.step(rows), rr.step(rows)
    for row, g, w in zip(rows, got, want, strict=True):
        if row.sample is None:
            assert g is None and w is None
            continue
        scale = np.abs(w.logits).max()
        err = np.abs(g.logits - w.logits).max()
        assert err <= rtol * scale, f"{what}, sequence {row.seq_id}: logits off by {err:.3g} (scale {scale:.3g})"
        assert g.token_id == w.token_id, f"{what}, sequence {row.seq_id}: token {g.token_id} != {w.token_id}"
    return [g.token_id if g is not None else None for g in got]


def _same_state(cr, rr, seq_id, rtol, what):
    got, want = cr.recurrent_state(seq_id), rr.recurrent_state(seq_id)
    assert got.num_tokens == want.num_tokens, f"{what}: {got.num_tokens} tokens != {want.num_tokens}"
    for j, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        for name in ("conv", "ssm"):
            a, b = getattr(g, name), getattr(w, name)
            err = np.abs(a - b).max()
            assert err <= rtol * max(np.abs(b).max(), 1.0), f"{what}: GDN layer {j} {name} state off by {err:.3g}"


def check_decode(scale):
    """Prefill, a prompt in two chunks beside a decoding row (a mixed step), 8 decode steps."""
    spec, model, kv, rtol = _setup(scale)
    cr, rr = _runners(model, kv)
    prompt = np.random.default_rng(0).integers(0, spec.vocab_size, 6)
    # sequence 1: the prompt in one chunk; sequence 2: its first 4 tokens (nothing sampled);
    # sequence 3: a one-token prompt (a fresh state in a one-token row)
    rows = [_row(1, prompt, 0), attrs.evolve(_row(2, prompt[:4], 0), sample=None), _row(3, prompt[:1], 0)]
    (t1, _, t3) = _same(cr, rr, rows, rtol, "prefill")
    # sequence 2's second chunk (prefill from position 4) beside the others' first decode rows
    first = t1
    rows = [_row(1, [t1], 6, index=1), _row(2, prompt[4:], 4), _row(3, [t3], 1, index=1)]
    (t1, t2, t3) = _same(cr, rr, rows, rtol, "mixed step")
    assert t2 == first, f"the prompt in two chunks sampled {t2}, in one chunk {first}"
    pos = {1: 7, 2: 6, 3: 2}
    toks = {1: t1, 2: t2, 3: t3}
    # three rows decode (a bucket of 4: a padding row): the decode kernels; the simulator's 3
    # steps take sequence 1 into a second page and a second decode-attention split (split_len
    # 8), after which each step runs the same kernels again
    for i in range(3 if scale == "tiny" else 8):
        rows = [_row(s, [toks[s]], pos[s], index=i + 1) for s in pos]
        toks = dict(zip(pos, _same(cr, rr, rows, rtol, f"decode step {i}"), strict=True))
        pos = {s: p + 1 for s, p in pos.items()}
    for s in pos:
        _same_state(cr, rr, s, rtol, f"sequence {s}")
    assert cr.num_recurrent_states == 3


def _refused(runner, rows, words):
    try:
        runner.step(rows)
    except ValueError as e:
        assert words in str(e), f"refused for another reason: {e}"
        return
    raise AssertionError(f"a step over {[(r.seq_id, r.start_pos) for r in rows]} was not refused")


def check_slots(scale):
    """Sub-steps, a full pool, refusals, a release and the slot's reuse, a replay."""
    spec, model, kv, rtol = _setup(scale, num_layers=2)
    cr, rr = _runners(model, kv, max_sequences=2, max_tokens_per_step=4)
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, spec.vocab_size, n) for n in (6, 2, 3))
    # 8 tokens in sub-steps of 4: sequence 1's prompt continues into the second one
    _same(cr, rr, [_row(1, a, 0), _row(2, b, 0)], rtol, "prefill in sub-steps")
    _refused(cr, [_row(3, c, 0)], "no free recurrent-state slot")
    _refused(cr, [_row(1, [1], 5)], "continues at position 5")  # one token short of its state
    _refused(cr, [_row(4, [1], 7)], "its recurrent state is none")
    assert cr.num_recurrent_states == 2
    cr.release_sequence(1)
    rr.release_sequence(1)
    _same(cr, rr, [_row(3, c, 0), _row(2, [5], 2, index=1)], rtol, "a new sequence in a released slot")
    _same_state(cr, rr, 3, rtol, "the reused slot")  # started from zeros, not from sequence 1's state
    _refused(cr, [_row(1, [1], 6)], "its recurrent state is none")
    # a sequence that starts over (replay after a pause) keeps its slot and starts from zeros
    _same(cr, rr, [_row(3, c[:2], 0)], rtol, "replay from position 0")
    _same_state(cr, rr, 3, rtol, "the replayed sequence")
    assert cr.num_recurrent_states == 2


def check_padded_vocab(scale):
    from ninfer.models.weights import ModelWeights, StoredTensor

    spec, model, kv, rtol = _setup(scale, num_layers=2)
    num_ids = spec.vocab_size - 24
    _, weights = model
    tensors = dict(weights)
    head_name = "embed" if spec.tie_embeddings else "lm_head"
    head = tensors[head_name].dequantize().astype(np.float32)
    head[num_ids:] *= 20.0  # the padding rows would win every argmax
    tensors[head_name] = StoredTensor("F32", head.shape, head)
    padded = attrs.evolve(spec, tokenizer_vocab_size=num_ids)
    model = (padded, ModelWeights(tensors, spec.num_layers))
    cr, rr = _runners(model, kv)
    prompt = np.random.default_rng(3).integers(0, num_ids, 6)
    rows = [_row(1, prompt, 0, num_top_logprobs=5)]
    (got,), (want,) = cr.step(rows), rr.step(rows)
    assert int(np.argmax(want.logits)) >= num_ids, "the head should favour a padding id here"
    assert got.token_id == want.token_id < num_ids, f"sampled {got.token_id}, the reference {want.token_id}"
    assert (got.top_ids < num_ids).all(), f"padding ids in the top logprobs: {got.top_ids}"
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    # the favoured padding ids push the real ones ~780 nats down: float32 keeps ~1e-5 relative there
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-3)


def check_warm_up(scale):
    """The hybrid warm-up runs real sequences (ids no request takes) and lets every slot go."""
    spec, model, kv, rtol = _setup(scale, num_layers=2)
    cr, rr = _runners(model, kv, max_batch_rows=1, max_tokens_per_step=2, max_sequences=2)
    assert cr.warm_up_hybrid(max_rows=4) == 3  # a 2-token prefill; one row's first token, then its decode
    assert cr.num_recurrent_states == 0
    _same(cr, rr, [_row(1, [3, 4], 0), _row(2, [5], 0)], rtol, "a step after the warm-up")


def check_q8(scale):
    """int8 activations (what `ninfer serve` runs): two prompts, then six decode steps of both
    (a graph bucket on the GPU), teacher-forced with the reference's greedy tokens: logits within
    q8's tolerance of the float reference at every step, and the recurrent states close."""
    spec, model, kv, _ = _setup(scale, num_layers=2, tiny_qtype="Q8_0")
    cr, rr = _runners(model, kv, activations="q8")
    assert cr.forward.q8 and cr.forward.head_q8, "a Q8_0 hybrid's linears and head should take the int8 path"
    rng = np.random.default_rng(4)
    rows = [_row(1, rng.integers(0, spec.vocab_size, 6), 0), _row(2, rng.integers(0, spec.vocab_size, 3), 0)]
    pos = {1: 6, 2: 3}
    for i in range(4 if scale == "tiny" else 7):  # the simulator: three decode steps, not six
        got, want = cr.step(rows), rr.step(rows)
        for row, g, w in zip(rows, got, want, strict=True):
            scale_ = np.abs(w.logits).max()
            err = np.abs(g.logits - w.logits).max()
            assert err <= 3e-2 * scale_, f"step {i}, sequence {row.seq_id}: q8 logits off by {err:.3g} ({scale_:.3g})"
        rows = [_row(r.seq_id, [w.token_id], pos[r.seq_id], index=i + 1) for r, w in zip(rows, want, strict=True)]
        pos = {s: p + 1 for s, p in pos.items()}
    for s in (1, 2):
        _same_state(cr, rr, s, 3e-2, f"q8: sequence {s}")


def run_checks(scale: str, names) -> dict[str, str]:
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            globals()[f"check_{name}"](scale)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - each check's failure is its own test's message
            results[name] = traceback.format_exc()
        print(f"check {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return results


# -- pytest --------------------------------------------------------------------------------------


JOB = child_jobs.simulator_job("hybrid_checks", [sys.executable, str(Path(__file__).resolve()), "tiny", *CHECKS], 1800,
                               __name__, cost_s=240)


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    return child_jobs.json_results(JOB)


@pytest.mark.parametrize("name", CHECKS)
def test_hybrid_cuda_runner_matches_reference_under_simulator(sim_results, name):
    assert sim_results.get(name) == "ok", sim_results.get(name, "check did not run")


def _has_gpu() -> bool:
    from ninfer.gpu.cuda.available import cuda_available

    return cuda_available()


@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", CHECKS)
def test_hybrid_cuda_runner_matches_reference_on_gpu(name):
    results = run_checks("real", [name])
    assert results[name] == "ok", results[name]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from cuda.simfast import speed_up_simulator

        speed_up_simulator()
    print(json.dumps(run_checks(sys.argv[1], sys.argv[2:] or CHECKS)))
