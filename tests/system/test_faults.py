"""Faults the queue must survive (../shared/DESIGN.md), injected into real processes.

Each test breaks something in a running system (a Redis server, `lmq gateway` processes, worker
processes on the tiny model with slowed steps, all from tests/support/process_stack.py) and states what
the client must see, what must be left in Redis, and that every gateway and worker process not
deliberately killed is still alive. The promise to a client: its whole answer exactly once, or
an error it can see; never a silent gap, a duplicate, or a hang. The expected answers come from
an undisturbed run of the engine in this process (float32 greedy: the same in any batch).

Stacks are shared between tests of the same kind and rebuilt when a test leaves one broken, so
one failing case does not fail the next. `LMQ_TEST_FAULTS_KIND` (redis6 or valkey9, default
valkey9) picks the server of the cases that do not name one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid

import msgpack
import pytest
import redis
from redis.exceptions import NoPermissionError

import protocol
from protocol import DEAD_LETTER_STREAM, REQUEST_GROUP, progress_key
from tests.support.process_stack import (
    CLAIM_IDLE_MS,
    CLIENT_TIMEOUT_S,
    MAX_TOKENS,
    STREAM,
    ChatStream,
    PromptPool,
    Stack,
    StackSpec,
    assert_contiguous,
    client_session,
    delta_tokens,
    eventually,
    expected_answers,
    foreign_request,
    stream_all,
    streaming,
)
from worker.publisher import DEAD_LETTER_PREFIX_BYTES

MAIN_KIND = os.environ.get("LMQ_TEST_FAULTS_KIND", "valkey9")
MAIN = StackSpec(MAIN_KIND, workers=2, gateways=2)
CLAIM_S = CLAIM_IDLE_MS / 1000
ENDS = ("done", "error")

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):
    """`await use(stacks, spec)` gives a prepared stack; one at a time runs (the previous one is
    closed when another spec is asked for), all are closed at the end of the module."""
    current: dict[StackSpec, Stack] = {}

    def get(spec: StackSpec) -> Stack:
        if spec not in current:
            for other in list(current):
                current.pop(other).close()
            current[spec] = Stack(spec, tmp_path_factory.mktemp(spec.name), tiny_model_dir)
        return current[spec]

    yield get
    for stack in current.values():
        stack.close()


@pytest.fixture(scope="module")
async def pool(tiny) -> PromptPool:
    return await PromptPool.build(tiny)


async def use(stacks, spec: StackSpec) -> Stack:
    stack = stacks(spec)
    await stack.prepare()
    return stack


async def finished(tasks: list[asyncio.Task]) -> None:
    """Wait for client tasks (each bounded by its own timeout)."""
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), CLIENT_TIMEOUT_S + 10)


def reply_ended(stack: Stack, key: str) -> list[tuple[str, dict]] | None:
    events = stack.reply_events(key)
    return events if any(event.get("type") in ENDS for _, event in events) else None


def deltas_on(stack: Stack, key: str) -> int:
    return sum(1 for _, event in stack.reply_events(key) if event.get("type") == "delta")


def nothing_left(stack: Stack) -> bool:
    return not stack.pending() and stack.admin.xlen(STREAM) == 0


async def assert_nothing_left(stack: Stack, timeout: float = 5.0) -> None:
    def check():
        return nothing_left(stack)

    try:
        await eventually(check, "an empty request stream with nothing pending", timeout, stack)
    except AssertionError as exc:
        raise AssertionError(
            f"left in {STREAM}: pending={stack.pending()} xlen={stack.admin.xlen(STREAM)}\n{exc}"
        ) from None


# ---------------------------------------------------------------- 1. worker SIGKILL mid-stream


async def test_worker_killed_mid_stream_every_stream_ends_with_the_exact_answer(stacks, pool):
    stack = await use(stacks, MAIN)
    # Answers that show text as they go, and ones whose bytes are no UTF-8 (the detokenizer's
    # state must survive the takeover: such text is held back, then sent whole, exactly once).
    flowing = pool.take(5)
    expected = {**flowing, **pool.held_back}
    prompts = list(expected)
    async with client_session() as session:
        streams = [ChatStream(stack.urls[i % len(stack.urls)], prompt) for i, prompt in enumerate(prompts)]
        tasks = [asyncio.create_task(s.run(session)) for s in streams]
        try:
            await streaming(stack, [s for s in streams if s.prompt in flowing], tasks[: len(flowing)], 3)
            holders = stack.holders()
            by_request = stack.holder_by_request()
            held_back_holders = [by_request.get(s.request_id) for s in streams if s.prompt in pool.held_back]
            # The worker of a held-back answer if there is one, else the busiest.
            victim = next((name for name in held_back_holders if name), None) or max(
                stack.workers, key=lambda name: holders.get(name, 0)
            )
            survivor = next(name for name in stack.workers if name != victim)
            assert holders.get(victim), f"no worker holds an entry: {holders}"
            stack.kill_worker(victim)
        finally:
            await finished(tasks)

    taken_over = [s.prompt for s in streams if by_request.get(s.request_id) == victim]
    context = f"killed {victim} holding {holders[victim]} of {len(prompts)} entries: {taken_over}\n{stack.log_tails()}"
    print(f"taken over from {victim}: {taken_over} (held back: {[p for p in taken_over if p in pool.held_back]})")
    for stream in streams:
        stream.assert_exact(expected[stream.prompt].text, context)
    await assert_nothing_left(stack)
    stack.assert_alive([survivor, *stack.gateways])


# ---------------------------------------------------------------- 2. worker stalled past the claim time


async def test_worker_stalled_past_the_claim_time_then_woken_leaves_the_entry_to_the_other(stacks, pool):
    stack = await use(stacks, MAIN)
    tag = uuid.uuid4().hex[:8]
    expected = pool.take(4)
    http_prompts, foreign_prompts = list(expected)[:2], list(expected)[2:]
    foreign = {f"stall-{tag}-{i}": prompt for i, prompt in enumerate(foreign_prompts)}
    reply_key = {request_id: f"lmq:reply:test:{request_id}" for request_id in foreign}

    async with client_session() as session:
        streams = [ChatStream(stack.urls[i % len(stack.urls)], prompt) for i, prompt in enumerate(http_prompts)]
        tasks = [asyncio.create_task(s.run(session)) for s in streams]
        taken_back: list[dict] = []
        try:
            foreign_entries = [
                stack.admin.xadd(
                    STREAM, {"msg": msgpack.packb(foreign_request(request_id, prompt, reply_key[request_id]))}
                )
                for request_id, prompt in foreign.items()
            ]
            await streaming(
                stack, streams, tasks, 3, lambda: all(deltas_on(stack, key) >= 3 for key in reply_key.values())
            )
            # Stall the worker of the first reply-stream request, whose every event the test reads.
            victim = next(
                entry["consumer"].decode() for entry in stack.pending() if entry["message_id"] == foreign_entries[0]
            )
            other = next(name for name in stack.workers if name != victim)
            stalled = {entry["message_id"] for entry in stack.pending() if entry["consumer"].decode() == victim}

            stack.signal(victim, signal.SIGSTOP)
            try:
                await eventually(
                    lambda: victim not in stack.holders(),
                    f"{other} to claim the entries of the stalled {victim}",
                    10 * CLAIM_S + 5,
                    stack,
                )
                await asyncio.sleep(0.5)  # the other worker streams on for a while
            finally:
                stack.signal(victim, signal.SIGCONT)
            # Until every stream ended (and a little longer): the woken worker must not take an entry back.
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while (
                not all(t.done() for t in tasks) or not all(reply_ended(stack, key) for key in reply_key.values())
            ) and time.monotonic() < deadline:
                taken_back += [
                    entry
                    for entry in stack.pending()
                    if entry["message_id"] in stalled and entry["consumer"].decode() == victim
                ]
                await asyncio.sleep(0.05)
            settle = time.monotonic() + 1.5 * CLAIM_S + 1  # what the woken worker would still write
            while time.monotonic() < settle:
                taken_back += [
                    entry
                    for entry in stack.pending()
                    if entry["message_id"] in stalled and entry["consumer"].decode() == victim
                ]
                await asyncio.sleep(0.1)
        finally:
            await finished(tasks)

    context = f"stalled {victim} (SIGSTOP) holding {len(stalled)} entries, {other} took over\n{stack.log_tails()}"
    for stream in streams:
        stream.assert_exact(expected[stream.prompt].text, context)
    for request_id, prompt in foreign.items():
        events = [event for _, event in stack.reply_events(reply_key[request_id])]
        assert_contiguous(events, f"{request_id} (reply stream)\n{context}")
        assert delta_tokens(events) == expected[prompt].token_ids, (
            f"{request_id}: tokens published (duplicates included) differ from the answer\n{context}"
        )
        text = "".join(event["text"] for event in events if event.get("type") == "delta")
        assert text == expected[prompt].text, f"{request_id}: text {text!r}, want {expected[prompt].text!r}\n{context}"
        assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS, (
            f"{request_id}: {events[-1]}\n{context}"
        )
    assert not taken_back, f"the woken {victim} took entries back: {taken_back[:3]}\n{context}"
    await assert_nothing_left(stack)
    await eventually(lambda: stack.heartbeating([victim, other]), "both workers heartbeating after the stall", 5, stack)
    stack.assert_alive()


# ---------------------------------------------------------------- 8. duplicate request id


@pytest.mark.parametrize("timing", ["back-to-back", "while-the-first-runs"])
async def test_duplicate_request_id_never_interleaves(stacks, pool, timing):
    """Two entries with one id: the first runs; the second gets `duplicate_id` or runs after the
    first has finished. Back to back, one worker usually reads both; enqueued while the first
    runs, the second usually goes to the OTHER worker, so the rule then holds across workers
    (stricter than docs/protocol.md's "already running on the worker": two runs of one id share
    `lmq:progress:<id>`, which a takeover of either would read)."""
    stack = await use(stacks, MAIN)
    request_id = f"dup-{uuid.uuid4().hex[:8]}"
    expected = pool.take(2)
    prompts = list(expected)
    keys = [f"lmq:reply:test:{request_id}-a", f"lmq:reply:test:{request_id}-b"]
    first, second = (msgpack.packb(foreign_request(request_id, prompt, key)) for prompt, key in zip(prompts, keys))
    if timing == "back-to-back":
        with stack.admin.pipeline(transaction=True) as pipe:
            pipe.xadd(STREAM, {"msg": first})
            pipe.xadd(STREAM, {"msg": second})
            pipe.execute()
    else:
        stack.admin.xadd(STREAM, {"msg": first})
        await eventually(lambda: deltas_on(stack, keys[0]) >= 2, "the first to stream", 20, stack)
        stack.admin.xadd(STREAM, {"msg": second})

    await eventually(lambda: reply_ended(stack, keys[0]), "the end of the first", 30, stack)
    await eventually(lambda: reply_ended(stack, keys[1]), "the end of the second", 30, stack)
    await asyncio.sleep(0.5)  # anything published late shows up too
    a, b = stack.reply_events(keys[0]), stack.reply_events(keys[1])
    context = f"first: {_timeline(a)}\nsecond: {_timeline(b)}\n{stack.log_tails()}"

    first_events = [e for _, e in a]
    assert_contiguous(first_events, f"first\n{context}")
    assert delta_tokens(first_events) == expected[prompts[0]].token_ids and first_events[-1]["type"] == "done", (
        f"the first must run\n{context}"
    )
    second_events = [e for _, e in b]
    assert_contiguous(second_events, f"second\n{context}")
    if second_events[-1]["type"] == "error":
        assert second_events[-1]["code"] == "duplicate_id" and not delta_tokens(second_events), (
            f"the second: only a duplicate_id error\n{context}"
        )
        assert any(fields[b"code"] == b"duplicate_id" for fields in stack.dead_letters()), (
            f"duplicate_id is dead-lettered\n{stack.dead_letters()}"
        )
    else:
        assert delta_tokens(second_events) == expected[prompts[1]].token_ids, (
            f"the second, run after the first: its own whole answer\n{context}"
        )
        first_done_at = next(entry_id for entry_id, e in a if e["type"] == "done")
        second_starts_at = b[0][0]
        assert _stream_id(second_starts_at) > _stream_id(first_done_at), (
            f"the second ran while the first was running\n{context}"
        )
    await assert_nothing_left(stack)
    assert not stack.admin.exists(progress_key(request_id)), "the progress list outlived both requests"
    stack.assert_alive()


def _timeline(events: list[tuple[str, dict]]) -> str:
    """A reply stream in short: its deltas' span (entry ids, offsets), then its end."""
    deltas = [(entry_id, e) for entry_id, e in events if e.get("type") == "delta"]
    ends = [
        (entry_id, e.get("type"), e.get("finish_reason") or e.get("code"))
        for entry_id, e in events
        if e.get("type") in ENDS
    ]
    if not deltas:
        return f"no deltas, end {ends}"
    return f"{len(deltas)} deltas from {deltas[0][0]} (offset {deltas[0][1]['offset']}) to {deltas[-1][0]} (offset {deltas[-1][1]['offset']}), end {ends}"


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


