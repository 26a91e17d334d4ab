"""A large batch input never stalls the gateway's event loop, and its parse stays bounded in memory
(issue 28, item 5): a 62 MB upload froze every stream of its gateway for 8 s, the batch made from it
for 7.5 s again, and 4M one-character lines took +562 MiB."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
import tracemalloc
from dataclasses import dataclass

import pytest

from gateway.batches import parse
from gateway.config import GatewayConfig
from tests.support.batch_files import chat_line
from tests.support.gateway_harness import REAL_MODEL, announce, running_gateway

pytestmark = pytest.mark.system  # client processes upload 64 MiB

# The target is a gap under 100 ms (measured here: 6-17 ms, AMD EPYC 2026-12-07, alone and beside three
# busy processes); the old code stalled 4-8 s, and the parse moved back onto the loop stalls 300-650 ms.
# The bound fails on both, not on the machine's load: a gap leaves out the time the process's threads
# waited for a core (see Stalls). CI saw 517 ms against a count of the whole process's CPU, 238 ms under
# load ~10 against a count of our threads' CPU, 220 ms against the loop's own wait for a core alone
# (2026-12-04): the loop also waits for the GIL while the thread that holds it (the parse) sits in the
# run queue; and 153 ms from the probe's own reading of /proc (2026-12-07, see Stalls).
MAX_STALL_S = 0.15

CLIENT = r"""
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=300)
with open(sys.argv[2], "rb") as f:
    upload = client.files.create(file=("big.jsonl", f), purpose="batch")
print("uploaded", flush=True)
sys.stdin.readline()  # the test's mark between the two phases
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
print(json.dumps({"status": batch.status, "total": batch.request_counts.total, "bytes": upload.bytes}), flush=True)
"""


def _queued_s() -> float:
    """Seconds the process's threads have spent runnable but not running (Linux's per-thread schedstat)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended
            continue
    return total / 1e9


@dataclass
class Stall:
    seconds: float
    collection_s: float  # the largest garbage collection inside that gap

    def __str__(self) -> str:
        return f"{self.seconds * 1000:.0f} ms (a garbage collection in it: {self.collection_s * 1000:.0f} ms)"


class Stalls:
    """The loop's largest gap between two wake-ups of a task that asks to run every 5 ms: what a
    concurrent stream's chunks would wait, since they are written by the same loop.

    A gap counts the wall time the loop was held by this process's own work: the loop's thread
    running (the batch's work on the loop) or waiting for the GIL while a thread of ours runs with
    it. Time a thread of ours sat in the kernel's run queue while other processes held the machine's
    cores (the suite's, a loaded CI host's) only delays the loop, so a gap leaves it out: the loop's
    own wait for a core, and a GIL holder's (the loop waits for the GIL as long as its holder waits
    for a core). It is the sum over the process's threads, up to the gap.

    The probe's own reading of /proc is kept out of the gap: each of its syscalls lets go of the GIL,
    and with a thread parsing beside it each waits up to the switch interval (5 ms) to take it back,
    which made the probe's own tick 50-90 ms (CI read 153 ms). A stream's chunk is one write.

    While it runs the suite's heap is frozen out of the collector (gc.freeze), as a gateway
    process has no such heap: a collection costs what the gateway's own objects cost. The largest
    collection inside a counted gap is kept beside it, for the failure's message."""

    def __init__(self):
        self.largest = 0.0
        self.largest_collection = 0.0
        self._collection_started = None
        self._collection_in_gap = 0.0
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._on_collection)
        self._task = asyncio.create_task(self._tick())

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collection_started = time.perf_counter()
        elif self._collection_started is not None:
            self._collection_in_gap = max(self._collection_in_gap, time.perf_counter() - self._collection_started)

    async def _tick(self) -> None:
        last_queued, last_done = _queued_s(), time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            woke, queued = time.perf_counter(), _queued_s()
            gap = woke - last_done
            stall = gap - min(gap, queued - last_queued) - 0.005
            if stall > self.largest:
                self.largest, self.largest_collection = stall, self._collection_in_gap
            self._collection_in_gap = 0.0
            last_queued, last_done = queued, time.perf_counter()

    def reset(self) -> Stall:
        """The largest gap since the last reset."""
        stall = Stall(self.largest, self.largest_collection)
        self.largest = self.largest_collection = 0.0
        return stall

    def stop(self) -> None:
        self._task.cancel()
        gc.callbacks.remove(self._on_collection)
        gc.unfreeze()


