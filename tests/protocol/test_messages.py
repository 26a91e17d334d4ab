"""The wire format: round trips, and a clear error code for each way a message can be wrong."""

from __future__ import annotations

import msgpack
import pytest

import protocol
from protocol import ProtocolError, Reply, Request, SamplingParams


def request(**overrides) -> dict:
    data = {
        "v": 1,
        "id": "req-1",
        "model": "smollm2",
        "reply": {"kind": "pubsub", "key": "lmq:reply:g1"},
        "sampling": {"max_tokens": 8, "temperature": 0},
        "deadline": 2e9,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def refused(data: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(msgpack.packb(data))
    return info.value


def test_request_round_trip():
    original = Request(
        id="r.1:a-b_c",
        model="m",
        reply=Reply("stream", "out:r1"),
        sampling=SamplingParams(max_tokens=5, temperature=0.5, seed=3, logit_bias={7: -2.0}, stop=["\n"]),
        deadline=1234.5,
        prompt_ids=[1, 2, 3],
        truncate=True,
    )
    assert protocol.decode_request(original.encode()) == original


def test_defaults_fill_what_is_left_out():
    parsed = protocol.decode_request(msgpack.packb(request(sampling=None, deadline=None)))
    assert parsed.sampling == SamplingParams()
    assert parsed.deadline > 0
    assert parsed.truncate is False


@pytest.mark.parametrize(
    "overrides, code",
    [
        ({"v": 2}, "unsupported_version"),
        ({"v": None}, "unsupported_version"),
        ({"model": None}, "bad_request"),
        ({"prompt": "also a prompt"}, "bad_request"),
        ({"messages": None}, "bad_request"),
        ({"messages": []}, "bad_request"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "bad_request"),
        ({"messages": [{"role": "user", "content": 5}]}, "bad_request"),
        ({"messages": [{"role": "user", "content": "x" * (600 * 1024)}]}, "too_large"),
        ({"messages": None, "prompt_ids": [1, -1]}, "bad_request"),
        ({"messages": None, "prompt_ids": [True]}, "bad_request"),
        ({"sampling": {"max_tokens": 0}}, "bad_request"),
        ({"sampling": {"max_tokens": "8"}}, "bad_request"),
        ({"sampling": {"temperature": float("nan")}}, "bad_request"),
        ({"sampling": {"top_p": 1.5}}, "bad_request"),
        ({"sampling": {"stop": [""]}}, "bad_request"),
        ({"sampling": {"stop": ["x"] * 17}}, "too_large"),
        ({"sampling": {"logit_bias": {"abc": 1}}}, "bad_request"),
        ({"sampling": {"logit_bias": {"5": 1000}}}, "bad_request"),
        ({"sampling": {"logit_bias": {str(1 << 40): 1}}}, "bad_request"),
        ({"sampling": []}, "bad_request"),
        ({"deadline": "tomorrow"}, "bad_request"),
        ({"truncate": 1}, "bad_request"),
    ],
)
def test_invalid_fields_name_the_problem_and_keep_the_reply(overrides, code):
    error = refused(request(**overrides))
    assert error.code == code
    assert error.code in protocol.ERROR_CODES
    assert error.request_id == "req-1"
    assert error.reply == Reply("pubsub", "lmq:reply:g1")


@pytest.mark.parametrize("bad_id", [None, "", "has space", "x" * 129, 42, "ü"])
def test_bad_ids_are_refused_but_the_reply_is_still_read(bad_id):
    error = refused(request(id=bad_id) if bad_id is not None else {k: v for k, v in request().items() if k != "id"})
    assert error.code in ("bad_request", "too_large")
    assert error.request_id is None or error.request_id == bad_id
    assert error.reply == Reply("pubsub", "lmq:reply:g1")


@pytest.mark.parametrize("reply", [None, "lmq:reply:g1", {"kind": "email", "key": "x"}, {"kind": "stream", "key": ""}])
def test_without_a_valid_reply_there_is_no_reply_address(reply):
    error = refused(request(reply=reply) if reply is not None else {k: v for k, v in request().items() if k != "reply"})
    assert error.reply is None
    assert error.code == "bad_request"


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\xc1", "bad_request"),  # never used in msgpack
        (b"", "bad_request"),
        (msgpack.packb([1, 2]), "bad_request"),
        (msgpack.packb({1: 2}), "bad_request"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "bad_request"),
        (msgpack.packb({"x": msgpack.ExtType(5, b"p")}), "bad_request"),
        (b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1), "too_large"),
    ],
)
def test_bytes_that_are_not_a_request_map(raw, code):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(raw)
    assert info.value.code == code


