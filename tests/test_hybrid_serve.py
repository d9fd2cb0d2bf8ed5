"""`ninfer serve` on the tiny Qwen3.5 hybrid GGUF (reference backend), end to end through the
official OpenAI and Anthropic SDKs against a real server on a loopback port: plain and
streamed chat agree, and the second turn of a conversation reports prompt tokens served from
the prefix cache (the first turn's state checkpoint)."""

from __future__ import annotations

import pytest
from server_fixtures import running_server, small_settings

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
