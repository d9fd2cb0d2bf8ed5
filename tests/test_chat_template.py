"""Chat templates rendered like transformers' apply_chat_template, plus Hermes tool injection."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest

from ninfer.models.chat_template import ChatTemplate, ChatTemplateError

CONVERSATION = [
    {"role": "user", "content": "Hi there! Can you help?"},
    {"role": "assistant", "content": "Of course 😀 — what do you need?"},
    {"role": "user", "content": "Translate «bonjour» to 日本語."},
    {"role": "assistant", "content": "こんにちは"},
    {"role": "user", "content": "Thanks.\nOne more:  spaces  and\ttabs?"},
]
WITH_SYSTEM = [{"role": "system", "content": "You answer in one word."}, *CONVERSATION]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "12C rain"},
]


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def smol_template(smollm2):
    return smollm2.chat_template


@pytest.mark.parametrize("messages", [CONVERSATION, WITH_SYSTEM, CONVERSATION[:1]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smol_template, hf_reference, messages, add_generation_prompt):
    ours = smol_template.render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_smollm2_template_ignores_tools_so_they_are_injected(smol_template, smollm2):
    assert not smol_template.supports_tools
    text = smol_template.render(TOOL_TURNS, tools=[WEATHER_TOOL])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S).group(1)
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER_TOOL]
    assistant_turn = text.split("<|im_start|>assistant")[1]
    calls = [json.loads(c) for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", assistant_turn)]
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Zürich"}},
    ]
    results = "<tool_response>\n18C sunny\n</tool_response>\n<tool_response>\n12C rain\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = smollm2.tokenizer.encode(text)
    assert ids.count(smollm2.tokenizer.token_to_id("<|im_start|>")) == 5


def test_injected_tools_follow_the_callers_system_prompt(smol_template):
    text = smol_template.render([{"role": "system", "content": "Be terse."}, TOOL_TURNS[0]], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1


def test_chatml_renders_tools_itself_like_the_injection(smol_template):
    chatml = ChatTemplate.chatml()
    assert chatml.supports_tools and chatml.eos_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Be terse."}, *TOOL_TURNS]
    # SmolLM2's template is plain ChatML once a system message exists, so the two must agree.
    assert chatml.render(messages, tools=[WEATHER_TOOL]) == smol_template.render(messages, tools=[WEATHER_TOOL])
    assert chatml.render(WITH_SYSTEM) == smol_template.render(WITH_SYSTEM)
    assert chatml.render(CONVERSATION).startswith("<|im_start|>user\n")  # no default system text


def test_content_parts_are_joined_for_string_templates(smol_template):
    parts = [{"role": "user", "content": [_text("line one"), _text("line two")]}]
    assert smol_template.content_format == "string"
    assert "<|im_start|>user\nline one\nline two<|im_end|>" in smol_template.render(parts)
    with pytest.raises(ChatTemplateError, match="image_url"):
        smol_template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_templates_that_loop_over_parts_receive_them():
    template = ChatTemplate("{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}")
    assert template.content_format == "parts"
    assert template.render([{"role": "user", "content": [_text("a"), _text("b")]}]) == "[a][b]"


TRICKY_TEMPLATES = [
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U: {{ m.content }}\n  {% endif %}\n{% endfor %}",
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% generation %}<{{ m.role }}>{% endgeneration %}{% endfor %}{{ bos_token + eos_token }}",
    "{{ messages[0].content | trim | upper }}{% if add_generation_prompt %}>{% endif %}{{ documents is none }}",
]


@pytest.mark.parametrize("source", TRICKY_TEMPLATES)
def test_environment_matches_transformers(source):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "  héllo <b>&</b> "}, {"role": "assistant", "content": "ok"}]
    ours = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, add_generation_prompt=True)
    rendered, _ = render_jinja_template(
        [messages], chat_template=source, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    assert ours == rendered[0]


def test_strftime_now_and_extra_variables():
    template = ChatTemplate("{{ strftime_now('%Y') }}-{{ custom }}")
    before = datetime.now().year
    year, custom = template.render([], custom="x").split("-")
    assert before <= int(year) <= datetime.now().year and custom == "x"


def test_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        raising.render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_access():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_continue_final_message_leaves_the_turn_open(smol_template):
    messages = [*CONVERSATION[:1], {"role": "assistant", "content": "The answer is"}]
    text = smol_template.render(messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