def test_events_and_batches_round_trip():
    events = [
        protocol.delta_event("r1", 0, "Hé", [1, 2], 0),
        protocol.done_event("r1", 1, "length", 5, 2, 0),
        protocol.error_event("r2", 0, "timeout", "deadline passed"),
    ]
    assert protocol.decode_event_batch(protocol.encode_event_batch(events)) == events
    assert [protocol.decode_event(protocol.encode(e)) for e in events] == events


def test_cancel_and_heartbeat_round_trip():
    assert protocol.decode_cancel(protocol.cancel_message("r-9")) == protocol.Cancel("r-9", None)
    beat = protocol.Heartbeat("w1", "m", 8, 2, 1, 10, 100, 5.0)
    assert protocol.Heartbeat.decode(beat.encode()) == beat
    with pytest.raises(ProtocolError):
        protocol.decode_cancel(protocol.encode({"v": 1, "id": "no spaces allowed"}))


def test_a_cancel_token_travels_as_its_digest_and_a_request_names_the_digest():
    token = "t" * 32
    assert protocol.decode_cancel(protocol.cancel_message("r-9", token)) == protocol.Cancel(
        "r-9", protocol.cancel_digest(token)
    )
    with pytest.raises(ProtocolError, match="token: must be at least 16"):
        protocol.decode_cancel(protocol.cancel_message("r-9", "short"))
    with pytest.raises(ProtocolError, match="token"):
        protocol.decode_cancel(protocol.encode({"v": 1, "id": "r-9", "token": 7}))
    digest = protocol.cancel_digest(token)
    assert protocol.decode_request(msgpack.packb(request(cancel_digest=digest))).cancel_digest == digest
    assert protocol.decode_request(msgpack.packb(request())).cancel_digest is None
    with pytest.raises(ProtocolError, match="cancel_digest"):
        protocol.decode_request(msgpack.packb(request(cancel_digest="ABC")))


def test_logit_bias_may_have_integer_keys_as_python_writes_them():
    parsed = protocol.decode_request(msgpack.packb(request(sampling={"logit_bias": {50: 1.5, "7": -2}})))
    assert parsed.sampling.logit_bias == {50: 1.5, 7: -2.0}


def test_an_oversize_message_is_refused_but_its_reply_address_is_read():
    error = refused(request(prompt="x" * protocol.MAX_MESSAGE_BYTES, messages=None))
    assert error.code == "too_large"
    assert (error.request_id, error.reply) == ("req-1", Reply("pubsub", "lmq:reply:g1"))


# ---------------------------------------------------------------- what a foreign producer may write


@pytest.mark.parametrize(
    "key",
    [
        "lmq:req:smollm2",
        "lmq:{T0}:req:smollm2",
        "lmq:progress:r1",
        "lmq:worker:w1",
        "lmq:dead",
        "lmq:batch:batch_1",
        "lmq:test:out",
        "lmq:reply:",
    ],
)
def test_a_reply_key_in_lmqs_own_namespace_is_refused(key):
    for kind in ("pubsub", "spubsub", "stream"):
        error = refused(request(reply={"kind": kind, "key": key}))
        assert error.code == "reply_denied" and "reply.key" in error.message
        assert error.reply is None  # no event may go there


