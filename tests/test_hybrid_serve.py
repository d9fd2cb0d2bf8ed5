"""`ninfer serve` on the tiny Qwen3.5 hybrid GGUF (reference backend), end to end through the
official OpenAI and Anthropic SDKs against a real server on a loopback port: plain and
streamed chat agree, the second turn of a conversation reports prompt tokens served from
the prefix cache (the first turn's state checkpoint), and /metrics shows the checkpoints kept
and no recurrent state held at idle."""

from __future__ import annotations

import time

import pytest
from server_fixtures import metric_values, running_server, small_settings

pytest.importorskip("torch")
from hybrid_models import hybrid, model  # noqa: E402, F401 (fixtures)

QUESTION = "Tell me, tiny hybrid model, what is the colour of the sky today?"
SEEDED = {"temperature": 0.8, "seed": 5}


@pytest.fixture(scope="module")
def server(model):
    with running_server(small_settings(max_context=256, kv_capacity=1024, max_concurrency=2), model) as s:
        yield s


@pytest.fixture(scope="module")
def openai_client(server):
    return server.openai()


def test_openai_chat_plain_and_streamed_agree_and_the_next_turn_hits_the_cache(openai_client):
    client = openai_client
    model_id = client.models.list().data[0].id
    turn = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model=model_id, messages=turn, max_tokens=8, **SEEDED)
    text, usage = [], None
    with client.chat.completions.create(model=model_id, messages=turn, max_tokens=8, stream=True,
                                        stream_options={"include_usage": True}, **SEEDED) as stream:  # fmt: skip
        for chunk in stream:
            text += [choice.delta.content or "" for choice in chunk.choices]
            usage = chunk.usage or usage
    reply = plain.choices[0].message.content
    assert "".join(text) == reply and plain.usage.completion_tokens == 8
    # the second identical request already reused the first one's prompt (its checkpoint)
    assert usage.prompt_tokens_details.cached_tokens > 0
    second = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "And at night?"}]
    answer = client.chat.completions.create(model=model_id, messages=second, max_tokens=4, **SEEDED)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < answer.usage.prompt_tokens
    assert cached >= plain.usage.prompt_tokens - 16  # the whole first prompt, to its last page boundary


def test_anthropic_messages_plain_and_streamed_agree_and_the_next_turn_hits_the_cache(server, openai_client):
    client = server.anthropic()
    model_id = openai_client.models.list().data[0].id
    args = dict(model=model_id, max_tokens=6, messages=[{"role": "user", "content": "Why is grass green, my friend?"}],
                extra_body={"temperature": 0.0})  # fmt: skip
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    follow = [*args["messages"], {"role": "assistant", "content": whole.content[0].text},
              {"role": "user", "content": "Thanks!"}]  # fmt: skip
    answer = client.messages.create(**{**args, "messages": follow})
    assert answer.usage.cache_read_input_tokens > 0


def test_metrics_show_the_checkpoints_and_no_state_held_at_idle(server, openai_client):
    model_id = openai_client.models.list().data[0].id
    openai_client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=3, **SEEDED)  # fmt: skip
    with server.http() as http:
        for _ in range(100):  # the engine lets the sequence go as it delivers the last token
            values = metric_values(http.get("/metrics").text)
            if values["ninfer_requests_running"] == 0:
                break
            time.sleep(0.1)
    assert values["ninfer_prefix_checkpoints"] >= 1 and values["ninfer_prefix_checkpoint_bytes"] > 0
    # a state is held per running sequence only: every request has ended
    assert values["ninfer_requests_running"] == 0
    assert values["ninfer_recurrent_states"] == 0 and values["ninfer_recurrent_state_bytes"] == 0
