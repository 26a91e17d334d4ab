"""A worker process for tests that kill or stop it: the tiny model, each step slowed down.

    python tests/worker_process.py MODEL_DIR REDIS_URL WORKER_ID STEP_SECONDS

The delay keeps a generation running long enough for a test to signal the process mid-way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

import torch

from worker.config import WorkerConfig
from worker.model.loader import load_model
from worker.service import run_worker


class SlowModel(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, step_seconds: float):
        super().__init__()
        self.inner = inner
        self.step_seconds = step_seconds

    def forward(self, batch, kv):
        time.sleep(self.step_seconds)
        return self.inner(batch, kv)


def main(model_dir: str, redis_url: str, worker_id: str, step_seconds: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    loaded = load_model(model_dir, dtype="float32", quant="none", device="cpu")
    slowed = dataclasses.replace(loaded, model=SlowModel(loaded.model, float(step_seconds)))
    config = WorkerConfig(redis_url=redis_url, model_name="tiny", worker_id=worker_id, kv_memory="4MiB", max_seqs=4, claim_idle_ms=1000, grace_seconds=30)
    asyncio.run(run_worker(config, model=slowed))


if __name__ == "__main__":
    main(*sys.argv[1:])
