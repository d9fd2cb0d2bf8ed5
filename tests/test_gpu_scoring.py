"""Scoring on the CUDA backend against the numpy reference (skipped where there is no GPU).

* `SampleSpec.score_ids` on a prefill row and on a decode row: the log-probabilities the CUDA
  runner reports (its logits row copied to the host, log-softmax there) match the reference
  runner's, and are exactly the log-softmax of its own logits row; rows that do not ask keep
  the fast path: the same results, bit for bit, as the same batch without scoring;
* `SampleSpec.want_hidden` (embeddings): the final hidden row matches the reference's;
* through the engine (lanes, lookahead, grammar masks): token-form requests
  (`score_token_ids`) and teacher-forced ones (`ForcedTokens`) give the reference engine's
  numbers.

The server's scoring routes run exactly these requests (tests/test_server_scoring.py checks
them end to end on the reference backend).
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio

from ninfer.gpu.cuda.available import cuda_available

gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")

PROMPT = "<|im_start|>user\nIs Paris the capital of France? Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
CANDIDATES = ("Yes", "No", "Paris", "Maybe")
FORCED = ("Paris, France", "Yes, it is.", "No")
# f32 logits are within ~3e-3 of the reference's largest logit (tests/test_gpu_runner.py): a
# few hundredths in a log-probability; q8 activations are a few percent off.
TOLERANCE = {"f32": 0.05, "q8": 0.6}


def _spec(index=0, score_ids=None, want_logits=False):
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec

    return SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=index, score_ids=score_ids,
                      want_logits=want_logits)  # fmt: skip


def _ids(model, text, special=True):
    return np.asarray(model.tokenizer.encode(text, add_special_tokens=special), np.int32)


@pytest.fixture(scope="module")
def reference(smollm2):
    from ninfer.gpu.reference import ReferenceRunner

    return ReferenceRunner(smollm2, num_pages=64, page_size=16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_score_ids_match_the_reference_and_leave_other_rows_alone(smollm2, reference, activations):
    from ninfer.core.runner import StepRow
    from ninfer.gpu.cuda.runner import CudaRunner
    from ninfer.gpu.sampling import log_softmax

    runner = CudaRunner(smollm2, num_pages=64, page_size=16, max_batch_rows=8, activations=activations)
    try:
        prompt, other = _ids(smollm2, PROMPT), _ids(smollm2, OTHER)
        ids = np.array([_ids(smollm2, c, special=False)[0] for c in CANDIDATES], np.int32)
        tables = [np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)]

        def prefill(score_ids, want_logits=False):
            return [StepRow(seq_id=0, token_ids=prompt, start_pos=0, page_table=tables[0],
                            sample=_spec(0, score_ids, want_logits)),
                    StepRow(seq_id=1, token_ids=other, start_pos=0, page_table=tables[1], sample=_spec(0))]  # fmt: skip

        plain_0, plain_1 = runner.step(prefill(None))
        got, got_other = runner.step(prefill(ids))
        # the rows that do not ask are untouched (same batch, same numbers, nothing extra)
        assert (got_other.token_id, got_other.logprob) == (plain_1.token_id, plain_1.logprob)
        assert got_other.score_logprobs is None and got_other.logits is None and got.logits is None
        assert (got.token_id, got.logprob) == (plain_0.token_id, plain_0.logprob)
        (want, _) = reference.step(prefill(ids))
        assert got.score_logprobs.shape == (len(ids),) and got.score_logprobs.dtype == np.float32
        np.testing.assert_allclose(got.score_logprobs, want.score_logprobs, atol=TOLERANCE[activations])
        # exactly the log-softmax of the runner's own logits row
        (with_row, _) = runner.step(prefill(ids, want_logits=True))
        np.testing.assert_array_equal(with_row.score_logprobs, log_softmax(with_row.logits)[ids])

        # the final hidden row (embeddings): the last token's residual, normed on the host
        hidden = [StepRow(seq_id=0, token_ids=prompt, start_pos=0, page_table=tables[0],
                          sample=attrs.evolve(_spec(0), want_hidden=True))]  # fmt: skip
        (got_hidden,), (want_hidden,) = runner.step(hidden), reference.step(hidden)
        assert got_hidden.hidden.shape == (smollm2.spec.d_model,) and got_hidden.score_logprobs is None
        err = np.abs(got_hidden.hidden - want_hidden.hidden).max() / np.abs(want_hidden.hidden).max()
        assert err < {"f32": 3e-3, "q8": 6e-2}[activations], err

        # a decode row (the answer's second position), fed the reference's first token
        token = np.array([want.token_id], np.int32)
        decode = [StepRow(seq_id=0, token_ids=token, start_pos=len(prompt), page_table=tables[0], sample=_spec(1, ids))]
        (got_decode,), (want_decode,) = runner.step(decode), reference.step(decode)
        np.testing.assert_allclose(got_decode.score_logprobs, want_decode.score_logprobs, atol=TOLERANCE[activations])
    finally:
        runner.close()


def _run_engine(runner, model, requests):
    from ninfer.sched.config import EngineConfig
    from ninfer.sched.engine import open_engine

    async def main():
        config = EngineConfig(max_context=512, max_concurrency=4)
        async with open_engine(config, runner, model.tokenizer, stop_token_ids=model.stop_token_ids) as engine:
            out = [None] * len(requests)

            async def one(i, request):
                async with engine.submit(request) as stream:
                    out[i] = await stream.collect()

            async with trio.open_nursery() as nursery:
                for i, request in enumerate(requests):
                    nursery.start_soon(one, i, request)
            return out

    return trio.run(main)


def _requests(model):
    from ninfer.core.params import SamplingParams
    from ninfer.sched.forced import ForcedTokens
    from ninfer.sched.request import GenerationRequest

    prompt = tuple(int(t) for t in _ids(model, PROMPT))
    common = dict(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0), seed=0, logprobs=True, ignore_eos=True)
    scored = tuple(int(_ids(model, c, special=False)[0]) for c in CANDIDATES)
    requests = [GenerationRequest(max_tokens=1, score_token_ids=scored, **common)]
    for text in FORCED:
        ids = [int(t) for t in _ids(model, text, special=False)]
        requests.append(GenerationRequest(max_tokens=len(ids), constraint=ForcedTokens(ids, model.spec.vocab_size), **common))
    # an ordinary greedy request alongside (the lookahead path)
    requests.append(GenerationRequest(max_tokens=8, **{**common, "prompt_ids": tuple(int(t) for t in _ids(model, OTHER))}))
    return requests


@gpu
@pytest.mark.gpu
def test_token_form_and_teacher_forcing_through_the_engine_match_the_reference(smollm2, reference):
    from ninfer.gpu.cuda.runner import CudaRunner

    runner = CudaRunner(smollm2, num_pages=64, page_size=16, max_batch_rows=8, activations="f32")
    try:
        got = _run_engine(runner, smollm2, _requests(smollm2))
    finally:
        runner.close()
    want = _run_engine(reference, smollm2, _requests(smollm2))
    tol = TOLERANCE["f32"]
    (g,), (w,) = got[0].logprobs, want[0].logprobs
    np.testing.assert_allclose(g.scores, w.scores, atol=tol)
    assert len(g.scores) == len(CANDIDATES)
    for text, g, w in zip(FORCED, got[1 : 1 + len(FORCED)], want[1 : 1 + len(FORCED)], strict=True):
        ids = tuple(int(t) for t in _ids(smollm2, text, special=False))
        assert g.token_ids == w.token_ids == ids, text
        np.testing.assert_allclose([e.logprob for e in g.logprobs], [e.logprob for e in w.logprobs], atol=tol)
        assert g.finished.reason.value == "stop"
    assert got[-1].finished.usage.completion_tokens == 8
