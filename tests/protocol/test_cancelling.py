"""Stopping tasks although a cancellation can be lost (protocol/cancelling.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from protocol.cancelling import cancel_and_wait, honour_lost_cancel


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again_and_one_that_never_stops_is_given_up():
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    stop_swallowing = asyncio.Event()

    async def immortal() -> None:
        while not stop_swallowing.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    gives_up, never_stops = asyncio.create_task(stubborn()), asyncio.create_task(immortal())
    await asyncio.sleep(0)
    assert await cancel_and_wait([gives_up], (1.0, 60.0)) == []  # the first cancel is swallowed, the second stops it
    assert gives_up.cancelled() and swallowed == 2
    assert await cancel_and_wait([never_stops], (0.05, 0.05)) == [never_stops]
    stop_swallowing.set()
    never_stops.cancel()
    await asyncio.wait([never_stops], timeout=5)
    assert never_stops.done()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling is Python 3.11+")
async def test_a_swallowed_cancellation_is_honoured_where_the_task_checks():
    async def swallows_then_checks() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # as Python 3.11's wait_for may do
        honour_lost_cancel()
        await asyncio.sleep(10)

    task = asyncio.create_task(swallows_then_checks())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.cancelled()