# ---------------------------------------------------------------- 6. poison entries


async def test_poison_entries_are_dead_lettered_and_acknowledged(stacks, tiny, pool):
    stack = await use(stacks, MAIN)
    tag = uuid.uuid4().hex[:8]

    def reply(name: str) -> str:
        return f"lmq:reply:test:{tag}-{name}"

    def valid(name: str, **changes) -> dict:
        return {**foreign_request(f"poison-{tag}-{name}", f"Poison {name}", reply(name)), **changes}

    missing = {"v": 1, "id": f"poison-{tag}-missing", "reply": {"kind": "stream", "key": reply("missing")}}
    oversize = valid("oversize", messages=[{"role": "user", "content": "x" * ((1 << 20) + 1000)}])
    poison = {  # name: (fields, dead-letter code, reply key an error event must reach or None)
        "random-bytes": ({"msg": b"\xc1" + random.Random(6).randbytes(300)}, "bad_request", None),
        "missing-fields": ({"msg": msgpack.packb(missing)}, "bad_request", reply("missing")),
        "wrong-version": ({"msg": msgpack.packb(valid("v99", v=99))}, "unsupported_version", reply("v99")),
        "oversize": ({"msg": msgpack.packb(oversize)}, "too_large", None),
        "no-msg-field": ({"body": b"not a request"}, "bad_request", None),
    }
    assert len(poison["oversize"][0]["msg"]) > protocol.MAX_MESSAGE_BYTES
    bias_prompt = "Poison int-keys: logit_bias written by Python"
    int_keys = valid("int-keys", messages=[{"role": "user", "content": bias_prompt}])
    int_keys["sampling"]["logit_bias"] = {50: 1.0, 51: -2.0}  # msgpack map with INTEGER keys
    expected = await expected_answers(tiny, [bias_prompt], logit_bias={50: 1.0, 51: -2.0})

    with stack.admin.pipeline(transaction=False) as pipe:
        for fields, _, _ in poison.values():
            pipe.xadd(STREAM, fields)
        pipe.xadd(STREAM, {"msg": msgpack.packb(int_keys)})
        pipe.execute()

    await eventually(
        lambda: reply_ended(stack, reply("int-keys")) and len(stack.dead_letters()) >= len(poison),
        "the valid request's end and the dead letters",
        20,
        stack,
    )
    await asyncio.sleep(0.3)
    context = stack.log_tails()
    letters = stack.dead_letters()
    problems = []
    for name, (fields, code, reply_key) in poison.items():
        raw = fields.get("msg", b"")[:DEAD_LETTER_PREFIX_BYTES]  # a dead letter keeps a bounded prefix
        matching = [letter for letter in letters if letter.get(b"msg") == raw]
        if len(matching) != 1:
            problems.append(f"{name}: {len(matching)} dead letters with its bytes (want 1)")
        elif matching[0].get(b"code", b"").decode() != code:
            problems.append(f"{name}: dead-letter code {matching[0].get(b'code')!r}, want {code!r}")
        if reply_key is not None:
            events = [event for _, event in stack.reply_events(reply_key)]
            if [(e.get("type"), e.get("code")) for e in events] != [("error", code)]:
                problems.append(
                    f"{name}: events on its reply key {[(e.get('type'), e.get('code'), e.get('message')) for e in events]}, want one error {code!r}"
                )
    bias_events = [event for _, event in stack.reply_events(reply("int-keys"))]
    if not bias_events or bias_events[-1].get("type") != "done":
        problems.append(f"int-keys logit_bias (valid): ended with {bias_events[-1:]}, want done")
    elif delta_tokens(bias_events) != expected[bias_prompt].token_ids:
        problems.append("int-keys logit_bias: tokens differ from an undisturbed run with the same bias")
    if any(letter.get(b"msg") == msgpack.packb(int_keys) for letter in letters):
        problems.append("int-keys logit_bias (valid) was dead-lettered")
    if len(letters) != len(poison):
        problems.append(
            f"{len(letters)} dead letters, want {len(poison)}: {[(letter.get(b'code'), letter.get(b'message')) for letter in letters]}"
        )
    if not nothing_left(stack):
        problems.append(f"left in the request stream: pending={stack.pending()} xlen={stack.admin.xlen(STREAM)}")
    assert not problems, "\n".join(problems) + f"\n{context}"
    stack.assert_alive()

    expected = pool.take(1)
    [follow_up] = expected
    async with client_session() as session:
        stream = await ChatStream(stack.urls[0], follow_up).run(session)
    stream.assert_exact(expected[follow_up].text, stack.log_tails())
    stack.assert_alive()