def big_input(path, target_bytes: int) -> int:
    """Lines of about 1.3 KB up to `target_bytes`: the item limit (50,000) and the size limit (64 MiB) both nearly reached."""
    line = (json.dumps(chat_line("c-00000", "x" * 1180)) + "\n").encode()
    count = min(50_000, target_bytes // len(line))
    with open(path, "wb") as f:
        for i in range(count):
            f.write(line.replace(b"c-00000", f"c-{i:05d}".encode(), 1))
    return count


async def test_a_64_mib_upload_and_the_batch_made_from_it_never_stall_the_loop(redis_url, redis_client, tmp_path):
    await announce(redis_client, REAL_MODEL)  # served: the batch is made (and starts) without a worker
    path = tmp_path / "big.jsonl"
    count = big_input(path, 64 << 20)
    async with running_gateway(redis_url) as url:
        stalls = Stalls()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, url, str(path), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert (await asyncio.wait_for(client.stdout.readline(), 300)).strip() == b"uploaded"
            upload_stall = stalls.reset()
            client.stdin.write(b"go\n")
            created = json.loads(await asyncio.wait_for(client.stdout.readline(), 300))
            await asyncio.sleep(1.0)  # the runner starts the batch: its first items enqueued
            create_stall = stalls.reset()
        finally:
            stalls.stop()
            if client.returncode is None:
                client.kill()
            await client.wait()
    assert (
        created == {"status": "validating", "total": count, "bytes": path.stat().st_size}
        or created["status"] == "in_progress"
    ), created
    assert upload_stall.seconds < MAX_STALL_S, f"the loop stalled {upload_stall} during the upload"
    assert create_stall.seconds < MAX_STALL_S, f"the loop stalled {create_stall} while the batch was made"


POST_BODY = r"""
import sys, urllib.request
with open(sys.argv[2], "rb") as f:
    body = f.read()
request = urllib.request.Request(sys.argv[1] + "/v1/messages/batches", data=body, headers={"content-type": "application/json", "x-api-key": "unused"})
with urllib.request.urlopen(request, timeout=300) as response:
    print(response.status, flush=True)
"""


async def test_a_64_mib_message_batch_never_stalls_the_loop(redis_url, redis_client, tmp_path):
    await announce(redis_client, REAL_MODEL)
    params = {"model": REAL_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 1200}]}
    count = min(50_000, (63 << 20) // len(json.dumps({"custom_id": "c-00000", "params": params})))
    path = tmp_path / "body.json"
    path.write_text(json.dumps({"requests": [{"custom_id": f"c-{i:05d}", "params": params} for i in range(count)]}))
    async with running_gateway(redis_url) as url:
        stalls = Stalls()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", POST_BODY, url, str(path), stdout=asyncio.subprocess.PIPE
        )
        try:
            status = (await asyncio.wait_for(client.stdout.readline(), 300)).strip()
            await asyncio.sleep(1.0)
            stall = stalls.reset()
        finally:
            stalls.stop()
            if client.returncode is None:
                client.kill()
            await client.wait()
    assert status == b"200"
    assert stall.seconds < MAX_STALL_S, f"the loop stalled {stall} while the message batch was made"


def test_a_file_of_millions_of_bad_lines_is_refused_in_bounded_memory():
    """8 MiB of one-character lines: counted against the item limit before anything is kept."""
    data = b"1\n" * (4 << 20)
    limits = parse._Limits.__new__(parse._Limits)
    config = GatewayConfig()
    limits.max_items, limits.max_request_bytes = config.batch_max_items, config.max_body_bytes
    tracemalloc.start()
    try:
        parsed = parse._openai_file(limits, data, ("/v1/chat/completions",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(parsed.errors) <= 20 and parsed.more_errors
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB kept while parsing"
    many = b"".join(json.dumps(chat_line(f"c{i}", "hi")).encode() + b"\n" for i in range(config.batch_max_items + 1))
    parsed = parse._openai_file(limits, many, ("/v1/chat/completions",))
    assert [error.message for error in parsed.errors] == [
        f"the batch has more than {config.batch_max_items} requests; a batch may have at most {config.batch_max_items}"
    ]


def test_an_anthropic_body_is_read_a_request_at_a_time_and_its_shape_checked():
    """parse._requests walks `{..., "requests": [...], ...}` one element per json call; anything else is a ValueError."""
    body = ' { "note" : {"a": [1, 2]}, "requests" : [ {"custom_id": "a"} , [], 3 ] ,"z":null } \n'
    assert list(parse._requests(body)) == [(0, {"custom_id": "a"}), (1, []), (2, 3)]
    assert list(parse._requests('{"requests": []}')) == []
    for bad in (
        "",
        "[]",
        '{"requests": 5}',
        '{"other": 1}',
        '{"requests": [1,]}',
        '{"requests": [1]} x',
        '{"requests": [1]',
        "{1: 2}",
        '{"requests": [], "requests": []}',
    ):
        try:
            list(parse._requests(bad))
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