@pytest.mark.parametrize(
    "key",
    [
        "out:r1",
        "myapp:reply:1",
        "lmq:reply:g1",
        "lmq:reply:myapp:r1",
        "lmq:{T0}:reply:g1",
        "lmq:batch:batch_ab12:reply:3.0",
        "lmq:{T1}:batch:msgbatch_9:reply:0.2",
    ],
)
def test_reply_keys_outside_lmq_or_in_its_reply_forms_are_accepted(key):
    assert protocol.decode_request(msgpack.packb(request(reply={"kind": "stream", "key": key}))).reply.key == key


def test_an_oversize_message_is_not_unpacked_beyond_its_address(monkeypatch):
    """Only `id` and `reply` are read from an entry over the limit: a 16 MiB list is skipped, not built."""
    calls = []
    real = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    error = refused(request(prompt_ids=list(range(4 << 20)), messages=None))
    assert error.code == "too_large" and (error.request_id, error.reply) == ("req-1", Reply("pubsub", "lmq:reply:g1"))
    assert calls == []


def test_an_oversize_message_with_a_huge_id_or_reply_gives_no_address():
    error = refused(request(id="x" * (2 << 20)))
    assert error.code == "too_large" and error.request_id is None


GOOD_BEAT = {
    "v": 1,
    "worker_id": "w1",
    "model": "m",
    "capacity": 4,
    "running": 0,
    "waiting": 0,
    "kv_pages_used": 1,
    "kv_pages_total": 8,
    "time": 1.5,
}


@pytest.mark.parametrize(
    "change",
    [
        {"model": ["m"]},
        {"model": None},
        {"worker_id": 7},
        {"capacity": "4"},
        {"running": -1},
        {"time": "now"},
        {"time": True},
        {"waiting": 1.5},
        {"extra": 1},
        {"v": 2},
    ],
    ids=[
        "model-list",
        "model-nil",
        "id-int",
        "capacity-str",
        "running-negative",
        "time-str",
        "time-bool",
        "waiting-float",
        "unknown-field",
        "version",
    ],
)
def test_a_heartbeat_with_a_wrong_field_is_refused(change):
    with pytest.raises(ProtocolError):
        protocol.Heartbeat.decode(msgpack.packb({**GOOD_BEAT, **change}))


def test_a_heartbeat_missing_a_field_is_refused():
    with pytest.raises(ProtocolError):
        protocol.Heartbeat.decode(msgpack.packb({k: v for k, v in GOOD_BEAT.items() if k != "capacity"}))
    assert protocol.Heartbeat.decode(msgpack.packb(GOOD_BEAT)).model == "m"


def test_thinking_fields_are_optional_and_checked_by_name():
    parsed = protocol.parse_request(request(reasoning_budget=0, template_kwargs={"enable_thinking": False, "x": [1]}))
    assert (parsed.reasoning_budget, parsed.template_kwargs) == (0, {"enable_thinking": False, "x": [1]})
    assert protocol.parse_request(request()).reasoning_budget is None  # an older producer's request
    for bad, field in [
        ({"reasoning_budget": -1}, "reasoning_budget"),
        ({"template_kwargs": []}, "template_kwargs"),
        ({"template_kwargs": {"tools": []}}, "template_kwargs.tools"),  # the worker sets it
        ({"template_kwargs": {"_secret": 1}}, "template_kwargs"),
        ({"template_kwargs": {"x": b"bytes"}}, "template_kwargs.x"),
    ]:
        with pytest.raises(ProtocolError, match=field) as error:
            protocol.parse_request(request(**bad))
        assert error.value.code == "bad_request"


def test_a_started_event_says_how_the_answer_thinks():
    tags = {"start": "<think>", "end": "</think>", "open": True}
    assert protocol.started_event("r", 0, 5, tags)["reasoning"] == tags
    assert "reasoning" not in protocol.started_event("r", 0, 5)