# ---------------------------------------------------------------- 3. Redis SIGKILL + restart with the AOF


async def _streams_through_a_redis_fault(stack: Stack, pool: PromptPool, fault):
    """4 streams in flight, the fault once all have text, then each stream's end: returns
    (in-flight streams, their expected answers)."""
    expected = pool.take(4)
    prompts = list(expected)
    async with client_session() as session:
        streams = [ChatStream(stack.urls[i % len(stack.urls)], prompt) for i, prompt in enumerate(prompts)]
        tasks = [asyncio.create_task(s.run(session)) for s in streams]
        try:
            await streaming(stack, streams, tasks, 3)
            await fault()
        finally:
            await finished(tasks)
    return streams, expected


async def _burst_after_recovery(stack: Stack, pool: PromptPool) -> list[str]:
    """Wait (bounded) for the stack to be ready again, then 4 fresh requests that must all succeed
    on their first try; returns the problems seen."""
    await stack.wait_ready(timeout=20)
    expected = pool.take(4)
    prompts = list(expected)
    async with client_session() as session:
        streams = await stream_all(
            session, [ChatStream(stack.urls[i % len(stack.urls)], p) for i, p in enumerate(prompts)]
        )
    return [f"after recovery: {s.describe()}" for s in streams if not s.is_exact(expected[s.prompt].text)]


