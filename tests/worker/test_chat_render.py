"""How a conversation becomes the model's text: developer → system, tools in the template or in a
Hermes system prompt, earlier calls and their results, and a final assistant message continued."""

from __future__ import annotations

import dataclasses
import json

import pytest

from worker.chat_render import render_chat, tool_calls_grammar
from worker.grammar import GrammarCompiler
from worker.model.chat_template import ChatTemplate

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# A template that shows tools itself, as Qwen's do (shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_developer_is_the_system_prompt(tiny):
    text = render_chat(tiny, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "developer" not in text


def test_a_template_without_tools_gets_them_in_a_hermes_system_prompt(tiny):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    text = render_chat(tiny, messages, tools=[TOOL])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.") and json.dumps(TOOL) in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_gets_them_and_the_calls_arguments_as_a_map(tiny):
    model = dataclasses.replace(tiny, chat_template=ChatTemplate(TOOLS_TEMPLATE))
    text = render_chat(
        model,
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
        tools=[TOOL],
    )
    assert text.startswith("<tools>get_weather;</tools>")
    assert '<call>get_weather {"city": "Paris"}</call>' in text


def test_a_final_assistant_message_is_continued(tiny):
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    text = render_chat(tiny, messages, continue_final=True)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    closed = render_chat(tiny, messages)
    assert closed.endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")


def test_continuing_needs_an_assistant_message_last(tiny):
    with pytest.raises(ValueError, match="continue_final"):
        render_chat(tiny, [{"role": "user", "content": "hi"}], continue_final=True)


def test_the_tool_calls_grammar_compiles_and_admits_a_hermes_call(tiny):
    compiler = GrammarCompiler(tiny.tokenizer, vocab_size=tiny.config.vocab_size, stop_token_ids=tiny.stop_token_ids)
    constraint = tool_calls_grammar([TOOL], parallel=False)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tiny.tokenizer.encode(text, add_special_tokens=False).ids
    matcher = compiler.matcher(constraint, ids)
    assert matcher.error is None and not matcher.finished
    assert matcher.consume(min(tiny.stop_token_ids)) and matcher.finished  # the call may end the answer
    broken = compiler.matcher(
        constraint, tiny.tokenizer.encode(text.replace("Paris", "Paris\u0000"), add_special_tokens=False).ids[:-1]
    )
    assert broken.error is not None  # a control character inside a JSON string is refused
    wrong_tool = compiler.matcher(constraint)
    assert not all(
        wrong_tool.consume(i)
        for i in tiny.tokenizer.encode('<tool_call>\n{"name": "other"', add_special_tokens=False).ids
    )


def test_a_tool_calls_constraint_may_end_after_each_call_and_ends_at_a_repeated_one(tiny):
    # issue 29: under `required` with parallel calls the output could only go on, call after call, to max_tokens.
    compiler = GrammarCompiler(tiny.tokenizer, vocab_size=tiny.config.vocab_size, stop_token_ids=tiny.stop_token_ids)
    paris = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    rome = paris.replace("Paris", "Rome")

    def after(text: str, parallel: bool = True):
        constraint = {"type": "tool_calls", "tools": [TOOL], "parallel": parallel}
        return compiler.matcher(constraint, tiny.tokenizer.encode(text, add_special_tokens=False).ids)

    for text in (paris, paris + rome):  # each complete call may end the answer, or another may follow
        matcher = after(text)
        assert matcher.error is None and not matcher.finished
        assert matcher.consume(min(tiny.stop_token_ids)) and matcher.finished
    assert after(paris + paris.rstrip("\n")).finished  # the same call again: the output ends there
    assert after(paris, parallel=False).finished  # one call only: it ends after that call
