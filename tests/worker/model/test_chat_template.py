"""Chat templates render with the variables and helpers that models' templates rely on."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest

from worker.model.chat_template import ChatTemplate, ChatTemplateError
from worker.model.checkpoint import CHATML_TEMPLATE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chatml_with_and_without_generation_prompt() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert template.render(MESSAGES, add_generation_prompt=False) == body
    assert template.render(MESSAGES) == body + "<|im_start|>assistant\n"


def test_bos_eos_and_tools_reach_the_template() -> None:
    source = "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    rendered = template.render(MESSAGES, tools=tools)
    assert rendered == '<s>[{"type": "function", "function": {"name": "weather", "parameters": {}}}]Be brief.</s>Hi</s>'


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        template.render(MESSAGES)


def test_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)


def test_template_cannot_mutate_the_messages() -> None:
    template = ChatTemplate("{{ messages.append({'role': 'user', 'content': 'x'}) }}")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)
    assert len(MESSAGES) == 2


# --- real templates, rendered as transformers' apply_chat_template renders them --------------------

TEMPLATE_DIR = pathlib.Path(__file__).parent / "chat_templates"  # copied from the models' tokenizer_config.json
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS = {
    "one-user-turn": ([{"role": "user", "content": "Hi ✓ 日本語 🙂"}], None),
    "system-and-turns": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "  And 3+3?  "},
        ],
        None,
    ),
    "tool-call-round-trip": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call12345",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": '{"temperature": 21}'},
        ],
        [WEATHER_TOOL],
    ),
    "tools-offered": (
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}],
        [WEATHER_TOOL],
    ),
    "assistant-first": ([{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}], None),
}


def _transformers_render(source: str, messages: list, tools: list | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    return rendered[0]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template_file", sorted(TEMPLATE_DIR.glob("*.jinja")), ids=lambda path: path.stem)
def test_real_templates_render_as_transformers_renders_them(template_file: pathlib.Path, conversation: str) -> None:
    """Same text, or the same refusal (raise_exception) — for Qwen3, QwQ, Llama 3.2/3.3, Gemma 2/3, Mistral Nemo, Phi-3.5."""
    import jinja2

    source = template_file.read_text(encoding="utf-8")
    messages, tools = CONVERSATIONS[conversation]
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    try:
        expected = _transformers_render(source, copy.deepcopy(messages), tools)
    except jinja2.TemplateError as refusal:
        with pytest.raises(ChatTemplateError, match=re.escape(str(refusal))):
            template.render(copy.deepcopy(messages), tools=tools)
        return
    assert template.render(copy.deepcopy(messages), tools=tools) == expected


def test_every_template_renders_some_conversation() -> None:
    """The parametrized test above cannot pass by every template refusing everything."""
    for path in TEMPLATE_DIR.glob("*.jinja"):
        text = ChatTemplate(path.read_text(encoding="utf-8"), bos_token="<s>").render(CONVERSATIONS["one-user-turn"][0])
        assert "Hi ✓ 日本語 🙂" in text


def test_generation_blocks_loop_controls_and_namespace() -> None:
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}|{{ {'b': [1, 2]} | tojson(indent=2, separators=(',', ': ')) }}"
    )
    text = ChatTemplate(source).render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "user", "content": "X"}]
    )
    assert text == 'U|1|{\n  "b": [\n    1,\n    2\n  ]\n}'


def test_namespace_refuses_dunder_names() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(__class__=1) %}{{ ns }}").render(MESSAGES)
