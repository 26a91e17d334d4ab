"""Anthropic's Message Batches through the official SDK: a real gateway, a real worker on the tiny model, real Redis."""

from __future__ import annotations

from collections import Counter

import anthropic
import pytest

from tests.support.batch_files import anthropic_client, message_batch_end, poll, slow
from tests.support.batch_files import message_params as params
from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway


async def results(client: anthropic.AsyncAnthropic, batch_id: str) -> list:
    return [result async for result in await client.messages.batches.results(batch_id)]


async def test_a_message_batch_runs_to_the_end_with_one_result_per_request(url):
    client = anthropic_client(url)
    requests = [{"custom_id": f"m-{i}", "params": params(f"Say {i}", system="Be brief.")} for i in range(10)]
    requests.append({"custom_id": "too-long", "params": params("fox " * 3000)})
    batch = await client.messages.batches.create(requests=requests)
    assert (
        batch.processing_status == "in_progress" and batch.request_counts.processing == 11 and batch.results_url is None
    )
    batch = await message_batch_end(client, batch.id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored, batch.request_counts.processing) == (10, 1, 0)
    assert batch.ended_at is not None and batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    found = await results(client, batch.id)
    assert Counter(result.custom_id for result in found) == Counter([r["custom_id"] for r in requests])
    live = await client.messages.create(
        model=REAL_MODEL,
        max_tokens=4,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say 3"}],
        extra_body={"temperature": 0},
    )
    for result in found:
        if result.custom_id == "too-long":
            assert result.result.type == "errored" and result.result.error.error.type == "invalid_request_error"
            continue
        message = result.result.message
        assert (
            result.result.type == "succeeded"
            and message.stop_reason in ("max_tokens", "end_turn")
            and message.usage.output_tokens <= 4
        )
        if result.custom_id == "m-3":
            assert message.content == live.content  # greedy: what the live endpoint answers
    listed = [b.id async for b in client.messages.batches.list(limit=1)]
    assert listed == [batch.id]
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.batches.delete(
            (await client.messages.batches.create(requests=requests[:1])).id
        )  # still processing
    deleted = await client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.batches.retrieve(batch.id)


async def test_a_malformed_request_refuses_the_whole_batch_naming_it(url):
    client = anthropic_client(url)
    good = {"custom_id": "good", "params": params("hi")}
    cases = [
        (
            {"custom_id": "no-model", "params": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}},
            "requests.1.params.model",
        ),
        ({"custom_id": "good", "params": params("again")}, "used twice"),
        ({"custom_id": "has space", "params": params("hi")}, "custom_id"),
        ({"custom_id": "no-params"}, "requests.1.params"),
    ]
    for bad, named in cases:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.batches.create(requests=[good, bad])
        assert named in refused.value.message, refused.value.message
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.batches.create(
            requests=[{"custom_id": "x", "params": params("hi", model="nobody-serves-this")}]
        )
    assert [b async for b in client.messages.batches.list()] == []


async def test_a_request_with_bad_params_errors_alone_and_the_others_run(url):
    """Anthropic checks `params` as each request runs: a bad one is `errored`, the rest succeed."""
    client = anthropic_client(url)
    requests = [{"custom_id": f"ok-{i}", "params": params(f"Say {i}")} for i in range(3)]
    requests += [
        {"custom_id": "no-max", "params": {"model": REAL_MODEL, "messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "streams", "params": params("hi", stream=True)},
    ]
    batch = await message_batch_end(client, (await client.messages.batches.create(requests=requests)).id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (3, 2)
    found = {result.custom_id: result.result for result in await results(client, batch.id)}
    for custom_id, named in (("no-max", "max_tokens"), ("streams", "stream")):
        assert found[custom_id].type == "errored" and found[custom_id].error.error.type == "invalid_request_error"
        assert named in found[custom_id].error.error.message


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


async def test_structured_output_is_answered_as_the_live_endpoint_answers(url):
    """An item is the live request: `output_config` constrains it as it does live (it was ignored)."""
    client = anthropic_client(url)
    request = params("Name a city.", 24, output_config={"format": {"type": "json_schema", "schema": CITY}})
    batch = await client.messages.batches.create(requests=[{"custom_id": "city", "params": request}])
    await message_batch_end(client, batch.id)
    [result] = await results(client, batch.id)
    live = await client.messages.create(
        **{k: v for k, v in request.items() if k != "temperature"}, extra_body={"temperature": 0}
    )
    assert result.result.type == "succeeded", result
    message = result.result.message
    assert (message.stop_reason, message.content) == (live.stop_reason, live.content)
    assert message.content[0].text.startswith('{"city"')  # constrained (the tiny model's random weights
    # then spend the tokens on the blank space the grammar allows)


@pytest.mark.slow  # seconds of batch runs: seconds
async def test_cancelling_keeps_what_finished_and_cancels_the_rest(redis_url, tiny):
    async with (
        real_worker(redis_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(redis_url, batch_in_flight=4) as url,
    ):
        client = anthropic_client(url)
        batch = await client.messages.batches.create(
            requests=[{"custom_id": f"c{i}", "params": params(f"Count {i}", 6)} for i in range(24)]
        )

        async def some_done():
            return (await client.messages.batches.retrieve(batch.id)).request_counts.succeeded >= 2

        await poll(some_done, what="two results")
        canceling = await client.messages.batches.cancel(batch.id)
        assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
        batch = await message_batch_end(client, batch.id)
        found = await results(client, batch.id)
    counts = batch.request_counts
    assert counts.succeeded >= 2 and counts.canceled > 0 and counts.succeeded + counts.canceled + counts.errored == 24
    assert Counter(result.custom_id for result in found) == Counter(f"c{i}" for i in range(24))
    assert Counter(result.result.type for result in found) == Counter(
        {"succeeded": counts.succeeded, "canceled": counts.canceled, "errored": counts.errored}
    )


async def test_expired_requests_say_so(redis_url, tiny):
    async with (
        real_worker(redis_url, slow(tiny, 0.05), max_seqs=2),
        running_gateway(redis_url, batch_window_seconds=2.0, batch_in_flight=2) as url,
    ):
        client = anthropic_client(url)
        batch = await client.messages.batches.create(
            requests=[{"custom_id": f"e{i}", "params": params(f"List {i}", 8)} for i in range(20)]
        )
        batch = await message_batch_end(client, batch.id)
        found = await results(client, batch.id)
    assert batch.request_counts.expired > 0 and batch.request_counts.processing == 0
    assert {result.result.type for result in found} <= {"succeeded", "expired"}
    assert Counter(result.custom_id for result in found) == Counter(f"e{i}" for i in range(20))
