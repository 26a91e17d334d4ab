"""Thinking models through the APIs (issue 29), first from a scripted worker whose `started` event says
the answer thinks (the output cut mid-tag), then from a tiny random Qwen3 under the real Qwen3
template with its output scripted by a regex constraint, served by a real worker.

- OpenAI chat: the thinking in `reasoning_content` and `reasoning`, whole and streamed, counted in
  `completion_tokens_details.reasoning_tokens`; `reasoning_effort` a budget, `chat_template_kwargs`
  passed to the template.
- Anthropic: `thinking: enabled` → a signed `thinking` block before the text, streamed with
  thinking_delta and a signature_delta (llama.cpp's server test's shape); the block verifies when it
  comes back in the history, a changed one is a 400; disabled (the default) turns thinking off.
"""

from __future__ import annotations

import dataclasses
import json
import re

import aiohttp
import anthropic
import openai
import pytest

import protocol
from gateway import openai as openai_api
from tests.support.gateway_harness import MODEL, REAL_MODEL, real_worker, running_gateway, worker_running
from tests.support.thinking_model import QUESTION, QWEN3_TEMPLATE, make_tiny_qwen3, thinking_service
from worker.model.chat_template import ChatTemplate
from worker.model.loader import LoadedModel

# A Qwen3 answer as the worker streams it, a tag cut across deltas.
PIECES = ["<think>", "\nThe user", " asks 2+2.", "\n</th", "ink>\n\n", "It is", " 4."]
REASONING, ANSWER, REASONING_TOKENS = "The user asks 2+2.", "It is 4.", 5


def thinking_script(request: protocol.Request) -> list[list[dict]]:
    tags = {"start": "<think>", "end": "</think>", "open": False}
    batches = [[protocol.started_event(request.id, 0, 7, tags)]]
    batches += [[protocol.delta_event(request.id, i + 1, piece, [100 + i], i)] for i, piece in enumerate(PIECES)]
    return batches + [[protocol.done_event(request.id, len(PIECES) + 1, "stop", 7, len(PIECES), 0)]]


@pytest.fixture
async def thinker(redis_url, redis_client):
    async with worker_running(redis_client, thinking_script) as received, running_gateway(redis_url) as url:
        yield url, received


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _anthropic(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


async def test_chat_answers_the_thinking_apart_whole_and_streamed(thinker):
    url, received = thinker
    client = _openai(url)
    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="low")
    message = answer.choices[0].message
    assert (message.content, message.reasoning_content, message.reasoning) == (ANSWER, REASONING, REASONING)
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == REASONING
    assert "".join(getattr(delta, "reasoning", None) or "" for delta in deltas) == REASONING
    assert "".join(delta.content or "" for delta in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert received[0].reasoning_budget == openai_api.REASONING_BUDGETS["low"]
    assert received[1].reasoning_budget is None and received[1].template_kwargs is None


async def test_reasoning_effort_none_and_template_kwargs_reach_the_worker(thinker):
    url, received = thinker
    client = _openai(url)
    kwargs = {"chat_template_kwargs": {"enable_thinking": True, "custom": [1, "a"]}}
    await client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=kwargs)
    await client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="none")
    assert received[0].template_kwargs == kwargs["chat_template_kwargs"]
    assert (received[1].template_kwargs, received[1].reasoning_budget) == ({"enable_thinking": False}, 0)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        await client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"reasoning_effort": "max"})
    with pytest.raises(openai.BadRequestError, match="template_kwargs"):  # the worker sets `messages`
        await client.chat.completions.create(
            model=MODEL, messages=QUESTION, extra_body={"chat_template_kwargs": {"messages": []}}
        )


async def test_anthropic_thinking_is_a_signed_block_that_verifies_when_it_comes_back(thinker):
    url, received = thinker
    client = _anthropic(url)
    enabled = {"type": "enabled", "budget_tokens": 50}
    answer = await client.messages.create(model=MODEL, max_tokens=100, messages=QUESTION, thinking=enabled)
    thinking, text = answer.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", REASONING, "text", ANSWER)
    assert received[0].reasoning_budget == 50 and received[0].template_kwargs == {"enable_thinking": True}
    history = [*QUESTION, {"role": "assistant", "content": [block.model_dump() for block in answer.content]}]
    history.append({"role": "user", "content": "And 3+3?"})
    await client.messages.create(model=MODEL, max_tokens=100, messages=history, thinking=enabled)
    assert [m["role"] for m in received[1].messages] == ["user", "assistant", "user"]
    assert received[1].messages[1]["content"] == ANSWER  # the thinking checked, and left out of the prompt
    history[1]["content"][0]["thinking"] = "I was told to say 5."
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.1\.content\.0\.signature"):
        await client.messages.create(model=MODEL, max_tokens=100, messages=history, thinking=enabled)
    await client.messages.create(model=MODEL, max_tokens=100, messages=QUESTION)  # thinking off, as on Anthropic's API
    assert (received[-1].template_kwargs, received[-1].reasoning_budget) == ({"enable_thinking": False}, 0)


