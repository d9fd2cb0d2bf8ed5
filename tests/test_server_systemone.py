"""POST /v1/systemone (and /systemone) end to end: a real server (SmolLM2 on the reference
backend, tests/server_fixtures.py, with an API key) and raw HTTP. Every probability is checked
against the same quantity computed independently: the prompt's token ids from /v1/tokenize
(the chat template rendered whole, where the route tokenizes the state once and each question
on its own), the raw logits from a ReferenceRunner of the same model driven directly
(prefill, then one decode step per fed letter), log-softmax and renormalization in float64
here.

Prompts stay short and questions few: every token is a CPU forward pass.
"""

from __future__ import annotations

import json
import math
import secrets
import socket

import numpy as np
import pytest
from server_fixtures import metric_values, running_server, small_settings

from ninfer.protocols.systemone import Question, choice_labels, system_prompt, user_turn

KEY = "sk-systemone"
AUTH = {"authorization": f"Bearer {KEY}"}
PAGE = 16
TOL = 2e-4  # the server batches rows its own way (float32 sums in another order)
ROUTE = "/v1/systemone"


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(max_context=1024, kv_capacity=8192, max_concurrency=4, api_keys=(KEY,))
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.http(headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def reference(smollm2):
    from ninfer.gpu.reference import ReferenceRunner

    return ReferenceRunner(smollm2, num_pages=48, page_size=PAGE)


def metrics(http) -> dict[str, float]:
    return metric_values(http.get("/metrics").text)


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def prompt_ids(http, state: str, question: Question, framing: int = 0) -> list[int]:
    """The prompt as the chat template renders it whole (system: instruction + state; the question's turn)."""
    messages = [{"role": "system", "content": system_prompt(state)},
                {"role": "user", "content": user_turn(question, framing)}]  # fmt: skip
    return http.post("/v1/tokenize", json={"messages": messages}).json()["tokens"]


def token_id(http, text: str) -> int:
    (tid,) = http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return tid


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def reference_rows(runner, prompt, fed=()) -> tuple[np.ndarray, list[np.ndarray]]:
    """The raw log-probability row after `prompt`, and for each token of `fed` the row after
    feeding that one token right after the prompt (each in turn at the same position)."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    table = np.arange(-(-(len(prompt) + 2) // runner.page_size), dtype=np.int32)
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_logits=True)
    (first,) = runner.step([StepRow(seq_id=0, token_ids=np.asarray(prompt, np.int32), start_pos=0, page_table=table, sample=spec)])
    rows = []
    for token in fed:
        (after,) = runner.step([StepRow(seq_id=0, token_ids=np.array([token], np.int32), start_pos=len(prompt), page_table=table, sample=spec)])
        rows.append(log_softmax(after.logits))
    return log_softmax(first.logits), rows


def softmax(logprobs, temperature: float = 1.0) -> np.ndarray:
    x = np.asarray(logprobs, np.float64) / temperature
    w = np.exp(x - x.max())
    return w / w.sum()


def common_prefix(prompts) -> int:
    n = min(map(len, prompts))
    for p in prompts[1:]:
        n = next((k for k in range(n) if p[k] != prompts[0][k]), n)
    return n


def cached_now(http, state: str) -> int:
    """Prompt tokens of this state's system prompt the prefix cache holds already (the
    instruction before the state, from earlier calls): a one-question /v1/score call over
    the same system message reads, without publishing anything."""
    body = {"model": http.get("/v1/models").json()["data"][0]["id"], "candidates": ["Yes"],
            "messages": [{"role": "system", "content": system_prompt(state)}],
            "questions": [{"id": "probe", "content": "Probe."}]}  # fmt: skip
    return http.post("/v1/score", json=body).json()["results"][0]["cached_tokens"]


def post(http, body, path=ROUTE):
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_distribution(answer, keys):
    probs = answer["probabilities"]
    assert list(probs) == list(keys)
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    values = list(probs.values())
    assert answer["answer"] == keys[int(np.argmax(values))]
    return np.array(values)


def choice_confidence(p) -> float:
    n = len(p)
    return 1.0 if n == 1 else (n * max(p) - 1) / (n - 1)


def nonce_state() -> dict:
    return {"ticket": secrets.token_hex(6), "customer": "Ada", "message": "My invoice from March was charged twice, "
            "and the second charge is still pending. Please refund it.", "plan": "pro", "open_tickets": 1}  # fmt: skip


# ---- happy paths -------------------------------------------------------------------------------


def test_noul_choice_and_score_match_the_reference_and_share_the_state_once(http, reference):
    state = nonce_state()
    state_text = json.dumps(state, ensure_ascii=False)
    questions = {
        "refund": {"type": "noul", "question": "Does the customer ask for a refund?"},
        "topic": {"type": "choice", "question": "What is the message about?", "options": ["billing", "shipping", "login"]},
        "urgency": {"type": "score", "question": "How urgent is the message?", "levels": 5},
    }
    cached = cached_now(http, state_text)
    before = metrics(http)
    answer = post(http, {"model": "typesafe/system-one", "state": state, "questions": questions})
    after = metrics(http)
    assert answer["object"] == "systemone" and answer["model"] == "typesafe/system-one"
    assert answer["temperature"] is None and answer["readout"] == "single"
    assert list(answer["answers"]) == list(questions)
    parsed = {"refund": Question(key="refund", kind="noul", text=questions["refund"]["question"]),
              "topic": Question(key="topic", kind="choice", text=questions["topic"]["question"], options=("billing", "shipping", "login")),
              "urgency": Question(key="urgency", kind="score", text=questions["urgency"]["question"], levels=5)}  # fmt: skip
    prompts = {key: prompt_ids(http, state_text, q) for key, q in parsed.items()}
    labels = {"refund": ["Yes", "No"], "topic": ["A", "B", "C"], "urgency": ["0", "1", "2", "3", "4"]}
    for key, q in parsed.items():
        got = answer["answers"][key]
        assert got["type"] == q.kind
        p = assert_distribution(got, ["Yes", "No"] if key == "refund" else list(q.options) if key == "topic" else labels[key])
        row, _ = reference_rows(reference, prompts[key])
        want = softmax(row[[token_id(http, label) for label in labels[key]]])
        assert p == pytest.approx(want, abs=TOL)
        if q.kind == "score":
            mu = float(np.dot(np.arange(5), p))
            assert got["score"] == pytest.approx(mu, abs=1e-9) and got["levels"] == 5 and got["legend"] == "0 = lowest, 4 = highest"
            spread = float(np.dot(p, np.abs(np.arange(5) - mu)))
            assert got["confidence"] == pytest.approx(1 - spread / 2.0, abs=1e-9)
        else:
            assert got["confidence"] == pytest.approx(choice_confidence(p), abs=1e-9)
    assert answer["answers"]["refund"]["p_yes"] == answer["answers"]["refund"]["probabilities"]["Yes"]
    assert answer["answers"]["topic"]["labels"] == {"A": "billing", "B": "shipping", "C": "login"}
    # The state prefix was computed once (one publishing request), each question's own turn once.
    shared = common_prefix(list(prompts.values()))
    assert shared > len(http.post("/v1/tokenize", json={"prompt": state_text}).json()["tokens"])  # the state and more
    own = sum(len(p) - shared for p in prompts.values())
    assert answer["usage"] == {"input_tokens": shared + own, "output_tokens": 0, "total_tokens": shared + own}
    assert delta(after, before, "ninfer_prefill_tokens_total") == shared - cached + own
    assert delta(after, before, "ninfer_requests_total{outcome=length}") == 1 + len(questions)
    assert delta(after, before, "ninfer_route_requests_total{route=/v1/systemone}") == 1
    assert delta(after, before, "ninfer_scored_tokens_total{route=/v1/systemone}") == shared + own
    assert after["ninfer_kv_pages_active"] == 0 and after["ninfer_requests_running"] == 0


def test_a_choice_of_63_options_reads_letter_then_digit(http, reference):
    """From 63 options on, labels are a letter and a digit: P(label) = P(letter) x P(digit | letter),
    the digit read after feeding the letter; the letter read publishes the question's prompt, and
    each digit read computes only its letter."""
    state = f"Order {secrets.token_hex(5)}: a red bicycle helmet, size M."
    options = [f"item {i}" for i in range(63)]
    question = Question(key="pick", kind="choice", text="Which catalogue item was ordered?", options=tuple(options))
    other = Question(key="paid", kind="noul", text="Was it paid?")
    cached = cached_now(http, state)
    before = metrics(http)
    answer = post(http, {"model": "judge", "state": state, "questions": {
        "pick": {"type": "choice", "question": question.text, "options": options},
        "paid": {"type": "noul", "question": other.text}}}, path="/systemone")  # fmt: skip
    after = metrics(http)
    got = answer["answers"]["pick"]
    p = assert_distribution(got, options)
    labels = choice_labels(63)
    assert labels[:3] == ("A0", "A1", "A2") and labels[-1] == "G2"
    assert got["labels"] == dict(zip(labels, options, strict=True))
    prompt = prompt_ids(http, state, question)
    letters = sorted({label[0] for label in labels})
    letter_ids = [token_id(http, letter) for letter in letters]
    first, after_letter = reference_rows(reference, prompt, letter_ids)
    p_letter = softmax(first[letter_ids])
    want = []
    for label in labels:
        k = letters.index(label[0])
        digits = [d for d in "0123456789" if label[0] + d in labels]
        p_digit = softmax(after_letter[k][[token_id(http, d) for d in digits]])
        want.append(p_letter[k] * p_digit[digits.index(label[1])])
    assert p == pytest.approx(np.array(want), abs=TOL)
    assert got["confidence"] == pytest.approx(choice_confidence(p), abs=1e-9)
    # The state once; the choice's turn once, then one token per letter (its digits are read
    # after it); the other question's turn once.
    paid = prompt_ids(http, state, other)
    shared = common_prefix([prompt, paid])
    tokens = shared + (len(prompt) - shared) + len(letters) + (len(paid) - shared)
    assert answer["usage"]["input_tokens"] == tokens
    assert delta(after, before, "ninfer_prefill_tokens_total") == tokens - cached
    assert delta(after, before, "ninfer_requests_total{outcome=length}") == 1 + 1 + len(letters) + 1
    assert delta(after, before, "ninfer_route_requests_total{route=/systemone}") == 1
    assert after["ninfer_kv_pages_active"] == 0


def test_temperature_suffix_and_averaged_readout(http, reference):
    """`-t<T>`: softmax(logprob / T) over the labels (T 0 or none: plain renormalization);
    `averaged`: the mean of the three framings' distributions."""
    state = f"Note {secrets.token_hex(5)}: the server room is at 41 degrees and rising."
    text = "Is the situation dangerous?"
    body = {"state": state, "questions": {"q": {"type": "noul", "question": text}}}
    question = Question(key="q", kind="noul", text=text)
    ids = [token_id(http, "Yes"), token_id(http, "No")]
    rows = [reference_rows(reference, prompt_ids(http, state, question, f))[0][ids] for f in range(3)]
    plain = [post(http, {**body, "model": m})["answers"]["q"] for m in ("judge", "judge-t0", "judge-t1")]
    for got in plain:
        assert assert_distribution(got, ["Yes", "No"]) == pytest.approx(softmax(rows[0]), abs=TOL)
    hot = post(http, {**body, "model": "judge-t2.5"})
    assert hot["temperature"] == 2.5
    p_hot = assert_distribution(hot["answers"]["q"], ["Yes", "No"])
    assert p_hot == pytest.approx(softmax(rows[0], 2.5), abs=TOL)
    assert abs(p_hot[0] - 0.5) < abs(plain[0]["p_yes"] - 0.5)  # flatter
    cold = post(http, {**body, "model": "judge-t0.25"})["answers"]["q"]
    assert assert_distribution(cold, ["Yes", "No"]) == pytest.approx(softmax(rows[0], 0.25), abs=TOL)
    averaged = post(http, {**body, "model": "judge", "policy": {"readout": "averaged"}})
    assert averaged["readout"] == "averaged"
    p = assert_distribution(averaged["answers"]["q"], ["Yes", "No"])
    assert p == pytest.approx(np.mean([softmax(r) for r in rows], axis=0), abs=TOL)
    assert averaged["answers"]["q"]["confidence"] == pytest.approx(abs(2 * p[0] - 1), abs=1e-9)
    # An averaged score: each framing's own distribution over the digits, then the mean.
    score = Question(key="s", kind="score", text="How hot is the room?", levels=3)
    digits = [token_id(http, d) for d in "012"]
    want = np.mean([softmax(reference_rows(reference, prompt_ids(http, state, score, f))[0][digits], 2.0) for f in range(3)], axis=0)
    got = post(http, {"model": "judge-t2", "state": state, "policy": {"readout": "averaged"},
                      "questions": {"s": {"type": "score", "question": score.text, "levels": 3}}})["answers"]["s"]  # fmt: skip
    assert assert_distribution(got, ["0", "1", "2"]) == pytest.approx(want, abs=TOL)