@pytest.mark.slow
async def test_redis_killed_and_restarted_with_its_aof(stacks, pool):
    stack = await use(stacks, MAIN)

    async def kill_and_restart():
        await asyncio.to_thread(stack.restart_redis, persist=True, down_s=1.0)

    streams, expected = await _streams_through_a_redis_fault(stack, pool, kill_and_restart)
    outcomes = [s.assert_exact_or_visible_error(expected[s.prompt].text, stack.log_tails()) for s in streams]
    print(f"in-flight streams across the fault: {outcomes}; {[s.error for s in streams if s.error]}")
    stack.assert_alive()
    problems = await _burst_after_recovery(stack, pool)
    assert not problems, "\n".join(problems) + f"\nin flight: {outcomes}\n{stack.log_tails()}"
    await assert_nothing_left(
        stack, timeout=5 * CLAIM_S + 10
    )  # what ran across the restart is finished or claimed and finished
    stack.assert_alive()


# ---------------------------------------------------------------- 4. Redis without its data: restart without persistence, FLUSHALL


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["restart-without-persistence", "flushall"])
async def test_redis_loses_everything_streams_and_group_come_back(stacks, pool, fault):
    stack = await use(stacks, MAIN)

    async def lose_everything():
        if fault == "flushall":
            stack.admin.flushall()
        else:
            await asyncio.to_thread(stack.restart_redis, persist=False, down_s=0.5)

    streams, expected = await _streams_through_a_redis_fault(stack, pool, lose_everything)
    outcomes = [s.assert_exact_or_visible_error(expected[s.prompt].text, stack.log_tails()) for s in streams]
    print(f"in-flight streams across the fault: {outcomes}; {[s.error for s in streams if s.error]}")
    stack.assert_alive()
    problems = [f"in flight: HTTP 500: {s.describe()}" for s in streams if s.status == 500]
    try:
        problems += await _burst_after_recovery(stack, pool)
        marks = stack.log_marks()
        await asyncio.sleep(2.5)  # recovered and idle: nothing may go on complaining
        complaints = [
            line for line in stack.log_since(marks) if "NOGROUP" in line or " WARNING " in line or " ERROR " in line
        ]
        if complaints:
            problems.append(
                f"still logging after recovery (a loop?): {len(complaints)} lines in 2.5 s idle, e.g. {complaints[:3]}"
            )
    except AssertionError as exc:
        problems.append(str(exc))
    if not stack.group_exists():
        problems.append(f"the group {REQUEST_GROUP!r} on {STREAM} was not recreated")
    assert not problems, "\n".join(problems) + f"\nin flight: {outcomes}\n{stack.log_tails()}"
    await assert_nothing_left(stack, timeout=5 * CLAIM_S + 5)
    stack.assert_alive()


