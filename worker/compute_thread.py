"""The one thread that does a worker's heavy torch work: loading, the KV pool, every step.

torch parallelizes an operation with OpenMP, and libgomp keeps a pool of threads for each
thread that starts parallel work. A second pool on the same cores makes every pool throttle its
spinning: a decode step of the default model took 21 ms instead of 10 here. So the heavy work
runs on this thread only, and the thread that first asks for it (the event loop's) is set to
run its own small torch calls serially, so that it never starts a second pool.

The GIL: a step's native call releases it, but the Python around the call (the batch, sampling) needs
it back while the event loop (gateway relays, Redis calls) may hold it; a thread waiting for the GIL
asks its holder to let go only after the switch interval, 5 ms by default, longer than the default
model's whole step (4 ms). SWITCH_INTERVAL_S bounds that wait: the default model at one stream, whole
service, 164.6-169.5 against 147.6-162.6 tokens/s in five alternated rounds (AMD EPYC, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
SWITCH_INTERVAL_S = 0.0005  # the most another thread holds the GIL while this one waits for it (CPython: 0.005)


def executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        threads = torch.get_num_threads()
        _executor = ThreadPoolExecutor(
            1, thread_name_prefix="lmq-torch", initializer=torch.set_num_threads, initargs=(threads,)
        )
        torch.set_num_threads(1)
    return _executor


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn` on the torch thread and wait for it."""
    return executor().submit(fn, *args, **kwargs).result()


async def run_async(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn` on the torch thread while the event loop goes on."""
    return await asyncio.get_running_loop().run_in_executor(executor(), functools.partial(fn, *args, **kwargs))
