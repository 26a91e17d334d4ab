"""A worker process whose model answers at once (worker/stub_model.py): measures the queue's plumbing.

    python bench/harness/stub_worker.py --redis-url unix:///tmp/redis.sock --max-seqs 256

Every other flag is `lmq worker`'s; the default model's tokenizer, chat template and KV layout are
kept, only the transformer is replaced, so requests travel exactly as they would to a real worker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmq.settings import add_flags, build
from worker.config import WorkerConfig


def load_stub(config: WorkerConfig):
    from worker.model.loader import load_model
    from worker.stub_model import stub_model

    return stub_model(load_model(config.model or None, dtype=config.dtype, quant=config.quant, device=config.device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(parser, WorkerConfig)
    config = build(WorkerConfig, parser.parse_args(argv))
    from worker.service import run_worker

    try:
        asyncio.run(run_worker(config, model=load_stub(config)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
