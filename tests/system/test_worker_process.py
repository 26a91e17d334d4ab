"""Workers as processes: killed with SIGKILL mid-generation, or stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import pytest

import protocol
from protocol import REQUEST_GROUP, decode_progress, progress_key
from tests.support.worker_harness import (
    STREAM,
    chat_request,
    enqueue,
    final_events,
    reply_events,
    running_worker,
    streamed_tokens,
    wait_for,
    worker_config,
)
from worker.model.loader import load_model

REPO = pathlib.Path(__file__).resolve().parents[2]


START_TIMEOUT_S = 180.0  # a new Python process imports torch and loads the model: a minute on 2 busy cores
GRACE_SECONDS = 120  # SIGTERM's drain is tested for finishing its requests, not for doing so quickly


def _log_tail(log: pathlib.Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
async def start_process(tiny_model_dir, redis_url, redis_client, tmp_path):
    processes: list[subprocess.Popen] = []

    async def start(worker_id: str, step_seconds: float) -> subprocess.Popen:
        command = [
            sys.executable,
            str(REPO / "tests" / "support" / "worker_process.py"),
            str(tiny_model_dir),
            redis_url,
            worker_id,
            str(step_seconds),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "LMQ_GRACE_SECONDS": str(GRACE_SECONDS)}
        log = tmp_path / f"{worker_id}.log"
        with log.open("wb") as output:  # a file, not a pipe nobody reads: a full pipe would block the worker's logging
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        processes.append(process)

        async def live() -> bool:
            assert process.poll() is None, f"worker {worker_id} exited with {process.returncode}:\n{_log_tail(log)}"
            return bool(await redis_client.exists(protocol.worker_key(worker_id)))

        await wait_for(live, what=f"worker {worker_id} to start", timeout=START_TIMEOUT_S)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _deltas(redis, reply_key: str, at_least: int) -> list[dict]:
    async def enough():
        events = await reply_events(redis, reply_key)
        return events if len(events) >= at_least else None

    return await wait_for(enough, what=f"{at_least} events on {reply_key}")


async def test_a_killed_workers_request_completes_coherently_on_another(
    tiny_model_dir, start_process, redis_url, redis_client
):
    # Each step takes at least 0.25 s, so the kill lands mid-generation unless this test stalls for
    # 9 s between seeing the third delta and sending SIGKILL.
    doomed = await start_process("doomed", step_seconds=0.25)
    await enqueue(redis_client, chat_request("victim", max_tokens=40))
    await _deltas(redis_client, "out:victim", at_least=3)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    streamed_before_death = len(decode_progress(await redis_client.get(progress_key("victim"))))
    assert 0 < streamed_before_death < 40

    tiny = load_model(str(tiny_model_dir), dtype="float32", quant="none", device="cpu")
    async with running_worker(worker_config(redis_url, "survivor", claim_idle_ms=600), tiny):
        events = await final_events(redis_client, "out:victim")
        await enqueue(redis_client, chat_request("clean", max_tokens=40))
        clean = streamed_tokens(await final_events(redis_client, "out:clean"))
    every_delta = [token for e in events if e["type"] == "delta" for token in e["token_ids"]]
    assert every_delta == streamed_tokens(events) == clean  # nothing duplicated, nothing missing
    assert events[-1]["type"] == "done"
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert await redis_client.xlen(STREAM) == 0


async def test_sigterm_finishes_running_requests_then_exits(start_process, redis_client):
    # At least 0.1 s a step: SIGTERM finds the request running unless this test stalls for 2.8 s.
    draining = await start_process("draining", step_seconds=0.1)
    await enqueue(redis_client, chat_request("last", max_tokens=30))
    await _deltas(redis_client, "out:last", at_least=2)
    draining.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(draining.wait, GRACE_SECONDS + 60) == 0
    events = await reply_events(redis_client, "out:last")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
    assert len(streamed_tokens(events)) == 30
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0
    assert not await redis_client.exists(protocol.worker_key("draining"))
