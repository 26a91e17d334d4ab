"""OpenAI's Batch API through the official SDK: a real gateway, a real worker on the tiny model, real Redis."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

import protocol
from tests.support.batch_files import (
    chat_line,
    create_batch,
    file_lines,
    jsonl,
    openai_batch_end,
    openai_client,
    openai_progress,
    slow,
)
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway


async def test_a_batch_answers_every_item_once_as_the_live_endpoint_would(url):
    client = openai_client(url)
    prompts = {f"q{i}": f"Question {i}: what comes after {i}?" for i in range(12)}
    upload = await client.files.create(
        file=("in.jsonl", jsonl([chat_line(cid, p) for cid, p in prompts.items()])), purpose="batch"
    )
    assert upload.purpose == "batch" and upload.bytes > 0 and upload.filename == "in.jsonl"
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "t1"}
    )
    assert (
        batch.status in ("validating", "in_progress")
        and batch.request_counts.total == 12
        and batch.metadata == {"job": "t1"}
    )

    batch = await openai_batch_end(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed, batch.request_counts.total) == (12, 0, 12)
    assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at >= batch.created_at
    lines = await file_lines(client, batch.output_file_id)
    assert Counter(line["custom_id"] for line in lines) == Counter(list(prompts))
    live = await client.chat.completions.create(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": prompts["q3"]}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.usage.completion_tokens == 4 and body.choices[0].finish_reason == "length"
        assert line["response"]["request_id"] == body.id
        if line["custom_id"] == "q3":
            assert body.choices[0].message.content == live.choices[0].message.content  # greedy: the same answer
    assert batch.usage.output_tokens == 48
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel(batch.id)  # too late: it completed
    output = await client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes == len(
        (await client.files.content(batch.output_file_id)).content
    )


async def test_legacy_completions_batches_and_item_errors_go_to_the_error_file(url, redis_client):
    client = openai_client(url)
    lines = [
        {
            "custom_id": "ok",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": REAL_MODEL, "prompt": "The fox", "max_tokens": 3, "temperature": 0},
        },
        {
            "custom_id": "long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": REAL_MODEL, "prompt": "fox " * 3000, "max_tokens": 3},
        },
    ]
    batch = await openai_batch_end(client, (await create_batch(client, lines, "/v1/completions")).id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [good] = await file_lines(client, batch.output_file_id)
    assert good["custom_id"] == "ok" and Completion.model_validate(good["response"]["body"]).object == "text_completion"
    [bad] = await file_lines(client, batch.error_file_id)
    assert bad["custom_id"] == "long" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["code"] == "prompt_too_long"
    assert (
        await redis_client.xlen(protocol.request_stream(REAL_MODEL, "batch")) == 0
    )  # every item's entry acknowledged and deleted


async def test_malformed_lines_are_refused_at_upload_each_one_named(url):
    client = openai_client(url)
    lines = [
        chat_line("fine", "hello"),
        "{not json",
        chat_line("fine", "the same custom_id again"),
        {"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": "g", "method": "GET", "url": "/v1/chat/completions", "body": {"model": REAL_MODEL}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": "text"},
        chat_line("s", "hi", stream=True),  # a bad body is not the file's format: it fails at run time
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    message = refused.value.body["message"]
    for number, problem in [
        (2, "not valid JSON"),
        (3, "used twice"),
        (4, "url"),
        (5, "model"),
        (6, "POST"),
        (7, "body"),
    ]:
        assert f"line {number}: " in message and problem in message, message
    assert "line 1:" not in message and "line 8:" not in message
    assert not [f async for f in client.files.list()]  # nothing was stored
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("in.jsonl", jsonl([chat_line("a", "b")])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("empty.jsonl", b"\n"), purpose="batch")


async def test_a_bad_body_fails_its_own_line_and_the_others_run(url):
    """issue 29: 8 good lines and one with max_tokens -5 run the 8; the 9th is in the error file with its 400."""
    client = openai_client(url)
    lines = [chat_line(f"g{i}", f"Say {i}") for i in range(8)] + [chat_line("bad", "hi", max_tokens=-5)]
    batch = await create_batch(client, lines)
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 9
    batch = await openai_batch_end(client, batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (8, 1)
    assert sorted(line["custom_id"] for line in await file_lines(client, batch.output_file_id)) == [
        f"g{i}" for i in range(8)
    ]
    [bad] = await file_lines(client, batch.error_file_id)
    assert bad["custom_id"] == "bad" and bad["error"] is None and bad["response"]["status_code"] == 400
    error = bad["response"]["body"]["error"]
    assert (
        "max_tokens" in error["message"] and error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    )


async def test_files_are_read_listed_and_deleted(url):
    client = openai_client(url)
    data = jsonl([chat_line("a", "one"), chat_line("b", "two")])
    upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
    assert (await client.files.retrieve(upload.id)).bytes == len(data)
    assert (await client.files.content(upload.id)).content == data
    assert [f.id async for f in client.files.list()] == [upload.id]
    deleted = await client.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


async def test_a_file_for_another_endpoint_or_model_fails_the_batch_with_its_errors(url):
    client = openai_client(url)
    lines = [chat_line("a", "one"), chat_line("b", "two", model="no-such-model")]
    upload = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    failed = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert failed.status == "failed" and failed.failed_at is not None
    problems = {(error.line, error.code) for error in failed.errors.data}
    assert {(1, "invalid_url"), (2, "invalid_url"), (None, "model_not_found")} <= problems
    assert (await client.batches.retrieve(failed.id)).status == "failed"
    with pytest.raises(openai.BadRequestError):
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")


async def test_batches_are_listed_newest_first_page_by_page(url):
    client = openai_client(url)
    upload = await client.files.create(file=("in.jsonl", jsonl([chat_line("a", "one")])), purpose="batch")
    created = [
        (
            await client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        ).id
        for _ in range(3)
    ]
    first = await client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2] and first.has_more
    assert [b.id async for b in client.batches.list(limit=2)] == created[::-1]  # the SDK follows `after`
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")
    for batch_id in created:
        await openai_batch_end(client, batch_id)


@pytest.mark.slow  # seconds of batch runs: seconds
async def test_cancelling_mid_way_keeps_finished_answers_and_cancels_the_rest(redis_url, tiny):
    async with (
        real_worker(redis_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(redis_url, batch_in_flight=4) as url,
    ):
        client = openai_client(url)
        lines = [chat_line(f"c{i}", f"Count to {i}", max_tokens=6) for i in range(30)]
        batch = await create_batch(client, lines)
        await openai_progress(client, batch.id, 3)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        batch = await openai_batch_end(client, batch.id)
        assert (await client.batches.cancel(batch.id)).status == "cancelled"  # again: nothing changes
        done, failed = await file_lines(client, batch.output_file_id), await file_lines(client, batch.error_file_id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed >= 3 and counts.completed + counts.failed == counts.total == 30
    assert len(done) == counts.completed and len(failed) == counts.failed > 0
    assert Counter(line["custom_id"] for line in done + failed) == Counter(f"c{i}" for i in range(30))
    assert all(line["error"]["code"] == "batch_cancelled" and line["response"] is None for line in failed)


@pytest.mark.slow  # waits for the window: seconds
async def test_a_batch_past_its_window_expires_its_unfinished_items(redis_url, tiny):
    async with (
        real_worker(redis_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(redis_url, batch_window_seconds=3.0, batch_in_flight=4) as url,
    ):
        client = openai_client(url)
        lines = [chat_line(f"e{i}", f"Name {i} colours", max_tokens=8) for i in range(40)]
        batch = await openai_batch_end(client, (await create_batch(client, lines)).id)
        done, failed = await file_lines(client, batch.output_file_id), await file_lines(client, batch.error_file_id)
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    assert Counter(line["custom_id"] for line in done + failed) == Counter(f"e{i}" for i in range(40))
    assert failed and all(line["error"]["code"] == "batch_expired" for line in failed)
    assert all(ChatCompletion.model_validate(line["response"]["body"]).usage.completion_tokens == 8 for line in done)
