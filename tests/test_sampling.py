"""The reference sampler against straightforward, independent computations (float64, loops)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec
from ninfer.gpu.sampling import (
    NoAllowedToken,
    apply_penalties,
    kept_candidates,
    log_softmax,
    sample,
    sample_rows,
    uniform,
)

VOCAB = 64


def spec(seed=0, token_index=0, **kwargs) -> SampleSpec:
    extra = {k: kwargs.pop(k) for k in ("prompt_ids", "output_ids", "allowed", "num_top_logprobs") if k in kwargs}
    return SampleSpec(params=SamplingParams(**kwargs), seed=seed, token_index=token_index, **extra)


def random_logits(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def probs64(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def order_by_prob(p: np.ndarray) -> list[int]:
    """Token ids by (prob desc, id asc), the draw order the sampler documents."""
    return sorted(range(len(p)), key=lambda i: (-p[i], i))


# -- uniform(seed, index) -----------------------------------------------------------------


def splitmix64_uint64(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The documented formula in numpy uint64 wrapping arithmetic, as a GPU kernel computes it."""
    with np.errstate(over="ignore"):
        x = seeds.astype(np.uint64) + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(40)).astype(np.float64) / 2**24


def test_uniform_matches_the_documented_uint64_formula():
    rng = np.random.default_rng(1)
    seeds = rng.integers(0, 2**63, size=500, dtype=np.uint64)
    indices = rng.integers(0, 100_000, size=500, dtype=np.uint64)
    expected = splitmix64_uint64(seeds, indices)
    got = np.array([uniform(int(s), int(i)) for s, i in zip(seeds, indices)])
    np.testing.assert_array_equal(got, expected)


def test_uniform_is_in_unit_interval_and_spread_evenly():
    values = np.array([uniform(1234, i) for i in range(20_000)])
    assert values.min() >= 0.0 and values.max() < 1.0
    counts, _ = np.histogram(values, bins=10, range=(0, 1))
    assert np.all(np.abs(counts - 2000) < 200)  # ~4.7 sigma of a binomial(20000, 0.1)
    assert len({uniform(s, 0) for s in range(1000)}) > 990  # seeds give different streams


def test_uniform_handles_negative_and_huge_seeds_modulo_2_64():
    assert uniform(-1, 3) == uniform(2**64 - 1, 3)
    assert uniform(2**64 + 5, 7) == uniform(5, 7)


# -- read-out -------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits_whatever_the_knobs():
    logits = random_logits(2)
    expected = np.log(probs64(logits))
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[3, 9, 27]] = True
    knobs = spec(seed=9, temperature=0.7, top_k=5, presence_penalty=1.5, output_ids=np.array([3, 3]),
                 allowed=allowed, num_top_logprobs=20)  # fmt: skip
    token = sample(logits, knobs)
    assert token.token_id in (3, 9, 27)
    assert token.logprob == pytest.approx(expected[token.token_id], abs=1e-5)
    assert list(token.top_ids) == order_by_prob(expected)[:20]
    np.testing.assert_allclose(token.top_logprobs, expected[token.top_ids], atol=1e-5)
    np.testing.assert_allclose(log_softmax(logits), expected, atol=1e-5)


def test_top_logprobs_break_ties_by_lower_id():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[[40, 7, 12, 50]] = 2.0  # four-way tie at the top
    logits[[1, 60]] = 1.0
    token = sample(logits, spec(temperature=0, num_top_logprobs=6))
    assert list(token.top_ids) == [7, 12, 40, 50, 1, 60]
    assert token.token_id == 7  # greedy also takes the lowest id on ties


def test_want_logits_returns_the_raw_row():
    logits = random_logits(3)
    knobs = SampleSpec(params=SamplingParams(temperature=0), seed=0, token_index=0, want_logits=True)
    np.testing.assert_array_equal(sample(logits, knobs).logits, logits)


# -- penalties and mask ---------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = random_logits(4)
    prompt, output = np.array([1, 2, 2, 5]), np.array([5, 8, 8, 8])
    expected = logits.astype(np.float64).copy()
    for token_id in {1, 2, 5, 8}:
        value = expected[token_id]
        expected[token_id] = value / 1.3 if value > 0 else value * 1.3
    got = apply_penalties(logits, spec(repetition_penalty=1.3, prompt_ids=prompt, output_ids=output))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = random_logits(5)
    prompt, output = np.array([9, 9, 9]), np.array([3, 4, 4, 4, 10])
    expected = logits.astype(np.float64).copy()
    for token_id in set(output.tolist()):
        count = int((output == token_id).sum())
        expected[token_id] -= 0.5 + 0.25 * count
    knobs = spec(presence_penalty=0.5, frequency_penalty=0.25, prompt_ids=prompt, output_ids=output)
    np.testing.assert_allclose(apply_penalties(logits, knobs), expected, rtol=1e-6)


def test_penalties_change_the_greedy_choice():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[10], logits[11] = 3.0, 2.5
    assert sample(logits, spec(temperature=0)).token_id == 10
    assert sample(logits, spec(temperature=0, repetition_penalty=1.5, prompt_ids=np.array([10]))).token_id == 11
    assert sample(logits, spec(temperature=0, frequency_penalty=0.3, output_ids=np.array([10, 10]))).token_id == 11


def test_grammar_mask_excludes_tokens_and_an_empty_mask_is_an_error():
    logits = random_logits(6)
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[5, 17]] = True
    expected_greedy = 5 if logits[5] >= logits[17] else 17
    assert sample(logits, spec(temperature=0, allowed=allowed)).token_id == expected_greedy
    drawn = {sample(logits, spec(seed=3, token_index=i, allowed=allowed)).token_id for i in range(200)}
    assert drawn == {5, 17}
    with pytest.raises(NoAllowedToken, match="allows no next token"):
        sample(logits, spec(temperature=0, allowed=np.zeros(VOCAB, dtype=bool)))


