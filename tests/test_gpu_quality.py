"""The fast default on CUDA (q8 activations) against float activations and the CPU reference,
on the real GGUF and held-out text (skipped without a GPU). Prints the figures docs/performance.md
quotes (run with -s)."""

from __future__ import annotations

import pytest
from heldout import HELDOUT_TEXT

from ninfer.gpu import quality
from ninfer.gpu.cuda.available import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")

NUM_PAGES, PAGE_SIZE = 32, 16


@pytest.fixture(scope="module")
def runners(smollm2):
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.reference import ReferenceRunner

    made = {act: CudaRunner(smollm2, num_pages=NUM_PAGES, page_size=PAGE_SIZE, activations=act) for act in ("q8", "f32")}
    made["reference"] = ReferenceRunner(smollm2, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    yield made
    for runner in made.values():
        runner.close()


@pytest.fixture(scope="module")
def text_ids(smollm2):
    return smollm2.tokenizer.encode(HELDOUT_TEXT)[: NUM_PAGES * PAGE_SIZE]


@pytest.mark.parametrize("against", ["f32", "reference"])
def test_q8_default_stays_close(runners, text_ids, against, smollm2):
    report = quality.compare(runners[against], runners["q8"], text_ids)
    prompt = smollm2.tokenizer.encode("The lighthouse keeper kept two notebooks.")
    greedy = quality.greedy_agreement(runners[against], runners["q8"], prompt, 64)
    print(f"\nq8 vs {against}: {report.num_positions} positions, top-1 agreement {report.top1_agreement:.4f}, "
          f"mean KL {report.mean_kl:.5f} nats, perplexity {report.perplexity_a:.3f} -> {report.perplexity_b:.3f} "
          f"({(report.perplexity_ratio - 1) * 100:+.2f} %), greedy agreement {greedy} / 64 tokens")
    assert abs(report.perplexity_ratio - 1) < 0.01
    assert report.top1_agreement >= 0.95
    assert report.mean_kl < 0.01


def test_f32_matches_the_reference(runners, text_ids):
    report = quality.compare(runners["reference"], runners["f32"], text_ids)
    print(f"\nf32 vs reference: top-1 {report.top1_agreement:.4f}, mean KL {report.mean_kl:.2e}, "
          f"perplexity {report.perplexity_a:.3f} -> {report.perplexity_b:.3f}")
    assert report.top1_agreement >= 0.99
    assert report.mean_kl < 1e-3
