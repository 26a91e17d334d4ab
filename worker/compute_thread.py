"""The one thread that does a worker's heavy torch work: loading, the KV pool, every step.

torch parallelizes an operation with OpenMP, and libgomp keeps a pool of threads for each
thread that starts parallel work. A second pool on the same cores makes every pool throttle its
spinning: a decode step of the default model took 21 ms instead of 10 here. So the heavy work
runs on this thread only, and the thread that first asks for it (the event loop's) is set to
run its own small torch calls serially, so that it never starts a second pool.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None


def executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
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
