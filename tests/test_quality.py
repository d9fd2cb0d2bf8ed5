"""ninfer.gpu.quality on the reference backend: the figures that guard an inexact fast path."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from heldout import HELDOUT_TEXT

from ninfer.core.runner import SampledToken
from ninfer.gpu import quality
from ninfer.gpu.reference import ReferenceRunner


class NoisyLogits:
    """A runner whose logits carry Gaussian noise: a stand-in for an inexact path."""

    def __init__(self, runner, scale: float, seed: int = 0):
        self._runner = runner
        self._rng = np.random.default_rng(seed)
        self._scale = scale
        self.page_size, self.num_pages, self.spec = runner.page_size, runner.num_pages, runner.spec

    def step(self, rows):
        rows = [attrs.evolve(row, sample=attrs.evolve(row.sample, want_logits=True)) for row in rows]
        out = []
        for sampled in self._runner.step(rows):
            logits = sampled.logits + self._rng.normal(0, self._scale, sampled.logits.shape).astype(np.float32)
            out.append(SampledToken(token_id=int(np.argmax(logits)), logprob=0.0, logits=logits))
        return out


@pytest.fixture(scope="module")
def runner(smollm2):
    return ReferenceRunner(smollm2, num_pages=16, page_size=16)


@pytest.fixture(scope="module")
def text_ids(smollm2):
    return smollm2.tokenizer.encode(HELDOUT_TEXT)[:48]


def test_a_runner_agrees_with_itself(runner, text_ids):
    report = quality.compare(runner, runner, text_ids)
    assert report.num_positions == len(text_ids) - 1
    assert report.top1_agreement == 1.0
    assert report.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert report.perplexity_ratio == pytest.approx(1.0)
    # the next-token targets line up with the positions (~72 here; off by one either way, 10^4+)
    assert 5 < report.perplexity_a < 500


def test_noise_shows_in_every_figure(runner, text_ids):
    report = quality.compare(runner, NoisyLogits(runner, scale=2.0), text_ids)
    assert report.top1_agreement < 0.9
    assert report.mean_kl > 0.1
    assert report.perplexity_ratio > 1.05


def test_greedy_agreement_counts_the_common_prefix(runner, smollm2):
    prompt = smollm2.tokenizer.encode("The lighthouse keeper kept two notebooks.")
    assert quality.greedy_agreement(runner, runner, prompt, 12) == 12
    assert quality.greedy_agreement(runner, NoisyLogits(runner, scale=50.0), prompt, 12) < 12