async def test_anthropic_thinking_streams_in_the_shape_llama_cpp_server_tests(thinker):
    # llama.cpp tools/server/tests/unit/test_compat_anthropic.py, test_anthropic_thinking_with_reasoning_model
    url, _ = thinker
    body = {
        "model": MODEL,
        "max_tokens": 1024,
        "thinking": {"type": "enabled", "budget_tokens": 500},
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json={**body, "stream": True}) as response:
            raw = await response.text()
        async with http.post(url + "/v1/messages", json=body) as response:
            whole = await response.json()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "thinking"), (1, "text")]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert "".join(e["delta"]["thinking"] for e in deltas if e["delta"]["type"] == "thinking_delta") == REASONING
    signature = [e for e in deltas if e["delta"]["type"] == "signature_delta"]
    assert len(signature) == 1 and signature[0]["index"] == 0
    assert events.index(signature[0]) < events.index(next(e for e in events if e["type"] == "content_block_stop"))
    assert [block["type"] for block in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == REASONING
    assert whole["content"][0]["signature"] == signature[0]["delta"]["signature"]


async def test_a_model_that_does_not_think_answers_a_thinking_request_as_usual(redis_url, redis_client):
    # llama.cpp's test_anthropic_thinking: a model without a thinking template still answers (200, a text block).
    def script(request: protocol.Request) -> list[list[dict]]:
        return [[protocol.started_event(request.id, 0, 7)], [protocol.delta_event(request.id, 1, "<think>4", [1], 0)],
                [protocol.done_event(request.id, 2, "stop", 7, 1, 0)]]  # fmt: skip

    async with worker_running(redis_client, script), running_gateway(redis_url) as url:
        answer = await _anthropic(url).messages.create(
            model=MODEL, max_tokens=100, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 50}
        )
    assert [(block.type, block.text) for block in answer.content] == [("text", "<think>4")]


# ---------------------------------------------------------------- a tiny random Qwen3, real template, real worker


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
async def qwen3_url(redis_url, tiny_qwen3, monkeypatch):
    async with thinking_service(redis_url, tiny_qwen3, monkeypatch) as url:
        yield url


async def test_a_qwen3_answer_is_split_and_its_thinking_counted(qwen3_url):
    client = _openai(qwen3_url)
    ask = dict(model=REAL_MODEL, messages=QUESTION, max_tokens=96, temperature=0)
    answer = await client.chat.completions.create(**ask)
    message, usage = answer.choices[0].message, answer.usage
    assert message.content == "Paris."
    assert re.fullmatch(r"[ok][ ok]*", message.reasoning_content) and message.reasoning == message.reasoning_content
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    stream = await client.chat.completions.create(**ask, stream=True)
    deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == message.reasoning_content
    assert "".join(delta.content or "" for delta in deltas) == "Paris."


async def test_a_qwen3_thinking_budget_is_closed_by_the_worker(qwen3_url, tiny_qwen3):
    client = _anthropic(qwen3_url)

    async def thinking(budget: int) -> tuple[str, int]:
        answer = await client.messages.create(
            model=REAL_MODEL,
            max_tokens=60,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": budget},
            extra_body={"temperature": 0},
        )
        block, text = answer.content
        assert (block.type, text.text) == ("thinking", "Paris.")
        return block.thinking, len(tiny_qwen3.tokenizer.encode(block.thinking, add_special_tokens=False).ids)

    free, free_tokens = await thinking(50)
    cut, cut_tokens = await thinking(4)
    assert free_tokens > 4  # left alone, this model thinks longer than the budget
    assert free.startswith(cut) and cut_tokens <= 4  # the worker closed it after 4 tokens


async def test_an_answer_that_begins_inside_the_thinking_is_split_too(redis_url, tiny_qwen3, monkeypatch):
    # QwQ's template (like DeepSeek-R1's) opens the block in the prompt: the output only closes it.
    qwq = (QWEN3_TEMPLATE.parent / "Qwen-QwQ-32B.jinja").read_text(encoding="utf-8")
    model = dataclasses.replace(tiny_qwen3, chat_template=ChatTemplate(qwq, eos_token="<|im_end|>"))
    script = {"type": "regex", "pattern": r"[ ok]{1,20}\n</think>\n\nParis\."}
    monkeypatch.setattr(openai_api, "parse_response_format", lambda body: script)
    async with real_worker(redis_url, model, kv_memory="16MiB"), running_gateway(redis_url) as url:
        answer = await _openai(url).chat.completions.create(
            model=REAL_MODEL, messages=QUESTION, max_tokens=60, temperature=0
        )
    message = answer.choices[0].message
    assert message.content == "Paris." and re.fullmatch(r"[ok][ ok]*", message.reasoning_content)


@pytest.mark.slow
async def test_llama_cpp_servers_thinking_case_on_the_real_default_model(redis_url, default_model):
    # llama.cpp test_compat_anthropic.py::test_anthropic_thinking, verbatim: a model that does not think.
    body = {
        "model": REAL_MODEL,
        "max_tokens": 100,
        "thinking": {"type": "enabled", "budget_tokens": 50},
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    async with real_worker(redis_url, default_model, kv_memory="64MiB"), running_gateway(redis_url) as url:
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/messages", json=body) as response:
            status, answer = response.status, await response.json()
    assert status == 200 and answer["type"] == "message"
    assert [block["type"] for block in answer["content"]] == ["text"]
