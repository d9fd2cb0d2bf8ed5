"""The operator's side on a real server: model names (`default`, --served-model-name aliases),
llama.cpp's /props, the admin endpoints (auth, shapes, quiesce and its 409s), the web pages'
routes, and --reserve-gib refusing a start that cannot fit."""

from __future__ import annotations

import threading
import time

import anthropic
import openai
import pytest
from server_fixtures import running_server, small_settings

from ninfer.sched.stats import STEP_PHASES

KEY = "sk-admin-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
ALIASES = ("alias-a", "team/alias-b")
CHAT = {"messages": [{"role": "user", "content": "Name a color."}], "temperature": 0}
# A grammar that cannot end before 400 characters: the request runs until the client leaves.
ENDLESS = {**CHAT, "model": "default", "max_tokens": 200, "stream": True, "response_format": {"type": "json_schema",
    "json_schema": {"name": "long", "schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}},
                                               "required": ["s"]}}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(smollm2):
    settings = small_settings(api_keys=(KEY,), model_id=MODEL, served_model_names=ALIASES, max_concurrency=2)
    with running_server(settings, smollm2) as s:
        yield s


@pytest.fixture
def http(server):
    with server.http(headers=AUTH) as client:
        yield client


def openai_404(response) -> str:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found"
    return error["message"]


def wait_for(predicate, timeout_s: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_idle(http) -> None:
    """Until no request of an earlier test is in flight (a hung-up stream ends within a step)."""
    wait_for(lambda: not http.get("/admin/live").json()["in_flight"], what="the engine to be idle")


class Stream(threading.Thread):
    """A streaming chat request read in the background; `close()` hangs up."""

    def __init__(self, server, body: dict):
        super().__init__(daemon=True)
        self._server, self._body = server, body
        self.lines: list[str] = []
        self.finished_at: float | None = None
        self._hang_up = threading.Event()

    def run(self) -> None:
        with self._server.http(headers=AUTH) as client, client.stream("POST", "/v1/chat/completions", json=self._body) as r:
            for line in r.iter_lines():
                self.lines.append(line)
                if self._hang_up.is_set():
                    return
        self.finished_at = time.monotonic()

    def close(self) -> None:
        self._hang_up.set()
        self.join(timeout=30)


# ---- model names ---------------------------------------------------------------------------


def test_v1_models_lists_the_id_then_the_aliases(server, http):
    ids = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert ids == [MODEL, *ALIASES]
    assert [m.id for m in server.openai(KEY).models.list().data] == ids
    assert http.get("/v1/models/team/alias-b").json()["id"] == "team/alias-b"
    assert http.get("/v1/models/default").status_code == 200


@pytest.mark.parametrize("name", ["default", MODEL, *ALIASES])
def test_every_accepted_name_answers_on_openai_and_anthropic(server, name):
    chat = server.openai(KEY).chat.completions.create(model=name, max_tokens=2, **CHAT)
    assert chat.model == name and chat.usage.completion_tokens >= 1
    message = server.anthropic(KEY).messages.create(model=name, max_tokens=2, messages=CHAT["messages"])
    assert message.usage.output_tokens >= 1


def test_default_and_aliases_work_on_the_scoring_routes(http):
    for name in ("default", ALIASES[0]):
        body = http.post("/v1/embeddings", json={"model": name, "input": "Hi"}).json()
        assert len(body["data"][0]["embedding"]) > 0
        ranked = http.post("/v1/rerank", json={"model": name, "query": "Hi", "documents": ["Hello"]})
        assert ranked.status_code == 200, ranked.text


def test_a_wrong_name_is_a_404_in_each_apis_shape_listing_the_accepted_names(server, http):
    accepted = ["default", MODEL, *ALIASES]
    message = openai_404(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}))
    assert "'gpt-4o'" in message and all(f"'{name}'" in message for name in accepted), message
    for path, body in (("/v1/embeddings", {"input": "Hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"messages": [], "questions": [{"id": "q", "content": "?"}], "candidates": ["Yes"]})):
        assert "'alias-a'" in openai_404(http.post(path, json={**body, "model": "nope"}))
    assert "'default'" in openai_404(http.get("/v1/models/nope"))
    with pytest.raises(openai.NotFoundError):
        server.openai(KEY).completions.create(model="nope", prompt="Hi", max_tokens=1)
    response = http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 1, "messages": CHAT["messages"]})
    assert response.status_code == 404
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "'team/alias-b'" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic(KEY).messages.create(model="claude-x", max_tokens=1, messages=CHAT["messages"])


# ---- /props --------------------------------------------------------------------------------


def test_props_has_llama_cpps_fields(server, http, smollm2):
    props = http.get("/props").json()
    assert props["n_ctx"] == 256 and props["total_slots"] == 2
    assert props["model_alias"] == MODEL and props["model_aliases"] == [MODEL, *ALIASES]
    assert props["model_path"] == str(smollm2.path)
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["chat_template"] == smollm2.chat_template.source and "<|im_start|>" in props["chat_template"]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 256 and settings["is_processing"] is False
    assert settings["params"]["temperature"] == server.settings.sampling.temperature
    assert settings["params"]["n_predict"] == -1
    assert props["webui"] is True and props["build_info"].startswith("ninfer ")


# ---- auth and pages ------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [("GET", "/props"), ("GET", "/admin/stats"), ("GET", "/admin/vram"),
                                          ("GET", "/admin/live"), ("POST", "/admin/quiesce"), ("POST", "/admin/resume")])
