"""Streamed chat chunks (no server): the text event made from a template is the event the
general path encodes, byte for byte, and the real `openai` SDK's chunk type reads it."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk

from ninfer.protocols.calls import LogprobEntry, TextDelta
from ninfer.protocols.openai_out import ChatChunker
from ninfer.protocols.sse import _MARK, sse_event

TEXTS = ["Hello", " world", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "Ünïcödé – ✓ 🦙", "\x00\x1f",
         "</s>", "{\"json\": [1, 2]}", _MARK, f"x{_MARK}y"]  # fmt: skip


def _general(chunker: ChatChunker, delta: TextDelta) -> bytes | None:
    chunk = chunker.text(delta)
    return None if chunk is None else sse_event(chunk)


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", _MARK])
def test_a_text_event_from_the_template_is_the_general_one(model):
    chunker = ChatChunker(id="chatcmpl-1", created=1_700_000_000, model=model, include_usage=False)
    for text in TEXTS:
        delta = TextDelta(text, (1, 2))
        event = chunker.text_event(delta)
        assert event == _general(chunker, delta), text
        [line] = event.decode().removesuffix("\n\n").split("\n")
        parsed = ChatCompletionChunk.model_validate(json.loads(line.removeprefix("data: ")))
        assert parsed.choices[0].delta.content == text and parsed.model == model


def test_empty_text_has_no_event_and_logprobs_take_the_general_path():
    chunker = ChatChunker(id="chatcmpl-1", created=1, model="m", include_usage=True)
    assert chunker.text_event(TextDelta("")) is None
    entry = LogprobEntry(7, "hi", b"hi", -0.25, (LogprobEntry(8, "ho", b"ho", -1.5),))
    for delta in (TextDelta("hi", (7,), (entry,)), TextDelta("", (7,), (entry,))):
        event = chunker.text_event(delta)
        assert event is not None and event == _general(chunker, delta)
        parsed = ChatCompletionChunk.model_validate(json.loads(event.decode().removeprefix("data: ")))
        assert parsed.choices[0].logprobs.content[0].logprob == -0.25


@pytest.mark.parametrize("echo", ["", "Once upon"])
def test_a_streamed_completion_text_chunk_from_the_template_is_the_general_one(echo):
    """A text completion's plain text chunks fill an event template (`sse.EventTemplate`): the
    bytes are those of the general encode (the echo rides with the first chunk), each is one
    `data:` line, and logprobs or the finish take the general path."""
    from ninfer.protocols.calls import CallFinished
    from ninfer.core.usage import Usage
    from ninfer.server.routes_openai import _CompletionStreamState

    state = _CompletionStreamState("cmpl-1", 1_700_000_000, _MARK, echo, include_usage=True)
    general = _CompletionStreamState("cmpl-1", 1_700_000_000, _MARK, echo, include_usage=True)
    got = []
    for i, text in enumerate(TEXTS):
        [event] = state.chunks(TextDelta(text))
        assert event == general._chunk((echo if i == 0 else "") + text, None, None), text
        [line] = event.decode().removesuffix("\n\n").split("\n")
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["object"] == "text_completion" and chunk["model"] == _MARK
        got.append(chunk["choices"][0]["text"])
    assert "".join(got) == echo + "".join(TEXTS)
    assert state.chunks(TextDelta("")) == []
    entry = LogprobEntry(7, "hi", b"hi", -0.25, ())
    [event] = state.chunks(TextDelta("hi", (7,), (entry,)))
    assert json.loads(event.decode().removeprefix("data: "))["choices"][0]["logprobs"]["token_logprobs"] == [-0.25]
    usage = Usage(prompt_tokens=3, completion_tokens=len(TEXTS) + 1)
    finish = state.chunks(CallFinished(reason="stop", usage=usage))
    assert [json.loads(e.decode().removeprefix("data: "))["choices"][:1] for e in finish][1] == []