# -- the filters: each keeps exactly the expected set --------------------------------------


def kept_set(logits, **kwargs) -> set[int]:
    ids, _ = kept_candidates(logits, spec(**kwargs))
    return set(ids.tolist())


@pytest.mark.parametrize("top_k", [1, 3, 10, VOCAB, VOCAB + 5])
def test_top_k_keeps_the_k_most_likely(top_k):
    logits = random_logits(7)
    assert kept_set(logits, top_k=top_k) == set(order_by_prob(probs64(logits))[:top_k])


@pytest.mark.parametrize("top_p", [0.0, 0.2, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p):
    logits = random_logits(8)
    p = probs64(logits)
    expected, mass = set(), 0.0
    for token_id in order_by_prob(p):
        expected.add(token_id)
        mass += p[token_id]
        if mass >= top_p:
            break
    assert kept_set(logits, top_p=top_p) == expected


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p):
    logits = random_logits(9, scale=1.5)
    p = probs64(logits)
    assert kept_set(logits, min_p=min_p) == {i for i in range(VOCAB) if p[i] >= min_p * p.max()}


def test_temperature_reshapes_before_top_p():
    logits = random_logits(10)
    hot, cold = kept_set(logits, temperature=2.0, top_p=0.8), kept_set(logits, temperature=0.5, top_p=0.8)
    assert len(hot) > len(cold)
    p = probs64(logits, 0.5)
    assert cold == set(order_by_prob(p)[: len(cold)])


def test_top_p_applies_to_the_renormalised_top_k_set():
    # probs 0.4 / 0.3 / 0.2 / 0.1: within the top 2, token 0 alone holds 0.4 / 0.7 = 0.57 >= 0.5.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float64)).astype(np.float32)
    assert kept_set(logits, top_p=0.5) == {0, 1}
    assert kept_set(logits, top_k=2, top_p=0.5) == {0}


def test_filters_combine_as_the_intersection():
    logits = random_logits(11)
    combined = kept_set(logits, top_k=12, top_p=0.9, min_p=0.05)
    assert combined == kept_set(logits, top_k=12, top_p=0.9) & kept_set(logits, min_p=0.05)


# -- the draw -------------------------------------------------------------------------------


def inverse_cdf(p: np.ndarray, kept: list[int], u: float) -> int:
    """Independent float64 draw over the kept ids in (prob desc, id asc) order."""
    weights = np.array([p[i] for i in kept])
    cumulative = np.cumsum(weights) / weights.sum()
    return kept[min(int(np.searchsorted(cumulative, u, side="right")), len(kept) - 1)]


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.6, 0), (1.7, 8)])
def test_draw_is_the_inverse_cdf_at_uniform_seed_index(temperature, top_k):
    logits = random_logits(12)
    p = probs64(logits, temperature)
    kept = order_by_prob(p)[: top_k or VOCAB]
    for index in range(300):
        u = uniform(77, index)
        token = sample(logits, spec(seed=77, token_index=index, temperature=temperature, top_k=top_k))
        assert token.token_id == inverse_cdf(p, kept, u)


def test_draw_frequencies_follow_the_tempered_distribution():
    logits = random_logits(13, vocab=8, scale=1.0)
    p = probs64(logits, 0.8)
    draws = [sample(logits, spec(seed=5, token_index=i, temperature=0.8)).token_id for i in range(8000)]
    freq = np.bincount(draws, minlength=8) / len(draws)
    np.testing.assert_allclose(freq, p, atol=0.02)


def test_seeded_draws_do_not_depend_on_batch_composition():
    rows = np.stack([random_logits(s) for s in range(6)])
    specs = [spec(seed=100 + s, token_index=s * 3, temperature=1.1, top_p=0.95) for s in range(6)]
    alone = [sample(rows[s], specs[s]).token_id for s in range(6)]
    batched = [t.token_id for t in sample_rows(rows, specs)]
    reversed_batch = [t.token_id for t in sample_rows(rows[::-1], specs[::-1])][::-1]
    assert alone == batched == reversed_batch


def test_different_seeds_give_different_streams():
    logits = random_logits(14)
    stream = lambda seed: [sample(logits, spec(seed=seed, token_index=i)).token_id for i in range(50)]  # noqa: E731
    assert stream(1) == stream(1)
    assert stream(1) != stream(2)


def test_sample_rows_checks_its_arguments():
    with pytest.raises(ValueError, match="2 logits rows for 1 sample specs"):
        sample_rows(np.zeros((2, VOCAB), dtype=np.float32), [spec()])


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-40, 1e-6])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_the_next_tokens_spec_keeps_every_field_but_the_token_index():
    # Every field set away from its default, so a field that next_token forgets shows up.
    values = {
        "params": SamplingParams(temperature=0.7, top_k=5), "seed": 11, "token_index": 4,
        "prompt_ids": np.arange(3, dtype=np.int32), "output_ids": np.arange(2, dtype=np.int32),
        "allowed": np.ones(8, bool), "num_top_logprobs": 2, "want_logits": True,
        "score_ids": np.arange(2, dtype=np.int32), "want_hidden": True, "want_all_logits": True,
        "hidden_layers": (0, -1),
    }  # fmt: skip
    assert set(values) == {field.name for field in attrs.fields(SampleSpec)}
    spec = SampleSpec(**values)
    following = spec.next_token()
    assert following.token_index == 5
    for name, value in values.items():
        if name != "token_index":
            assert getattr(following, name) is getattr(spec, name), name