# ---- errors ------------------------------------------------------------------------------------


def assert_detail(response, status: int, *words: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"detail"} and isinstance(body["detail"], str)
    for word in words:
        assert word in body["detail"], body
    return body["detail"]


def test_schema_violations_are_one_422_listing_them_all(http):
    body = {"model": "", "state": 7, "extra": True, "policy": {"readout": "twice"}, "questions": {
        "a": {"type": "maybe", "question": "?"},
        "b": {"type": "choice", "question": "Which?", "options": ["x", "x", 3]},
        "c": {"type": "score", "question": "How much?", "levels": 11},
        "d": {"type": "noul", "question": "Ok?", "options": ["Yes"]},
        "e": {"type": "score", "question": "Fine?"},
    }}  # fmt: skip
    response = http.post(ROUTE, json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert all(set(e) == {"loc", "msg", "type"} and e["loc"][0] == "body" and e["msg"] for e in detail)
    found = {(tuple(e["loc"]), e["type"]) for e in detail}
    assert found == {
        (("body", "extra"), "extra_forbidden"),
        (("body", "model"), "string_too_short"),
        (("body", "state"), "union_type"),
        (("body", "policy", "readout"), "literal_error"),
        (("body", "questions", "a"), "union_tag_invalid"),
        (("body", "questions", "b", "choice", "options", 1), "value_error"),
        (("body", "questions", "b", "choice", "options", 2), "string_type"),
        (("body", "questions", "c", "score", "levels"), "less_than_equal"),
        (("body", "questions", "d", "noul", "options"), "extra_forbidden"),
        (("body", "questions", "e", "score", "levels"), "missing"),
    }
    unknown = http.post(ROUTE, json={"model": "m", "state": "s", "questions": {"q": {"type": "ranking", "question": "?"}}})
    assert unknown.status_code == 422
    (error,) = unknown.json()["detail"]
    assert error["loc"] == ["body", "questions", "q"] and error["type"] == "union_tag_invalid" and "ranking" in error["msg"]
    missing = http.post(ROUTE, json={})
    assert {tuple(e["loc"]): e["type"] for e in missing.json()["detail"]} == {
        ("body", "model"): "missing", ("body", "state"): "missing", ("body", "questions"): "missing"}
    empty = http.post(ROUTE, json={"model": "m", "state": [], "questions": {}}).json()["detail"]
    assert [(e["loc"], e["type"]) for e in empty] == [(["body", "questions"], "too_short")]
    bad_json = http.post(ROUTE, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 422 and bad_json.json()["detail"][0]["type"] == "json_invalid"
    assert http.post(ROUTE, json=["a"]).json()["detail"][0]["type"] == "model_attributes_type"


def test_label_overflow_and_framework_errors_take_the_detail_shape(server, http):
    many = {"model": "m", "state": "s", "questions": {"q": {"type": "choice", "question": "Which?",
                                                           "options": [f"o{i}" for i in range(256)]}}}  # fmt: skip
    assert_detail(http.post(ROUTE, json=many), 400, "256", "255")
    assert_detail(http.post(ROUTE, json={"model": "m", "state": "s" * 6000, "questions": {"q": {"type": "noul", "question": "?"}}}),
                  400, "context")  # fmt: skip
    with server.http() as anonymous:
        assert_detail(anonymous.post(ROUTE, json=many), 403, "Not authenticated")
        wrong = anonymous.post("/systemone", json=many, headers={"authorization": "Bearer sk-wrong"})
        assert_detail(wrong, 401)
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert_detail(anonymous.post(ROUTE, json=many, headers={"x-api-key": "nope"}), 401)
        assert anonymous.post("/v1/score", json={}).json()["error"]["code"] == "invalid_api_key"  # others keep their shape
    for path in (ROUTE, "/systemone"):
        wrong_method = http.get(path)
        assert_detail(wrong_method, 405)
        assert wrong_method.headers["allow"] == "POST"
    assert_detail(http.post(ROUTE + "/extra", json={}), 404)
    assert_detail(http.post(ROUTE, content=b"model=m", headers={"content-type": "application/x-www-form-urlencoded"}), 415)
    with socket.create_connection((server.host, server.port)) as sock:  # refused from its Content-Length, unread
        sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                     "content-type: application/json\r\ncontent-length: 99999999\r\n\r\n".encode())  # fmt: skip
        sock.settimeout(30)
        data = b""
        while chunk := sock.recv(65536):  # the server closes the connection after it
            data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b'"detail"' in payload and b"99999999 bytes" in payload
    assert metrics(http)["ninfer_kv_pages_active"] == 0


def test_loading_503_takes_the_detail_shape():
    """While the model loads, these paths answer 503 as `{"detail": ...}`; the others keep theirs."""
    import trio

    from ninfer.server.readiness import ReadinessSwitch

    async def answer(path: str) -> tuple[int, dict]:
        sent = []

        async def send(message):
            sent.append(message)

        await ReadinessSwitch()({"type": "http", "path": path}, None, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    for path in (ROUTE, "/systemone"):
        status, body = trio.run(answer, path)
        assert status == 503 and set(body) == {"detail"} and "loading" in body["detail"]
    assert set(trio.run(answer, "/v1/score")[1]) == {"error"}


def test_thinking_is_turned_off_where_the_template_reads_it():
    from ninfer.models.chat_template import ChatTemplate
    from ninfer.server.scoring import thinking_off_kwargs

    qwen3_like = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
                              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                              "{% endif %}{% endif %}")  # fmt: skip
    assert thinking_off_kwargs(qwen3_like) == {"enable_thinking": False}
    assert qwen3_like.render([{"role": "user", "content": "Hi"}], **thinking_off_kwargs(qwen3_like)).endswith("</think>\n\n")
    assert thinking_off_kwargs(ChatTemplate.chatml()) == {}
