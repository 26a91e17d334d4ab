"""Stopping asyncio tasks although a cancellation can be lost: the one workaround, for every part.

Python 3.11's `asyncio.wait_for` (inside redis-py's connect, among others) can swallow a
cancellation that lands as the awaited operation completes: the task goes on as if it had never
been cancelled. So a task being stopped is cancelled again while it still runs (`cancel_and_wait`),
and a task about to wait forever first honours a cancellation it did not see (`honour_lost_cancel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence


async def cancel_and_wait(tasks: Iterable[asyncio.Task], waits: Sequence[float]) -> list[asyncio.Task]:
    """Cancel the tasks, then wait `waits[0]` seconds for them, cancel those still running again and
    wait `waits[1]`, and so on; the tasks still running after the last wait, given up on rather than
    hung on. Every other task's outcome is retrieved, so asyncio reports none as never retrieved."""
    tasks = list(tasks)
    pending = [task for task in tasks if not task.done()]
    for wait in waits:
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=wait)
        pending = list(still)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return pending


def honour_lost_cancel() -> None:
    """Raise CancelledError if the current task was cancelled but the cancellation was swallowed."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():  # Task.cancelling: Python 3.11+
        raise asyncio.CancelledError
