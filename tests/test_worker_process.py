"""Workers as processes: killed with SIGKILL mid-generation, or stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from worker_helpers import STREAM, chat_request, enqueue, final_events, reply_events, running_worker, streamed_tokens, wait_for, worker_config

import protocol
from protocol import REQUEST_GROUP, decode_progress, progress_key
from worker.model.loader import load_model

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
async def start_process(tiny_model_dir, redis_url, redis_client):
    processes: list[subprocess.Popen] = []

    async def start(worker_id: str, step_seconds: float) -> subprocess.Popen:
        command = [sys.executable, str(REPO / "tests" / "worker_process.py"), str(tiny_model_dir), redis_url, worker_id, str(step_seconds)]
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
        processes.append(process)
        await wait_for(lambda: redis_client.exists(protocol.worker_key(worker_id)), what=f"worker {worker_id} to start")
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


async def _deltas(redis, reply_key: str, at_least: int) -> list[dict]:
    async def enough():
        events = await reply_events(redis, reply_key)
        return events if len(events) >= at_least else None

    return await wait_for(enough, what=f"{at_least} events on {reply_key}")


async def test_a_killed_workers_request_completes_coherently_on_another(tiny_model_dir, start_process, redis_url, redis_client):
    doomed = await start_process("doomed", step_seconds=0.05)
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
    draining = await start_process("draining", step_seconds=0.05)
    await enqueue(redis_client, chat_request("last", max_tokens=30))
    await _deltas(redis_client, "out:last", at_least=2)
    draining.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(draining.wait, 60) == 0
    events = await reply_events(redis_client, "out:last")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
    assert len(streamed_tokens(events)) == 30
    assert (await redis_client.xpending(STREAM, REQUEST_GROUP))["pending"] == 0
    assert not await redis_client.exists(protocol.worker_key("draining"))
