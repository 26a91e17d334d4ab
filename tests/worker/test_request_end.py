"""The one place a worker's request ends (worker/tracking.py: `RequestTable.end` and `_close`), on a
real worker over a real Redis.

Whatever ends a running request (its producer's cancel, its deadline, another worker taking its
entry, its reply refused, a failed step), it ends once: its pages are freed, its outcome is counted
once, and while its entry is ours it gets exactly one final event and its claim is released (the
entry acknowledged and deleted, its progress and holder keys gone); once the entry is not ours it
gets no final event from this worker and the claim stays with its owner.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import protocol
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP, holder_key, progress_key
from tests.support.worker_harness import (
    STREAM,
    chat_request,
    enqueue,
    reply_events,
    running_worker,
    streamed_tokens,
    wait_for,
    worker_config,
)
from tests.support.worker_process import SlowModel
from worker.claims import EntryRef
from worker.tracking import Ending

STEP_S = 0.05  # 200 tokens take 10 s: every end below comes long before the model's own


class FailingModel(SlowModel):
    """Slow steps, and every step from the `fail_at`-th on raises."""

    def __init__(self, inner, step_seconds: float, fail_at: int):
        super().__init__(inner, step_seconds)
        self.fail_at = fail_at
        self.steps = 0

    def forward(self, batch, kv):
        self.steps += 1
        if self.steps >= self.fail_at:
            raise RuntimeError("the accelerator fell over")
        return super().forward(batch, kv)


async def _cancel(worker, redis, request_id: str, entry_id: str) -> None:
    await redis.publish(protocol.CANCEL_CHANNEL, protocol.cancel_message(request_id))


async def _time_out(worker, redis, request_id: str, entry_id: str) -> None:
    worker.table.time_out_overdue(time.time() + 3600)  # as the keep loop does, an hour later


async def _take_over(worker, redis, request_id: str, entry_id: str) -> None:
    await redis.xclaim(STREAM, REQUEST_GROUP, "thief", 0, [entry_id])  # the keep loop or the next write sees it


async def _nothing(worker, redis, request_id: str, entry_id: str) -> None:
    """The model fails a step, or the reply is refused at the first write: no trigger needed."""


# reason: (trigger, its model fails at step N (0: never), reply kind, final event (type, finish reason or code) or None, outcome)
ENDS = {
    "cancel": (_cancel, 0, "stream", ("done", "cancelled"), "cancelled"),
    "timeout": (_time_out, 0, "stream", ("error", "timeout"), "timeout"),
    "error": (_nothing, 4, "stream", ("error", "internal"), "internal"),
    "takeover": (_take_over, 0, "stream", None, "dropped"),
    "refused": (_nothing, 0, "refused", None, "dropped"),
}


@pytest.mark.parametrize("reason", list(ENDS))
async def test_every_reason_ends_a_running_request_once(reason, tiny, redis_url, redis_client):
    trigger, fail_at, reply_kind, final, outcome = ENDS[reason]
    inner = FailingModel(tiny.model, STEP_S, fail_at) if fail_at else SlowModel(tiny.model, STEP_S)
    model = dataclasses.replace(tiny, model=inner)
    request = chat_request("victim", max_tokens=200)
    if reply_kind == "refused":
        await redis_client.set("out:victim", "not a stream")  # every XADD to it fails: the reply is denied
    async with running_worker(worker_config(redis_url, "w1", claim_idle_ms=60_000), model) as worker:
        entry_id = await enqueue(redis_client, request)
        if reply_kind == "stream":
            await wait_for(lambda: _streamed(redis_client, "out:victim"), what="a first delta")
        else:
            await wait_for(lambda: redis_client.xlen(DEAD_LETTER_STREAM), what="the refused reply's dead letter")
        await trigger(worker, redis_client, "victim", entry_id)
        await wait_for(lambda: _ended(worker, "victim"), what="the request to end and its pages to be freed")
        await worker.publisher.flush()
        outcomes = _outcomes(worker)
        events = await reply_events(redis_client, "out:victim") if reply_kind == "stream" else []
        pending = await redis_client.xpending_range(STREAM, REQUEST_GROUP, min="-", max="+", count=10)
        kept = {key: await redis_client.exists(key) for key in (progress_key("victim"), holder_key("victim"))}
    assert outcomes == {outcome: 1}
    finals = [(e["type"], e.get("finish_reason") or e.get("code")) for e in events if e["type"] in ("done", "error")]
    if final is not None:
        assert finals == [final] and events[-1]["type"] == final[0]
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert pending == [] and await redis_client.xlen(STREAM) == 0
        assert kept == {progress_key("victim"): 0, holder_key("victim"): 0}
    elif reason == "takeover":
        assert finals == []
        assert [item["consumer"] for item in pending] == [b"thief"] and await redis_client.xlen(STREAM) == 1
    else:  # refused: the script acknowledged and dead-lettered the entry
        assert pending == [] and await redis_client.xlen(STREAM) == 0
        assert [fields[b"code"] for _, fields in await redis_client.xrange(DEAD_LETTER_STREAM)] == [b"reply_denied"]


async def test_a_second_reason_does_not_end_a_request_again(tiny, redis_url, redis_client):
    """A cancel, then a timeout before the engine confirmed the stop: the first reason is the one told."""
    model = dataclasses.replace(tiny, model=SlowModel(tiny.model, STEP_S))
    async with running_worker(worker_config(redis_url, "w1", claim_idle_ms=60_000), model) as worker:
        await enqueue(redis_client, chat_request("twice", max_tokens=200))
        await wait_for(lambda: _streamed(redis_client, "out:twice"), what="a first delta")
        worker.table.end("twice", Ending.CANCELLED)
        worker.table.end("twice", Ending.TIMEOUT)
        await wait_for(lambda: _ended(worker, "twice"), what="the request to end")
        await worker.publisher.flush()
        outcomes = _outcomes(worker)
        events = await reply_events(redis_client, "out:twice")
    assert outcomes == {"cancelled": 1}
    assert [(e["type"], e.get("finish_reason")) for e in events if e["type"] in ("done", "error")] == [
        ("done", "cancelled")
    ]


async def test_losing_the_entry_overrides_a_cancel_still_waiting_for_the_engine(tiny, redis_url, redis_client):
    """Cancelled, then its entry lost before the engine confirmed: nobody is left to tell, nothing is written."""
    model = dataclasses.replace(tiny, model=SlowModel(tiny.model, STEP_S))
    async with running_worker(worker_config(redis_url, "w1", claim_idle_ms=60_000), model) as worker:
        entry_id = await enqueue(redis_client, chat_request("lost", max_tokens=200))
        await wait_for(lambda: _streamed(redis_client, "out:lost"), what="a first delta")
        worker.table.end("lost", Ending.CANCELLED)
        worker.table.refused(EntryRef("interactive", entry_id), "lost")
        await wait_for(lambda: _ended(worker, "lost"), what="the request to end")
        await worker.publisher.flush()
        outcomes = _outcomes(worker)
        events = await reply_events(redis_client, "out:lost")
    assert outcomes == {"dropped": 1}
    assert [e for e in events if e["type"] in ("done", "error")] == []


async def _streamed(redis, reply_key: str) -> bool:
    return bool(streamed_tokens(await reply_events(redis, reply_key)))


async def _ended(worker, request_id: str) -> bool:
    stats = worker.engine.stats
    return request_id not in worker.table.running and stats.running == stats.waiting == stats.kv_pages_used == 0


def _outcomes(worker) -> dict[str, float]:
    """The worker's lmq_requests_finished_total, by outcome (those counted at least once)."""
    return {
        sample.labels["outcome"]: sample.value
        for metric in worker.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "lmq_requests_finished_total" and sample.value
    }
