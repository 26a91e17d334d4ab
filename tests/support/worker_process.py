"""A worker process for tests that kill or stop it: the tiny model, each step slowed down.

    python tests/support/worker_process.py MODEL_DIR REDIS_URL WORKER_ID STEP_SECONDS

The delay keeps a generation running long enough for a test to signal the process mid-way.
Worker settings default to the values below; an `LMQ_*` variable in the environment (as the `lmq
worker` command reads it: LMQ_CLAIM_IDLE_MS, LMQ_MAX_SEQS, LMQ_KV_MEMORY, ...) overrides one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time

import torch

from lmq.settings import build, env_name
from worker.config import WorkerConfig
from worker.model.loader import load_model
from worker.service import run_worker

DEFAULTS = dict(kv_memory="4MiB", max_seqs=4, claim_idle_ms=1000, grace_seconds=30)
FIXED = ("redis_url", "model", "model_name", "worker_id")  # given on the command line


class SlowModel(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, step_seconds: float):
        super().__init__()
        self.inner = inner
        self.step_seconds = step_seconds

    def forward(self, batch, kv):
        time.sleep(self.step_seconds)
        return self.inner(batch, kv)


def settings_from_environment() -> dict:
    """The worker settings named by `LMQ_*` variables, parsed as `lmq worker` parses them."""
    built = build(WorkerConfig, argparse.Namespace(), os.environ)
    return {
        field.name: getattr(built, field.name)
        for field in dataclasses.fields(WorkerConfig)
        if field.name not in FIXED and env_name(field) in os.environ
    }


def main(model_dir: str, redis_url: str, worker_id: str, step_seconds: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(model_dir, dtype="float32", quant="none", device="cpu")
    slowed = dataclasses.replace(loaded, model=SlowModel(loaded.model, float(step_seconds)))
    settings = {**DEFAULTS, **settings_from_environment()}
    config = WorkerConfig(redis_url=redis_url, model_name="tiny", worker_id=worker_id, **settings)
    asyncio.run(run_worker(config, model=slowed))


if __name__ == "__main__":
    main(*sys.argv[1:])
