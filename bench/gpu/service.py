"""The whole service on the GPU machine: embedded Redis, several gateways, one GPU worker, streaming clients.

Used by bench/gpu/check.py's `service` phase. The model is the SmolLM2-135M shape with random
weights, written as an HF directory the worker loads like any other. One client process per gateway
(bench/service/serve.py: chat completions, streamed, every prompt new) so that neither one gateway's event
loop nor the client's parsing caps the rate; a level's tokens/s is the sum over the clients.

    python -m bench.gpu.service --worker ...   # the worker (`lmq worker`)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import processes

GATEWAYS = 4
MAX_TOKENS = 64
PROMPT_TOKENS = "60-68"


def start_worker(model_dir: Path, redis_url: str, device: str, max_seqs: int, log: Path) -> subprocess.Popen:
    command = processes.python_command(
        "-m", "bench.gpu.service", "--worker", "--model", str(model_dir), "--device", device, "--dtype", "bfloat16",
        "--quant", "none", "--max-seqs", str(max_seqs), "--kv-memory", "4GiB" if device == "cuda" else "256MiB",
        "--page-size", "16", "--step-tokens", "4096", "--redis-url", redis_url,
    )  # fmt: skip
    return processes.start(command, log)


def run(record: Callable[[str, object], None], *, device: str, dry_run: bool, work: Path) -> None:
    from bench.engine.random_models import hf_config, random_weights, write_hf_dir
    from lmq.redis_server import EmbeddedRedis, free_tcp_port

    shape, levels = ("tiny", [4, 8]) if dry_run else ("smollm2-135m", [64, 256])
    gateways = 2 if dry_run else GATEWAYS
    config = hf_config(shape, 4096)
    model_dir = write_hf_dir(work / f"model-{shape}", config, random_weights(config, seed=0))
    record(
        "setup",
        {
            "shape": shape,
            "gateways": gateways,
            "max_tokens": 4 if dry_run else MAX_TOKENS,
            "prompt_tokens": PROMPT_TOKENS,
        },
    )
    redis = EmbeddedRedis().start()
    started: list[subprocess.Popen] = []
    try:
        started.append(start_worker(model_dir, redis.url, device, max(levels), work / "service-worker.log"))
        ports = [free_tcp_port() for _ in range(gateways)]
        for index, port in enumerate(ports):
            command = processes.python_command("-m", "lmq", "gateway", "--port", str(port), "--redis-url", redis.url,
                                               "--max-queue", "4096", "--request-timeout", "600")  # fmt: skip
            started.append(processes.start(command, work / f"service-gateway-{index}.log"))
        began = time.perf_counter()
        for port in ports:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/ready", started, timeout_s=180)
        record("ready_s", time.perf_counter() - began)
        for level_index, streams in enumerate(levels):
            record(f"level_{streams}", level(ports, streams, level_index, work, dry_run))
    finally:
        stop_all(started)
        redis.stop()


def stop_all(started: list[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """SIGTERM every process group at once, then SIGKILL what is left after `timeout_s`."""
    for process in started:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in started:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def level(ports: list[int], streams: int, level_index: int, work: Path, dry_run: bool) -> dict:
    """`streams` closed-loop streams spread over the gateways, two requests each."""
    per_client = max(1, streams // len(ports))
    clients = []
    for index, port in enumerate(ports):
        out = work / f"service-{streams}-{index}.json"
        command = processes.python_command(
            "bench/service/serve.py", "--url", f"http://127.0.0.1:{port}/v1", "--concurrency", str(per_client),
            "--requests", str(2 * per_client), "--warmup", "0", "--max-tokens", str(4 if dry_run else MAX_TOKENS),
            "--ignore-eos", "--prompt-tokens", PROMPT_TOKENS, "--prompt-offset", str(1000 * level_index + 200 * index),  # 3,200 distinct questions
            "--level-timeout", "120", "--json", str(out),
        )  # fmt: skip
        clients.append((processes.start(command, work / f"service-client-{streams}-{index}.log"), out))
    for process, _ in clients:
        process.wait(timeout=170)
    reports = [json.loads(out.read_text())["levels"][0] for _, out in clients if out.exists()]
    return {
        "streams": streams,
        "clients": len(reports),
        "output_tok_s": sum(r["output_tok_s"] for r in reports),
        "completed": sum(r["completed"] for r in reports),
        "errors": sum(r["errors"] for r in reports),
        "ttft_median_s": max((r["ttft_median_s"] or 0) for r in reports) if reports else None,
        "tpot_median_s": max((r["tpot_median_s"] or 0) for r in reports) if reports else None,
        "error_samples": sorted({e for r in reports for e in r["error_samples"]})[:3],
    }


def worker_main(argv: list[str]) -> int:
    """`lmq worker` (on CUDA its engine captures the decode graphs itself)."""
    from lmq.cli import main as lmq_main

    return lmq_main(["worker", *argv])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: python -m bench.gpu.service --worker [lmq worker options]")
