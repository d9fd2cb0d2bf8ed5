"""POST /v1/score and POST /v1/rerank end to end: a real server (SmolLM2 on the reference
backend, tests/server_fixtures.py) and raw HTTP, every number checked against the same
quantity computed independently: the prompt's token ids from /v1/tokenize, the raw logits
from a ReferenceRunner of the same model driven directly (prefill, then teacher-forced decode
steps), log-softmax in float64 here.

Prompts stay short and documents few: every token is a CPU forward pass.
"""

from __future__ import annotations

import json
import math
import secrets
import socket
import time

import numpy as np
import pytest
from server_fixtures import metric_values, running_server, small_settings

from ninfer.protocols.scoring import RERANK_QUESTION, RERANK_SYSTEM

KEY = "sk-scoring"
AUTH = {"authorization": f"Bearer {KEY}"}
LANES = 4
PAGE = 16
TOL = 2e-4  # logprobs: the server batches rows its own way (float32 sums in another order)
YES_NO = ["Yes", "No"]
WEIGHTS = (1.0, 0.6, 0.25, 0.0)


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(max_context=512, kv_capacity=4096, max_concurrency=LANES, api_keys=(KEY,))
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.http(headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def reference(smollm2):
    from ninfer.gpu.reference import ReferenceRunner

    return ReferenceRunner(smollm2, num_pages=40, page_size=PAGE)


def metrics(http) -> dict[str, float]:
    return metric_values(http.get("/metrics").text)


def chat_ids(http, messages) -> list[int]:
    """The prompt the server renders for these messages (chat template + generation prompt)."""
    return http.post("/v1/tokenize", json={"messages": messages}).json()["tokens"]


def text_ids(http, text) -> list[int]:
    return http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def reference_logprobs(runner, prompt, continuation=()) -> list[np.ndarray]:
    """Raw log-probability rows of the positions that predict each token of `continuation`
    (teacher-forced: prefill, then one decode step per token), or the one row after `prompt`."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    table = np.arange(-(-(len(prompt) + len(continuation) + 1) // runner.page_size), dtype=np.int32)
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_logits=True)
    (result,) = runner.step([StepRow(seq_id=0, token_ids=np.asarray(prompt, np.int32), start_pos=0, page_table=table, sample=spec)])
    out = [log_softmax(result.logits)]
    for pos, token in enumerate(continuation[:-1], start=len(prompt)):
        (result,) = runner.step([StepRow(seq_id=0, token_ids=np.array([token], np.int32), start_pos=pos, page_table=table, sample=spec)])
        out.append(log_softmax(result.logits))
    return out


def common_prefix(prompts) -> int:
    n = min(map(len, prompts))
    for p in prompts[1:]:
        n = next((k for k in range(n) if p[k] != prompts[0][k]), n)
    return n


def assert_distribution(result):
    probs = [c["probability"] for c in result["candidates"]]
    assert math.isclose(sum(probs), 1.0, abs_tol=1e-9)
    want = np.exp(np.array([c["logprob"] for c in result["candidates"]]))
    assert np.allclose(probs, want / want.sum(), atol=1e-9)
    assert math.isclose(result["entropy"], -sum(p * math.log(p) for p in probs if p > 0), abs_tol=1e-9)
    ranked = sorted(probs, reverse=True)
    assert math.isclose(result["margin"], ranked[0] - ranked[1], abs_tol=1e-9)
    assert result["best"] == result["candidates"][int(np.argmax(probs))]["text"]


def assert_openai_error(response, status: int, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def nonce_prefix() -> list[dict]:
    """A system prompt no earlier request sent (nothing of it is in the prefix cache)."""
    return [{"role": "system", "content": f"Session {secrets.token_hex(6)}. You are a careful geography tutor who "
                                          "answers each question with exactly one word, and nothing else."}]  # fmt: skip


# ---- /v1/score ---------------------------------------------------------------------------------


def test_token_form_matches_the_reference_runner_and_shares_the_prefix_once(http, model_id, reference):
    prefix = nonce_prefix()
    questions = [{"id": "fr", "content": "Is Paris in France?"}, {"id": "es", "content": "Is Rome in Spain?"},
                 {"id": "jp", "content": "Is Tokyo the capital of Japan?", "candidates": ["Yes", "No", "Maybe"]}]  # fmt: skip
    before = metrics(http)
    response = http.post("/v1/score", json={"model": model_id, "messages": prefix, "questions": questions,
                                            "candidates": YES_NO, "top_logprobs": 3})  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    after = metrics(http)
    assert body["object"] == "score" and body["model"] == model_id
    prompts = [chat_ids(http, [*prefix, {"role": "user", "content": q["content"]}]) for q in questions]
    shared = common_prefix(prompts)
    assert shared >= 2 * PAGE  # the system prompt and more
    for i, (q, result, prompt) in enumerate(zip(questions, body["results"], prompts, strict=True)):
        assert (result["index"], result["id"], result["form"], result["error"]) == (i, q["id"], "token", None)
        assert result["prompt_tokens"] == len(prompt)
        assert result["cached_tokens"] == shared  # read from the one computation of the prefix
        (want,) = reference_logprobs(reference, prompt)
        texts = q.get("candidates", YES_NO)
        assert [c["text"] for c in result["candidates"]] == texts
        for c, text in zip(result["candidates"], texts, strict=True):
            (token_id,) = text_ids(http, text)
            assert [t["token_id"] for t in c["tokens"]] == [token_id]
            assert c["logprob"] == pytest.approx(want[token_id], abs=TOL)
        assert_distribution(result)
        inside = sum(math.exp(c["logprob"]) for c in result["candidates"])
        assert result["outside_mass"] == pytest.approx(1 - inside, abs=1e-9)
        top = [t["token_id"] for t in result["top_logprobs"]]
        assert top == list(np.argsort(-want, kind="stable")[:3])
    # The prefix was computed once (by the one request that publishes it), each question's own tokens once each.
    own = sum(len(p) - shared for p in prompts)
    assert after["ninfer_prefill_tokens_total"] - before["ninfer_prefill_tokens_total"] == shared + own
    assert body["usage"] == {"prompt_tokens": shared + own, "completion_tokens": 0, "total_tokens": shared + own}
    assert after["ninfer_route_requests_total{route=/v1/score}"] - before.get("ninfer_route_requests_total{route=/v1/score}", 0) == 1
    scored = "ninfer_scored_tokens_total{route=/v1/score}"
    assert after[scored] - before.get(scored, 0) == shared + own
    # Again: the questions only read the cache, so their branches were never published.
    again = http.post("/v1/score", json={"model": model_id, "messages": prefix, "questions": questions,
                                         "candidates": YES_NO}).json()  # fmt: skip
    assert [r["cached_tokens"] for r in again["results"]] == [shared] * len(questions)
    final = metrics(http)
    assert final["ninfer_prefill_tokens_total"] - after["ninfer_prefill_tokens_total"] == 1 + own  # 1: the prefix's last token
    assert final["ninfer_kv_pages_active"] == 0 and final["ninfer_requests_running"] == 0


def test_text_form_is_teacher_forced_log_likelihood(http, model_id, reference):
    prefix = nonce_prefix()
    capital = {"id": "it", "content": "What is the capital of Italy?", "candidates": ["Rome", "Milan", "Rome, Italy"]}
    enum = {"id": "fr", "content": "What is the capital of France?",
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {"enum": ["Paris", "Lyon"]}}}}  # fmt: skip
    response = http.post("/v1/score", json={"model": model_id, "messages": prefix, "questions": [capital, enum],
                                            "top_logprobs": 2})  # fmt: skip
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    for q, result, texts in zip((capital, enum), results, (capital["candidates"], ['"Paris"', '"Lyon"']), strict=True):
        assert result["form"] == "text" and result["outside_mass"] is None
        assert [c["text"] for c in result["candidates"]] == texts
        prompt = chat_ids(http, [*prefix, {"role": "user", "content": q["content"]}])
        for c, text in zip(result["candidates"], texts, strict=True):
            ids = text_ids(http, text)
            want = reference_logprobs(reference, prompt, ids)
            assert [t["token_id"] for t in c["tokens"]] == ids
            per_token = [row[t] for row, t in zip(want, ids, strict=True)]
            assert [t["logprob"] for t in c["tokens"]] == pytest.approx(per_token, abs=TOL)
            assert c["logprob"] == pytest.approx(sum(per_token), abs=len(ids) * TOL)
            assert [t["token_id"] for t in c["tokens"][0]["top_logprobs"]] == list(np.argsort(-want[0], kind="stable")[:2])
        assert_distribution(result)
    # A one-token candidate has the same score in either form.
    rome = results[0]["candidates"][0]["logprob"]
    token_form = http.post("/v1/score", json={"model": model_id, "messages": prefix, "questions": [
        {"id": "it", "content": capital["content"], "candidates": ["Rome", "Paris"]}]}).json()["results"][0]  # fmt: skip
    assert token_form["form"] == "token" and token_form["candidates"][0]["logprob"] == pytest.approx(rome, abs=TOL)


def test_a_question_that_cannot_run_fails_in_its_own_slot(http, model_id):
    questions = [{"id": "long", "content": "word " * 600}, {"id": "ok", "content": "Is water wet?"}]
    response = http.post("/v1/score", json={"model": model_id, "messages": [], "questions": questions, "candidates": YES_NO})
    assert response.status_code == 200, response.text
    failed, fine = response.json()["results"]
    assert failed["id"] == "long" and failed["error"]["code"] == "context_length_exceeded"
    assert failed["error"]["type"] == "invalid_request_error" and "512" in failed["error"]["message"]
    assert fine["error"] is None and fine["form"] == "token"
    assert_distribution(fine)


def test_score_bad_input_is_a_400_naming_the_field(http, server, model_id):
    one = [{"id": "a", "content": "Hi?"}]

    def post(**body):
        return http.post("/v1/score", json={"model": model_id, "messages": [], **body})

    assert_openai_error(post(questions=[{"id": "a", "content": "Hi?"}, {"id": "b", "content": "Ok?"}],
                             candidates=None), 400, "questions.0.candidates", "no candidates")  # fmt: skip
    assert_openai_error(post(questions=[{"id": "a", "content": "Hi?", "candidates": ["x"]}, {"id": "b", "content": "Ok?"}]),
                        400, "questions.1.candidates", "no candidates")  # fmt: skip
    assert_openai_error(post(questions=[{"id": "a", "content": "Hi?", "colour": "red"}], candidates=YES_NO), 400,
                        "questions.0", "unknown field", "colour")  # fmt: skip
    assert_openai_error(post(questions=one, candidates=YES_NO, temperature=1), 400, None, "unknown field", "temperature")
    assert_openai_error(post(questions=[], candidates=YES_NO), 400, "questions", "1 to 256")
    many = [{"id": str(i), "content": "?"} for i in range(257)]
    assert_openai_error(post(questions=many, candidates=YES_NO), 400, "questions", "1 to 256")
    assert_openai_error(post(questions=[*one, *one], candidates=YES_NO), 400, "questions.1.id", "unique")
    assert_openai_error(post(questions=one, candidates=["Yes", "Yes"]), 400, "candidates.1", "distinct")
    assert_openai_error(post(questions=one, candidates=["Yes", ""]), 400, "candidates.1", "empty")
    assert_openai_error(post(questions=one, candidates=[]), 400, "candidates", "1 to 256")
    assert_openai_error(post(questions=[{**one[0], "response_format": {"type": "json_object"}}], candidates=YES_NO),
                        400, "questions.0.response_format", "enum")  # fmt: skip
    assert_openai_error(post(questions=one, candidates=YES_NO, chat_template_kwargs={"messages": []}), 400,
                        "chat_template_kwargs", "messages")  # fmt: skip
    assert_openai_error(post(questions=one, candidates=YES_NO, top_logprobs=21), 400, "top_logprobs")
    assert_openai_error(post(questions="Hi?", candidates=YES_NO), 400, "questions", "array")
    error = assert_openai_error(http.post("/v1/score", json={"model": "gpt-nope", "messages": [], "questions": one,
                                                             "candidates": YES_NO}), 404, "model")  # fmt: skip
    assert error["code"] == "model_not_found"
    with server.http() as anonymous:  # no key
        error = assert_openai_error(anonymous.post("/v1/score", json={"model": model_id}), 401, None)
        assert error["code"] == "invalid_api_key"
        assert anonymous.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 401
    assert http.get("/v1/score").status_code == 405


# ---- /v1/rerank --------------------------------------------------------------------------------


def test_rerank_is_the_weighted_four_option_choice(http, model_id, reference):
    query = f"Where is the Eiffel Tower? ({secrets.token_hex(4)})"
    documents = ["The Eiffel Tower stands in Paris, France.", "Bananas are rich in potassium.",
                 "Paris travel guide: museums, cafes and the Seine."]  # fmt: skip
    body = {"model": model_id, "query": query, "documents": [documents[0], {"text": documents[1]}, documents[2]]}
    response = http.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    labels = [text_ids(http, label)[0] for label in "ABCD"]
    prompts, want = [], []
    for text in documents:
        messages = [{"role": "system", "content": RERANK_SYSTEM},
                    {"role": "user", "content": RERANK_QUESTION.format(query=query, document=text)}]  # fmt: skip
        prompts.append(chat_ids(http, messages))
        (row,) = reference_logprobs(reference, prompts[-1])
        p = np.exp(row[labels])
        want.append(float(np.dot(WEIGHTS, p / p.sum())))
    order = sorted(range(3), key=lambda i: (-want[i], i))
    assert [r["index"] for r in answer["results"]] == order
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert r["document"] == {"text": documents[r["index"]]}
    scores = [r["relevance_score"] for r in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    shared = common_prefix(prompts)
    total = shared + sum(len(p) - shared for p in prompts)
    assert answer["usage"] == {"total_tokens": total, "prompt_tokens": total}
    # top_n is clamped to 1..N; return_documents false leaves the texts out
    one = http.post("/v1/rerank", json={**body, "top_n": 0, "return_documents": False}).json()["results"]
    assert one == [{"index": order[0], "relevance_score": pytest.approx(scores[0], abs=1e-4)}]
    assert len(http.post("/v1/rerank", json={**body, "top_n": 99}).json()["results"]) == 3


def test_rerank_bad_input_is_a_400(http, model_id):
    def post(**body):
        return http.post("/v1/rerank", json={"query": "q", **body})

    assert_openai_error(post(documents=[]), 400, "documents", "1 to 256")
    assert_openai_error(post(documents=["d"] * 257), 400, "documents", "1 to 256", "257")
    assert_openai_error(post(documents=["d", 3]), 400, "documents.1", "string")
    assert_openai_error(post(documents=[{"text": "d", "title": "t"}]), 400, "documents.0", "unknown field", "title")
    assert_openai_error(post(documents=["d"], top_k=1), 400, None, "unknown field", "top_k")
    assert_openai_error(http.post("/v1/rerank", json={"documents": ["d"]}), 400, "query", "required")
    assert_openai_error(post(documents=["word " * 600]), 400, "documents.0", "context")
    assert post(documents=["d"], model="nope").status_code == 404


def test_a_disconnect_mid_rerank_cancels_it_and_frees_every_page(server, http, model_id):
    documents = [f"Document {i}: " + "the history of bridges, rivers and old stone towns " * 6 for i in range(40)]
    payload = json.dumps({"model": model_id, "query": f"bridges {secrets.token_hex(4)}", "documents": documents}).encode()
    before = metrics(http)
    done = "ninfer_requests_total{outcome=length}"
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/rerank HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"authorization: Bearer {KEY}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)  # fmt: skip
        deadline = time.monotonic() + 60

        def in_flight(m):  # the prefix and some documents done, more running (not between two waves)
            return m[done] >= before[done] + 3 and m["ninfer_requests_running"] >= 1 and m["ninfer_kv_pages_active"] >= 1

        while not in_flight(busy := metrics(http)):
            assert time.monotonic() < deadline, busy
            time.sleep(0.02)
    cancelled = "ninfer_requests_total{outcome=cancelled}"
    deadline = time.monotonic() + 60
    while (after := metrics(http))["ninfer_requests_running"] + after["ninfer_requests_waiting"] + after["ninfer_kv_pages_active"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after[cancelled] > before[cancelled]
    assert after[done] - before[done] < 1 + len(documents)  # not every document ran
    assert after.get("ninfer_route_requests_total{route=/v1/rerank}", 0) == before.get("ninfer_route_requests_total{route=/v1/rerank}", 0)
    assert http.get("/health").status_code == 200


# ---- /v1/embeddings ----------------------------------------------------------------------------


def test_embeddings_are_the_normalized_final_hidden_row_of_the_last_token(http, model_id, reference, smollm2):
    import base64

    texts = ["The cat sat on the mat.", "Ein Hund schläft im Garten."]
    ids = text_ids(http, "Tokens given as ids work too.")
    body = {"model": model_id, "input": texts}
    answer = http.post("/v1/embeddings", json=body).json()
    assert answer["object"] == "list" and answer["model"] == model_id
    prompts = [http.post("/v1/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert answer["usage"] == {"prompt_tokens": sum(map(len, prompts)), "total_tokens": sum(map(len, prompts))}
    from_ids = http.post("/v1/embeddings", json={"model": model_id, "input": [ids]}).json()["data"]
    assert [item["index"] for item in answer["data"]] == [0, 1] and [item["index"] for item in from_ids] == [0]
    head = smollm2.weights["embed" if smollm2.spec.tie_embeddings else "lm_head"].dequantize().astype(np.float64)
    vectors = []
    for item, prompt in zip([*answer["data"], *from_ids], [*prompts, ids], strict=True):
        assert item["object"] == "embedding"
        e = np.asarray(item["embedding"], np.float64)
        assert e.shape == (smollm2.spec.d_model,) and np.linalg.norm(e) == pytest.approx(1.0, abs=1e-5)
        # the head's input direction: the logits at the last prompt position are |h| * (head @ e)
        (logprobs,) = reference_logprobs(reference, prompt)
        projected = head @ e
        # log-softmax drops a constant: compare centred rows, |h| fitted by least squares
        centred, proj = logprobs - logprobs.mean(), projected - projected.mean()
        scale = float(centred @ proj / (proj @ proj))
        assert scale > 0 and np.abs(centred - scale * proj).max() < 1e-3 * np.abs(centred).max()
        vectors.append(e)
    assert float(vectors[0] @ vectors[1]) < 0.9999  # different texts, different vectors
    encoded = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"]
    for item, e in zip(encoded, vectors[:2], strict=True):
        assert np.allclose(np.frombuffer(base64.b64decode(item["embedding"]), "<f4"), e, atol=1e-5)
    one = http.post("/v1/embeddings", json={"model": model_id, "input": texts[0]}).json()["data"]
    assert len(one) == 1 and np.allclose(one[0]["embedding"], vectors[0], atol=1e-5)


def test_embeddings_bad_input_is_a_400(http, model_id):
    def post(**body):
        return http.post("/v1/embeddings", json={"model": model_id, **body})

    error = assert_openai_error(post(input="hi", dimensions=64), 400, "dimensions", "not supported", "576")
    assert error["code"] == "unsupported_value"
    assert_openai_error(post(input=""), 400, "input", "empty")
    assert_openai_error(post(input=["a", ""]), 400, "input.1", "empty")
    assert_openai_error(post(input=[]), 400, "input", "1 to 2048")
    assert_openai_error(post(input="hi", encoding_format="int8"), 400, "encoding_format")
    assert_openai_error(post(input="hi", pooling="mean"), 400, None, "unknown field", "pooling")
    assert_openai_error(post(input=[1, 10**9]), 400, "input", "Token ids")
    error = assert_openai_error(post(input="word " * 600), 400, "input", "context length")
    assert error["code"] == "context_length_exceeded"
    assert post(input="hi", user="u").status_code == 200