# ---------------------------------------------------------------- 5. client disconnect racing a worker death


@pytest.mark.parametrize("kind", [MAIN_KIND, "redis6" if MAIN_KIND == "valkey9" else "valkey9"])
async def test_client_leaves_as_its_worker_dies_the_withdrawn_entry_kills_no_one(stacks, pool, kind):
    stack = await use(stacks, MAIN if kind == MAIN_KIND else StackSpec(kind))
    expected = pool.take(2)
    prompt, follow_up = expected
    async with client_session() as session:
        stream = ChatStream(stack.urls[0], prompt)
        task = asyncio.create_task(stream.run(session))
        try:
            await streaming(stack, [stream], [task], 3)
            pending = stack.pending()
            assert len(pending) == 1, f"one entry pending, not {pending}\n{stream.describe()}"
            entry_id, victim = pending[0]["message_id"], pending[0]["consumer"].decode()
            survivors = [name for name in stack.workers if name != victim]
            stack.kill_worker(victim)  # SIGKILL ...
            task.cancel()  # ... and the client leaves: the gateway XDELs the entry, its cancel reaches no one
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    context = f"killed {victim} holding {entry_id!r}; the client left at once"
    await eventually(
        lambda: not stack.admin.xrange(STREAM, entry_id, entry_id),
        f"the gateway to delete the entry ({context})",
        5,
        stack,
    )

    # A survivor claims the deleted-but-pending entry once it is idle past the claim time.
    def settled() -> bool:
        stack.assert_alive(survivors + stack.gateways)
        return not stack.pending()

    await eventually(settled, f"nothing pending ({context})", 6 * CLAIM_S + 10, stack)
    await asyncio.sleep(2 * CLAIM_S)  # claim loops run on: nobody may die of it afterwards
    stack.assert_alive(survivors + stack.gateways)
    async with client_session() as session:
        after = await ChatStream(stack.urls[0], follow_up).run(session)
    after.assert_exact(expected[follow_up].text, f"{context}\n{stack.log_tails()}")
    assert nothing_left(stack), f"pending={stack.pending()}"
    stack.assert_alive(survivors + stack.gateways)