def test_admin_endpoints_need_the_key(server, method, path):
    with server.http() as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = client.request(method, path, json={"hold_ms": 0}, headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_pages_need_no_key_and_hold_no_data(server):
    with server.http() as client:
        for path in ("/dashboard", "/chat"):
            response = client.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in response.headers["content-security-policy"]
            for asset in ("/webui/common.js", "/webui/style.css"):
                assert asset in response.text
        assert client.get("/webui/dashboard.js").headers["content-type"].startswith("text/javascript")
        root = client.get("/", follow_redirects=False)
        assert root.status_code == 302 and root.headers["location"].endswith("/chat")
        missing = client.get("/webui/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"


def test_no_webui_leaves_the_pages_out(smollm2):
    with running_server(small_settings(webui=False), smollm2) as s, s.http() as client:
        for path in ("/", "/chat", "/dashboard", "/webui/common.js"):
            assert client.get(path).status_code == 404, path
        assert client.get("/props").json()["webui"] is False
        assert client.get("/admin/live").status_code == 200


# ---- /admin/stats, /admin/vram, /admin/live ------------------------------------------------


def test_stats_counters_and_step_phase_timers_move_with_a_request(http):
    before = http.get("/admin/stats").json()
    assert set(before["step_phase_s"]) == set(STEP_PHASES)
    usage = http.post("/v1/chat/completions", json={**CHAT, "model": "default", "max_tokens": 4}).json()["usage"]
    after = http.get("/admin/stats").json()
    engine_before, engine_after = before["engine"], after["engine"]
    assert engine_after["num_generated_tokens"] - engine_before["num_generated_tokens"] == usage["completion_tokens"]
    assert engine_after["num_steps"] > engine_before["num_steps"]
    assert after["requests_by_outcome"]["stop"] + after["requests_by_outcome"]["length"] > (
        before["requests_by_outcome"]["stop"] + before["requests_by_outcome"]["length"])
    assert after["step_phase_s"]["forward"] > before["step_phase_s"]["forward"]
    assert after["step_phase_s"]["schedule"] > before["step_phase_s"]["schedule"]
    assert after["backend"] == "reference" and after["uptime_s"] > 0 and after["quiesced"] is False


def test_vram_reports_the_plan_against_host_memory_on_cpu(http, smollm2):
    first = http.get("/admin/vram").json()
    assert first["device"] == "cpu" and 0 <= first["age_s"] < 5
    assert first["used_bytes"] == first["total_bytes"] - first["free_bytes"] and first["total_bytes"] > 0
    plan = first["plan"]
    page_nbytes = 16 * smollm2.spec.kv_bytes_per_token(4)
    assert first["kv"] == {"num_pages": 2048 // 16, "page_size": 16, "page_nbytes": page_nbytes}
    assert plan["kv_pool_bytes"] == 128 * page_nbytes
    assert plan["weights_bytes"] > smollm2.weights.nbytes  # dequantized to float32 on the reference backend
    assert plan["activations_bytes"] is None and plan["graphs_bytes"] == 0 and plan["reserve_bytes"] == 0
    assert plan["planned_bytes"] == plan["weights_bytes"] + plan["kv_pool_bytes"]
    assert first["process_rss_bytes"] > plan["weights_bytes"]
    # refreshed in the background about once a second; each answer says how old it is
    later = wait_for(lambda: (b := http.get("/admin/vram").json())["measured_unix_s"] > first["measured_unix_s"] and b,
                     timeout_s=5, what="a fresh measurement")
    assert later["age_s"] < 2


def test_vram_and_live_answer_at_once_while_the_engine_is_busy(server, http):
    wait_idle(http)
    streams = [Stream(server, ENDLESS) for _ in range(2)]
    for s in streams:
        s.start()
    try:
        wait_for(lambda: http.get("/admin/live").json()["requests"]["running"] == 2, what="two running requests")
        for path in ("/admin/vram", "/admin/live", "/admin/stats", "/props"):
            started = time.monotonic()
            assert http.get(path).status_code == 200
            assert time.monotonic() - started < 1.0, path
    finally:
        for s in streams:
            s.close()


def test_live_follows_a_request_in_flight_without_its_text(server, http):
    wait_idle(http)
    stream = Stream(server, ENDLESS)
    stream.start()
    try:
        row = wait_for(lambda: next((r for r in http.get("/admin/live").json()["in_flight"] if r["tokens_out"] >= 3), None),
                       what="a decoding request in /admin/live")  # fmt: skip
        assert set(row) == {"id", "route", "age_s", "tokens_in", "tokens_out", "phase"}
        assert row["route"] == "/v1/chat/completions" and row["phase"] == "decode" and row["tokens_in"] > 5
        live = http.get("/admin/live").json()
        assert live["requests"]["running"] == 1 and live["lanes"] == 2
        assert live["kv_pages"]["active"] >= 1 and live["memory"]["device"] == "cpu"
        assert "Name a color" not in str(live)
        wait_for(lambda: http.get("/admin/live").json()["latency_ms"]["inter_token"], what="an inter-token latency")
        wait_for(lambda: http.get("/admin/live").json()["tokens_per_s"]["generated"] > 0, what="a generation rate")
    finally:
        stream.close()
    wait_for(lambda: http.get("/admin/live").json()["in_flight"] == [], what="the table to empty")
    history = http.get("/admin/live").json()["history"]
    assert len(history) >= 2 and any(sample["gen_tps"] > 0 for sample in history)


def test_live_shows_a_scoring_calls_rows_while_they_run(server, http):
    wait_idle(http)
    documents = [f"Note {i}: " + "a long list of unrelated words " * 12 for i in range(8)]
    done: dict = {}
    caller = threading.Thread(target=lambda: done.update(r=server.http(headers=AUTH).post(
        "/v1/rerank", json={"query": "Which note mentions words?", "documents": documents})), daemon=True)  # fmt: skip
    caller.start()
    row = wait_for(lambda: next((r for r in http.get("/admin/live").json()["in_flight"] if r["route"] == "/v1/rerank"), None),
                   what="a rerank row in /admin/live")  # fmt: skip
    assert row["phase"] == "prefill" and row["tokens_in"] > 20 and row["tokens_out"] == 0
    assert "unrelated words" not in str(http.get("/admin/live").json())
    caller.join(timeout=120)
    assert done["r"].status_code == 200
    wait_for(lambda: http.get("/admin/live").json()["in_flight"] == [], what="the table to empty")


# ---- /admin/quiesce ------------------------------------------------------------------------


def test_quiesce_drains_holds_new_requests_and_refuses_a_second_one(server, http):
    wait_idle(http)
    running = Stream(server, {**CHAT, "model": "default", "max_tokens": 24, "stream": True, "ignore_eos": True})
    running.start()
    wait_for(lambda: http.get("/admin/live").json()["requests"]["running"] == 1, what="the request to run")
    answer = http.post("/admin/quiesce", json={"hold_ms": 1500})
    assert answer.status_code == 200, answer.text
    quiesced_at = time.monotonic()
    done = answer.json()
    assert done["quiesced"] is True and done["hold_ms"] == 1500 and done["drain_ms"] > 0
    running.join(timeout=30)
    assert running.finished_at is not None and running.finished_at <= quiesced_at + 0.5  # it ran to its end
    assert [line for line in running.lines if line][-1] == "data: [DONE]"
    live = http.get("/admin/live").json()
    assert live["quiesced"] and live["requests"]["running"] == 0 and live["held_until_unix_s"] > time.time()
    # a second quiesce while held: 409 in the OpenAI shape
    conflict = http.post("/admin/quiesce", json={"hold_ms": 10})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "quiesce_conflict"
    # a new request waits at the gate until the hold ends, then runs
    result: dict = {}

    def late_request():
        with server.http(headers=AUTH) as client:
            result["body"] = client.post("/v1/chat/completions", json={**CHAT, "model": "default", "max_tokens": 2}).json()
            result["at"] = time.monotonic()

    late = threading.Thread(target=late_request)
    late.start()
    wait_for(lambda: http.get("/admin/live").json()["requests"]["held"] == 1, what="the request to be held")
    late.join(timeout=30)
    assert result["body"]["usage"]["completion_tokens"] >= 1
    assert result["at"] >= quiesced_at + 1.2
    assert http.get("/admin/stats").json()["quiesced"] is False


def test_quiesce_that_cannot_drain_in_time_is_a_409_and_releases_the_gate(server, http):
    wait_idle(http)
    stream = Stream(server, ENDLESS)
    stream.start()
    try:
        wait_for(lambda: http.get("/admin/live").json()["requests"]["running"] == 1, what="the request to run")
        started = time.monotonic()
        answer = http.post("/admin/quiesce", json={"hold_ms": 60_000, "timeout_ms": 300})
        assert answer.status_code == 409, answer.text
        assert time.monotonic() - started < 5
        assert "did not drain within 300 ms" in answer.json()["error"]["message"]
        assert http.get("/admin/stats").json()["quiesced"] is False
        quick = http.post("/v1/chat/completions", json={**CHAT, "model": "default", "max_tokens": 1})
        assert quick.status_code == 200
    finally:
        stream.close()


def test_resume_ends_a_hold_early(http):
    assert http.post("/admin/quiesce", json={"hold_ms": 600_000}).status_code == 200
    assert http.post("/admin/resume", json={}).json() == {"resumed": True}
    assert http.post("/v1/chat/completions", json={**CHAT, "model": "default", "max_tokens": 1}).status_code == 200
    assert http.post("/admin/resume", json={}).json() == {"resumed": False}


@pytest.mark.parametrize("body, param", [({"hold_ms": -1}, "hold_ms"), ({"hold_ms": "1"}, "hold_ms"),
                                         ({"timeout_ms": 0}, "timeout_ms"), ({"hold": 1}, "hold")])
def test_quiesce_rejects_a_bad_body(http, body, param):
    response = http.post("/admin/quiesce", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ---- --reserve-gib -------------------------------------------------------------------------


def test_reserve_gib_shrinks_the_auto_pool_and_refuses_a_start_that_cannot_fit(smollm2, smollm2_path, capsys):
    from ninfer.cli.main import main
    from ninfer.runtime import GIB, host_memory, num_pages_for
    from ninfer.sched.config import EngineConfig

    config = EngineConfig(max_context=256)
    full = num_pages_for(smollm2, config, "reference")
    available, _ = host_memory()
    page_bytes = 16 * smollm2.spec.kv_bytes_per_token(4)
    reserved = num_pages_for(smollm2, config, "reference", reserve_bytes=available - 64 * page_bytes)
    assert 256 // 16 <= reserved < full
    code = main(["serve", str(smollm2_path), "--backend", "reference", "--port", "0", "--max-context", "256",
                 "--reserve-gib", "100000", "--log-level", "warning"])  # fmt: skip
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("ninfer serve: error: --reserve-gib 100000 does not fit")
    assert f"of {host_memory()[1] / GIB:.2f} GiB" in error and "one --max-context of 256 tokens needs" in error


def test_the_new_flags_reach_the_settings():
    from ninfer.cli.main import build_parser
    from ninfer.cli.serve import settings_from_args

    args = build_parser().parse_args(["serve", "model.gguf", "--served-model-name", "a", "b", "--served-model-name", "c",
                                      "--reserve-gib", "1.5", "--no-webui", "--no-gc-freeze"])  # fmt: skip
    settings = settings_from_args(args)
    assert settings.model == "model.gguf" and settings.served_model_names == ("a", "b", "c")
    assert settings.runtime.reserve_bytes == 3 << 29 and settings.webui is False and settings.gc_freeze is False
    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert defaults.webui is True and defaults.gc_freeze is True
