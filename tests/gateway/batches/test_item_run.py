"""How one batch item's run folds its reply stream when Redis lost some of it (gateway/batches/item_run.py):
a hole is asked for and filled in order, what the run has is dropped by `seq`, and only a hole no
worker fills within the resume bound (or one the worker can no longer fill) is a loss."""

from __future__ import annotations

import protocol
from gateway.batches.item_run import Ended, ItemRun
from gateway.resume import StreamOrder
from protocol.resume import resumed_event

WORDS = ["one", " two", " three", " four", " five"]


def run(resume_s: float = 15.0) -> ItemRun:
    return ItemRun(0, 1, "lmq:req-batch:tiny", "1-0", "reply", "batch.0.1", order=StreamOrder(resume_s))


def events() -> list[dict]:
    """started, a delta a word, done: seq 0 .. 6."""
    deltas = [protocol.delta_event("batch.0.1", i + 1, word, [10 + i], i) for i, word in enumerate(WORDS)]
    done = protocol.done_event("batch.0.1", len(WORDS) + 1, "length", 3, len(WORDS), 0)
    return [protocol.started_event("batch.0.1", 0, 3), *deltas, done]


def feed(item: ItemRun, stream: list[dict]) -> Ended | None:
    for event in stream:
        ended = item.feed(event)
        if ended is not None:
            return ended
    return None


def test_a_hole_is_asked_for_and_filled_in_order_by_the_workers_resend():
    item, sent = run(), events()
    # Lost: seq 2 and 3. The worker went on (seq 4, 5), then sent again what followed seq 1, then `resumed`.
    stream = sent[:2] + sent[4:6] + sent[2:6] + [resumed_event("batch.0.1", 5, 5)] + sent[6:]
    assert feed(item, stream[:4]) is None
    assert item.order.due_ask() and (item.order.last_seq, item.tokens) == (1, 1)  # ask for what follows seq 1
    assert not item.order.due_ask()  # asked: again only after RETRY_S
    ended = feed(item, stream[4:])
    assert ended is not None and ended.how == "done" and not item.resuming
    assert item.answer["text"] == "".join(WORDS)


def test_events_read_again_after_a_reconnect_are_dropped_by_seq():
    item, sent = run(), events()
    assert feed(item, sent[:4]) is None
    item.order.lost_touch()
    item.reconnected()  # connected again: the stream read from its start
    ended = feed(item, sent[:4] + sent[4:])
    assert ended is not None and ended.how == "done" and item.answer["text"] == "".join(WORDS)


def test_a_hole_no_worker_fills_within_the_bound_is_lost_and_a_quiet_resume_is_not():
    holed, sent = run(resume_s=0.0), events()
    assert feed(holed, sent[:2] + sent[4:]) is None  # the hole's events, and the done after it, held back
    assert holed.resume_expired() == Ended("lost")
    quiet = run(resume_s=0.0)
    feed(quiet, sent[:3])
    quiet.order.lost_touch()
    quiet.reconnected()
    assert quiet.resume_expired() is None and not quiet.resuming  # nothing lost that it knows of: reads on
    assert feed(quiet, sent[3:]).how == "done" and quiet.answer["text"] == "".join(WORDS)


def test_a_gap_the_worker_no_longer_keeps_is_lost_so_the_item_runs_again():
    item, sent = run(), events()
    feed(item, sent[:2] + sent[4:5])
    unavailable = protocol.error_event("batch.0.1", 7, "unavailable", "no longer kept")
    assert item.feed(unavailable) == Ended("lost")
