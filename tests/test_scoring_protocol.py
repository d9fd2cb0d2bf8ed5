"""The pure parts of scoring, without a server: /v1/score and /v1/rerank parsing, the answers'
arithmetic (rerank order and ties, top_n), and the teacher-forcing constraint."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ninfer.protocols.calls import InvalidRequest
from ninfer.protocols.scoring import (
    CandidateScore, QuestionScore, ScoreOutcome, entropy, margin, parse_rerank_request, parse_score_request,
    renormalized, rerank_response, score_call,
)  # fmt: skip
from ninfer.sched.forced import ForcedTokens


def _result(*logprobs: float) -> QuestionScore:
    candidates = tuple(CandidateScore(text=str(i), logprob=lp, tokens=()) for i, lp in enumerate(logprobs))
    return QuestionScore(form="token", candidates=candidates, prompt_tokens=10, cached_tokens=0)


def test_rerank_sorts_by_relevance_with_ties_to_the_lower_index_and_clamps_top_n():
    req = parse_rerank_request({"query": "q", "documents": ["a", {"text": "b"}, "c", "d"]}, max_documents=4)
    # b and d tie (same distribution), a is best, c worst
    outcome = ScoreOutcome((_result(0, -9, -9, -9), _result(-1, 0, -1, -1), _result(-9, -9, -9, 0), _result(-1, 0, -1, -1)), 42)
    body = rerank_response(req, outcome, (1.0, 0.6, 0.25, 0.0), model="m", id="x")
    assert [r["index"] for r in body["results"]] == [0, 1, 3, 2]
    p = renormalized([-1, 0, -1, -1])
    assert body["results"][1]["relevance_score"] == pytest.approx(p[0] + 0.6 * p[1] + 0.25 * p[2])
    assert body["results"][1]["document"] == {"text": "b"} and body["usage"] == {"total_tokens": 42, "prompt_tokens": 42}
    for top_n, count in ((-3, 1), (0, 1), (2, 2), (99, 4)):
        req = parse_rerank_request({"query": "q", "documents": list("abcd"), "top_n": top_n, "return_documents": False}, 4)
        results = rerank_response(req, outcome, (1.0, 0.6, 0.25, 0.0), model="m", id="x")["results"]
        assert len(results) == count and all("document" not in r for r in results)
    with pytest.raises(InvalidRequest, match="1 to 3"):
        parse_rerank_request({"query": "q", "documents": list("abcd")}, max_documents=3)


def test_distribution_entropy_and_margin():
    probs = renormalized([math.log(0.2), math.log(0.2), math.log(0.1)])  # renormalized: 0.4, 0.4, 0.2
    assert probs == pytest.approx([0.4, 0.4, 0.2]) and math.fsum(probs) == pytest.approx(1.0)
    assert entropy(probs) == pytest.approx(-(2 * 0.4 * math.log(0.4) + 0.2 * math.log(0.2)))
    assert margin(probs) == pytest.approx(0.0) and margin([1.0]) == 1.0 and entropy([1.0]) == 0.0
    assert renormalized([-1e4, 0.0]) == pytest.approx([0.0, 1.0])  # no underflow to nan
    token = _result(math.log(0.5), math.log(0.25))
    assert token.outside_mass == pytest.approx(0.25) and token.probabilities == pytest.approx([2 / 3, 1 / 3])


def test_score_call_candidates_come_from_the_question_its_enum_or_the_default():
    body = {"model": "m", "messages": [{"role": "system", "content": "S"}], "candidates": ["Yes", "No"],
            "questions": [{"id": "a", "content": "A?"}, {"id": "b", "content": [{"type": "text", "text": "B?"}], "candidates": ["x"]},
                          {"id": "c", "content": "C?", "response_format": {"type": "json_schema", "json_schema": {
                              "name": "n", "schema": {"type": "string", "enum": ["Paris", 3, True]}}}}],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    call = score_call(parse_score_request(body), "req_1")
    assert [q.candidates for q in call.questions] == [("Yes", "No"), ("x",), ('"Paris"', "3", "true")]
    assert call.questions[1].content == "B?" and call.template_kwargs == {"enable_thinking": False}
    assert call.messages == ({"role": "system", "content": "S"},)
    both = {**body, "questions": [{**body["questions"][2], "candidates": ["x"]}]}
    with pytest.raises(InvalidRequest) as info:
        score_call(parse_score_request(both))
    assert info.value.param == "questions.0.response_format"


def test_forced_tokens_allow_one_token_at_a_time():
    forced = ForcedTokens([5, 2, 5], vocab_size=8)
    for token in (5, 2, 5):
        mask = forced.allowed_mask()
        assert mask.dtype == bool and np.flatnonzero(mask).tolist() == [token] and not forced.is_finished()
        forced.advance(token)
    assert forced.is_finished()
    with pytest.raises(ValueError):
        ForcedTokens([1], vocab_size=8).advance(2)
    with pytest.raises(ValueError):
        ForcedTokens([8], vocab_size=8)


def test_the_reference_sampler_reads_score_ids_and_forced_tokens_from_the_raw_row():
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec
    from ninfer.gpu.sampling import sample

    logits = np.random.default_rng(0).normal(0, 3, 50).astype(np.float32)
    raw = logits.astype(np.float64) - logits.max()
    raw -= math.log(np.exp(raw).sum())
    ids = np.array([7, 3, 49], np.int32)
    mask = np.zeros(50, bool)
    mask[11] = True
    spec = SampleSpec(params=SamplingParams(temperature=0.0, repetition_penalty=2.0), seed=0, token_index=0,
                      prompt_ids=np.array([7, 11]), score_ids=ids, allowed=mask)  # fmt: skip
    got = sample(logits, spec)
    assert got.token_id == 11 and got.logprob == pytest.approx(raw[11], abs=1e-5)  # forced, raw logprob
    assert got.score_logprobs.dtype == np.float32 and got.score_logprobs == pytest.approx(raw[ids], abs=1e-5)
    assert sample(logits, SampleSpec(params=SamplingParams(), seed=0, token_index=0)).score_logprobs is None
    with pytest.raises(ValueError, match="score ids"):
        sample(logits, SampleSpec(params=SamplingParams(), seed=0, token_index=0, score_ids=np.array([50])))
