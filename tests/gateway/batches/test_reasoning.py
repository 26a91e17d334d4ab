"""A thinking model's batch answers carry the thinking apart, as the live endpoints answer it (issue 29).

First a run folded from a scripted worker's events (a tag cut across deltas) and rendered for each
API; then end to end: a tiny random Qwen3 under the real Qwen3 template, its output scripted by a
regex constraint (tests/support/thinking_model.py), served by a real worker; each item is asked live
too, and the batch's answer must be the live one (greedy, float32: the same tokens).

- OpenAI chat items: `message.content` the answer, `reasoning_content` / `reasoning` the thinking,
  `completion_tokens_details.reasoning_tokens` its tokens.
- Anthropic message items with `thinking: enabled`: a `thinking` block (signed, as live) before the text.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletion

import protocol
from gateway import thinking_signature
from gateway.batches import items
from gateway.batches.item_run import ItemRun
from tests.support.batch_files import file_lines, jsonl, openai_batch_end, poll
from tests.support.gateway_harness import REAL_MODEL
from tests.support.thinking_model import QUESTION, make_tiny_qwen3, thinking_service
from worker.model.loader import LoadedModel

SECRET = "batch-thinking-secret"
# A Qwen3 answer as a worker streams it, a tag cut across deltas (as tests/gateway/test_reasoning.py).
PIECES = ["<think>", "\nThe user", " asks 2+2.", "\n</th", "ink>\n\n", "It is", " 4."]
REASONING, ANSWER, REASONING_TOKENS = "The user asks 2+2.", "It is 4.", 5


def thinking_run() -> ItemRun:
    """A run fed a thinking model's events, to its `done`."""
    run = ItemRun(0, 1, "stream", "1-0", "reply", "req-1")
    tags = {"start": "<think>", "end": "</think>", "open": False}
    events = [protocol.started_event("req-1", 0, 7, tags)]
    events += [protocol.delta_event("req-1", i + 1, piece, [100 + i], i) for i, piece in enumerate(PIECES)]
    for event in events:
        assert run.feed(event) is None
    done = protocol.done_event("req-1", len(PIECES) + 1, "stop", 7, len(PIECES), 0)
    assert run.feed(done).how == "done"
    return run


async def test_a_run_folds_the_thinking_apart_and_the_answer_renders_it_for_each_api():
    run = thinking_run()
    assert run.answer["text"] == ANSWER and run.answer["reasoning"] == REASONING
    assert run.answer["reasoning_tokens"] == REASONING_TOKENS
    outcome = {"request_id": "req-1", "outcome": "succeeded", **run.answer, "done": {"finish_reason": "stop"}}
    outcome["usage"] = {"prompt_tokens": 7, "completion_tokens": len(PIECES)}
    chat = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"model": "m", "messages": QUESTION}}
    message = (await items.answer_body(chat, outcome))["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"], message["reasoning"]) == (ANSWER, REASONING, REASONING)
    body = {"model": "m", "max_tokens": 64, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 32}}
    answer = await items.answer_body({"custom_id": "m", "url": "/v1/messages", "body": body}, outcome, SECRET)
    block, text = answer["content"]
    assert (block["type"], block["thinking"], text) == ("thinking", REASONING, {"type": "text", "text": ANSWER})
    assert thinking_signature.verify(SECRET, REASONING, block["signature"])
    old = {key: value for key, value in outcome.items() if key not in ("reasoning", "reasoning_tokens")}
    old["text"] = "".join(PIECES)  # an outcome written before batches split the thinking: answered as it was
    assert (await items.answer_body(chat, old))["choices"][0]["message"]["content"] == "".join(PIECES)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
async def url(redis_url, tiny_qwen3, monkeypatch):
    async with thinking_service(redis_url, tiny_qwen3, monkeypatch) as url:
        yield url


async def test_a_chat_batch_answer_has_the_thinking_apart_as_the_live_one(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": REAL_MODEL, "messages": QUESTION, "max_tokens": 96, "temperature": 0}
    live = await client.chat.completions.create(**ask)
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": ask}
    upload = await client.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await openai_batch_end(client, batch.id)
    [found] = await file_lines(client, batch.output_file_id)
    answer = ChatCompletion.model_validate(found["response"]["body"])
    message, expected = answer.choices[0].message, live.choices[0].message
    assert message.content == expected.content == "Paris."
    assert message.reasoning_content == message.reasoning == expected.reasoning_content
    assert expected.reasoning_content  # the live answer thought: the comparison means something
    reasoning_tokens = answer.usage.completion_tokens_details.reasoning_tokens
    assert reasoning_tokens == live.usage.completion_tokens_details.reasoning_tokens > 0


async def test_a_message_batch_answer_opens_with_the_thinking_block_as_the_live_one(url):
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    params = {
        "model": REAL_MODEL,
        "max_tokens": 96,
        "messages": QUESTION,
        "thinking": {"type": "enabled", "budget_tokens": 64},
    }
    live = await client.messages.create(**params, extra_body={"temperature": 0})
    item = {"custom_id": "m", "params": params | {"temperature": 0}}
    batch = await client.messages.batches.create(requests=[item])

    async def ended():
        found = await client.messages.batches.retrieve(batch.id)
        return found if found.processing_status == "ended" else None

    await poll(ended, what="the batch's end")
    [result] = [result async for result in await client.messages.batches.results(batch.id)]
    assert result.result.type == "succeeded", result
    message = result.result.message
    assert [block.type for block in live.content] == ["thinking", "text"]  # the live answer thought
    assert [block.model_dump() for block in message.content] == [block.model_dump() for block in live.content]
    assert message.usage.output_tokens == live.usage.output_tokens