# ---------------------------------------------------------------- 7. a reply key the worker may not write


@pytest.mark.parametrize(
    "kind,reply_kind",
    [("redis6", "stream"), ("valkey9", "stream"), ("valkey9", "pubsub")],  # Redis 6.2 lets every user publish anywhere
)
async def test_reply_key_the_worker_may_not_write_fails_that_request_alone(stacks, pool, kind, reply_kind):
    pytest.importorskip(
        "tests.support.redis_acl", reason="tests/support/redis_acl.py (create_lmq_user) is not there yet"
    )
    stack = await use(stacks, StackSpec(kind, acl=True, workers=1))
    bad_key = "myapp:reply:1"
    with redis.Redis.from_url(stack.url) as limited:  # the workers' user really may not write there
        with pytest.raises(NoPermissionError):
            if reply_kind == "stream":
                limited.xadd(bad_key, {"msg": b"probe"})
            else:
                limited.publish(bad_key, b"probe")
    expected = pool.take(2)
    prompts = list(expected)
    bad_id = f"acl-{uuid.uuid4().hex[:8]}"
    bad = msgpack.packb(foreign_request(bad_id, "ACL: a reply nobody may write", bad_key, reply_kind=reply_kind))
    async with client_session() as session:
        streams = [ChatStream(stack.urls[0], prompt) for prompt in prompts]
        tasks = [asyncio.create_task(s.run(session)) for s in streams]
        try:
            await streaming(stack, streams, tasks, 2)
            stack.admin.xadd(STREAM, {"msg": bad})  # a foreign producer, as the default user
        finally:
            await finished(tasks)
    context = stack.log_tails()
    for stream in streams:
        stream.assert_exact(
            expected[stream.prompt].text, f"a request with an unwritable reply key ran next to this one\n{context}"
        )

    def dead_letter():
        return next((letter for letter in stack.dead_letters() if letter.get(b"msg") == bad), None)

    letter = await eventually(dead_letter, f"{bad_id} in {DEAD_LETTER_STREAM}", 15, stack)
    code, message = letter.get(b"code", b"").decode(), letter.get(b"message", b"").decode()
    assert code not in ("internal", "") and "reply" in code, (
        f"dead letter code {code!r} ({message!r}) should say the reply is not writable"
    )
    assert not stack.admin.exists(bad_key)
    await assert_nothing_left(stack)
    stack.assert_alive()
