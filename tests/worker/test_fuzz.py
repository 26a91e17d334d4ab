"""Property: whatever a producer XADDs, a running worker acknowledges it, answers where it can, and keeps serving."""

from __future__ import annotations

import asyncio
import itertools
import pathlib
import threading
import time

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP, ProtocolError
from tests.support.tiny_model import make_tiny_model
from tests.support.worker_harness import MODEL, STREAM, TIMEOUT_S, chat_request, worker_config
from worker.model.loader import load_model
from worker.service import run_worker

REQUEST_FIELDS = ["v", "id", "model", "reply", "sampling", "deadline", "messages", "prompt", "prompt_ids", "truncate"]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
entry_fields = st.dictionaries(
    st.sampled_from([b"msg", b"id", b"x"]) | st.binary(min_size=1, max_size=8),
    st.binary(max_size=64),
    min_size=1,
    max_size=3,
)
mutations = st.dictionaries(st.sampled_from(REQUEST_FIELDS), values, max_size=3)
_reply_numbers = itertools.count()


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory, redis_server):
    """One worker on the session's Redis, in a thread with its own event loop, for the whole module."""
    tiny = load_model(
        str(make_tiny_model(pathlib.Path(tmp_path_factory.mktemp("tiny")))), dtype="float32", quant="none", device="cpu"
    )
    redis.Redis.from_url(redis_server.url).flushall()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    # A daemon thread: should the worker never stop, the test fails below and the process can still exit.
    worker = run_worker(worker_config(redis_server.url, "fuzzed"), model=tiny, stop=stop)
    thread = threading.Thread(target=loop.run_until_complete, args=(worker,), name="fuzzed-worker", daemon=True)
    thread.start()
    client = redis.Redis.from_url(redis_server.url)
    _wait(lambda: client.exists(protocol.worker_key("fuzzed")) or not thread.is_alive())
    assert thread.is_alive(), "the worker thread ended at start"
    yield redis_server.url
    loop.call_soon_threadsafe(stop.set)
    thread.join(TIMEOUT_S)
    client.close()
    assert not thread.is_alive(), f"the worker did not stop within {TIMEOUT_S} s of its stop event"
    loop.close()


def _wait(check, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(0.005)


def _process(client: redis.Redis, fields: dict) -> int:
    """XADD an entry, wait until the worker acknowledged it; return how many dead letters it added."""
    dead_before = client.xlen(DEAD_LETTER_STREAM)
    client.xadd(STREAM, fields)
    _wait(lambda: client.xlen(STREAM) == 0 and client.xpending(STREAM, REQUEST_GROUP)["pending"] == 0)
    return client.xlen(DEAD_LETTER_STREAM) - dead_before


def _expected_error(raw: bytes | None) -> ProtocolError | None:
    try:
        protocol.decode_request(raw if raw is not None else b"")
    except ProtocolError as exc:
        return exc
    return None


def _check_answer(client: redis.Redis, raw: bytes | None, dead_letters: int) -> None:
    error = _expected_error(raw)
    if error is not None:
        assert dead_letters == 1
        if error.reply is not None and error.reply.kind == "stream":
            last = protocol.decode_event(client.xrevrange(error.reply.key, count=1)[0][1][b"msg"])
            assert (last["type"], last["code"]) == ("error", error.code)
        return
    request = protocol.decode_request(raw)
    if request.reply.kind == "stream" and request.model == MODEL:
        last = protocol.decode_event(client.xrevrange(request.reply.key, count=1)[0][1][b"msg"])
        assert last["type"] in ("done", "error")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(entry_fields)
def test_random_entries(worker_url, fields):
    client = redis.Redis.from_url(worker_url)
    dead_letters = _process(client, fields)
    _check_answer(client, fields.get(b"msg"), dead_letters)
    client.close()


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutations)
def test_mutated_requests(worker_url, changes):
    client = redis.Redis.from_url(worker_url)
    base = chat_request(f"fz{next(_reply_numbers)}", max_tokens=3).to_dict()
    raw = msgpack.packb({**base, **changes}, use_bin_type=True)
    dead_letters = _process(client, {"msg": raw})
    _check_answer(client, raw, dead_letters)
    client.delete(base["reply"]["key"])
    client.close()


def test_the_worker_still_serves_after_the_fuzzing(worker_url):
    client = redis.Redis.from_url(worker_url)
    client.xadd(STREAM, {"msg": chat_request("after-fuzz", max_tokens=3).encode()})
    _wait(lambda: client.xlen("out:after-fuzz") >= 4)
    last = protocol.decode_event(client.xrevrange("out:after-fuzz", count=1)[0][1][b"msg"])
    assert last["type"] == "done"
    client.close()
