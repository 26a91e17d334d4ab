"""Chat templates render with the variables and helpers that models' templates rely on."""

from __future__ import annotations

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
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}")
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
