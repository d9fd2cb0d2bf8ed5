"""Outputs at every position on CUDA (skipped without a GPU): the runner's all-position logits
and per-layer hidden rows against the numpy reference on the real SmolLM2 GGUF, and `ninfer
score` on CUDA: its perplexity against the reference backend's, and the f32 vs q8 KL through
the decode path (the figure docs/performance.md quotes; run with -s to see it).

The same code paths run at tiny shapes under the CUDA simulator without a GPU:
tests/cuda/kernel_checks.py::check_positions (tests/test_cuda_kernels.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from heldout import HELDOUT_TEXT

from ninfer.gpu.cuda.available import cuda_available

pytestmark = [pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_all_position_logits_and_layer_rows_match_the_reference(smollm2):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    ids = np.asarray(smollm2.tokenizer.encode(HELDOUT_TEXT), np.int32)[:100]
    last = smollm2.spec.num_layers - 1
    greedy = SamplingParams(temperature=0.0)
    asks = SampleSpec(params=greedy, seed=0, token_index=0, want_all_logits=True, hidden_layers=(0, 15, last, -1))
    plain = SampleSpec(params=greedy, seed=0, token_index=0, want_logits=True)
    tables = [np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)]
    rows = [StepRow(seq_id=0, token_ids=ids, start_pos=0, page_table=tables[0], sample=asks),
            StepRow(seq_id=1, token_ids=ids[:20], start_pos=0, page_table=tables[1], sample=plain)]  # fmt: skip
    reference = ReferenceRunner(smollm2, num_pages=16, page_size=16)
    want = reference.step(rows)
    # then the next decode step of row 0, every position asked (on CUDA: a padded graph bucket)
    one = SampleSpec(params=greedy, seed=0, token_index=1, want_all_logits=True)
    nxt = [StepRow(seq_id=0, token_ids=np.array([7], np.int32), start_pos=100, page_table=tables[0], sample=one)]
    [want_next] = reference.step(nxt)
    # 64 tokens a sub-step: the 100-token row runs as two pieces
    for acts, tol in (("f32", 3e-3), ("q8", 6e-2)):
        runner = CudaRunner(smollm2, num_pages=16, page_size=16, max_batch_rows=8, max_tokens_per_step=64,
                            activations=acts)  # fmt: skip
        got = runner.step(rows)
        assert got[0].all_logits.shape == want[0].all_logits.shape == (100, smollm2.spec.vocab_size)
        assert rel_err(got[0].all_logits, want[0].all_logits) < tol, acts
        assert got[0].layer_hidden.shape == (4, 100, smollm2.spec.d_model)
        for j in range(4):
            assert rel_err(got[0].layer_hidden[j], want[0].layer_hidden[j]) < tol, (acts, j)
        assert got[1].all_logits is None and got[1].layer_hidden is None
        assert rel_err(got[1].logits, want[1].logits) < tol
        [got_next] = runner.step(nxt)
        assert got_next.all_logits.shape == (1, smollm2.spec.vocab_size)
        assert rel_err(got_next.all_logits, want_next.all_logits) < tol, acts
        runner.close()


def _score(capsys, monkeypatch, smollm2, *args) -> dict:
    import ninfer.runtime
    from ninfer.cli.main import main

    monkeypatch.setattr(ninfer.runtime, "load", lambda *a, **k: smollm2)
    capsys.readouterr()
    assert main(["score", *args, "--json", "--no-progress", "--max-context", "512", "--kv-capacity", "4096"]) == 0
    return json.loads(capsys.readouterr().out)


def test_score_on_cuda(smollm2, tmp_path, capsys, monkeypatch):
    text = tmp_path / "held.txt"
    text.write_text(HELDOUT_TEXT)
    ref = _score(capsys, monkeypatch, smollm2, str(text), "--backend", "reference")["total"]
    f32_saved = str(tmp_path / "f32.safetensors")
    f32 = _score(capsys, monkeypatch, smollm2, str(text), "--backend", "cuda", "--activations", "f32", "--decode-path",
                 "--save-logits", f32_saved)  # fmt: skip
    assert f32["backend"] == "cuda" and f32["total"]["perplexity"] == pytest.approx(ref["perplexity"], rel=5e-3)
    prefill = _score(capsys, monkeypatch, smollm2, str(text), "--backend", "cuda", "--activations", "f32",
                     "--reference-logits", f32_saved)["total"]  # fmt: skip
    q8 = _score(capsys, monkeypatch, smollm2, str(text), "--backend", "cuda", "--activations", "q8", "--decode-path",
                "--reference-logits", f32_saved)["total"]  # fmt: skip
    print(f"\nscore on CUDA, {q8['scored_tokens']} tokens: reference perplexity {ref['perplexity']:.4f}; f32 decode "
          f"{f32['total']['perplexity']:.4f}; f32 prefill vs f32 decode: mean KL {prefill['mean_kl']:.2e}; q8 decode "
          f"vs f32 decode: mean KL {q8['mean_kl']:.5f} nats, top-1 {q8['top1_agreement']:.4f}, perplexity "
          f"{q8['perplexity']:.4f} ({(q8['perplexity'] / q8['reference_perplexity'] - 1) * 100:+.2f} %)")  # fmt: skip
    assert prefill["mean_kl"] < 1e-3 and prefill["top1_agreement"] >= 0.99
    assert q8["mean_kl"] < 0.01 and q8["top1_agreement"] >= 0.95
    assert abs(q8["perplexity"] / q8["reference_perplexity"] - 1) < 0.01
