"""Jobs that one gateway at a time drives, by a lease: batches (batches/runner.py) and background
responses (responses/background.py).

Every gateway runs a `LeasedDrivers` for each kind of job. It looks for the store's active jobs
every `SCAN_S` (at once when woken: a job was created here), takes the lease of each one nobody
drives (`SET NX PX`: the store's `take_lease`) and drives it in a task of its own; the driver renews
the lease every tick (`Lease.renew`) and stops once that fails. Why a lease: one gateway at a time
drives a job, so what must happen once (an enqueue, an outcome, the end) is not done by two
drivers; and nothing needs a gateway to stay up: a dead gateway stops renewing, its leases expire
after `LEASE_MS`, and another gateway takes each job over from what Redis holds.

A driver that ends, fails or meets a Redis error (then after `RETRY_S`) releases its lease, so
another gateway, or this one at its next scan, takes the job at once; `stop` (the gateway's
shutdown) cancels every driver and so hands its jobs back without waiting for the expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

LEASE_MS = 6000
SCAN_S = 1.0  # how often a gateway looks for jobs nobody drives
RETRY_S = 1.0  # after a Redis error, before the lease is handed back


RENEW_LUA = r"""
-- KEYS = [lease]; ARGV = [gateway, ms]: 1 while the lease is this gateway's (renewed), else 0
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

RELEASE_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseKeys:
    """A store's lease keys, one a job: taken with `SET NX PX`, renewed and released only by their
    holder (a script, so a lease that expired and went to another gateway is not touched)."""

    def __init__(self, redis):
        self.redis = redis
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)

    async def take(self, key: str, holder: str, ms: int) -> bool:
        return bool(await self.redis.set(key, holder, nx=True, px=ms))

    async def renew(self, key: str, holder: str, ms: int) -> bool:
        return bool(await self._renew(keys=[key], args=[holder, ms]))

    async def release(self, key: str, holder: str) -> None:
        await self._release(keys=[key], args=[holder])


class LeasedStore(Protocol):
    """Where a kind of job keeps its active set and its leases (one key a job, `SET NX PX`)."""

    async def active(self) -> list[str]: ...

    async def take_lease(self, job_id: str, gateway_id: str, ms: int) -> bool: ...

    async def renew_lease(self, job_id: str, gateway_id: str, ms: int) -> bool: ...

    async def release_lease(self, job_id: str, gateway_id: str) -> None: ...


@dataclass(frozen=True)
class Lease:
    """A job this gateway holds: a driver works on it while `renew` answers True."""

    store: LeasedStore
    job_id: str
    holder: str  # this gateway's id

    async def renew(self) -> bool:
        return await self.store.renew_lease(self.job_id, self.holder, LEASE_MS)


Drive = Callable[[Lease], Awaitable[None]]


class LeasedDrivers:
    """This gateway's drivers of one kind of job; `noun` names the kind in its log lines."""

    def __init__(self, store: LeasedStore, holder: str, drive: Drive, noun: str):
        self.store = store
        self.holder = holder
        self.drive = drive
        self.noun = noun
        self._drivers: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._stopping = False

    def wake(self) -> None:
        """A job was created here: look for work now, not at the next scan."""
        self._wake.set()

    async def run(self) -> None:
        """Until `stop`: a flag, not a cancellation, which redis-py may swallow (protocol/cancelling.py)."""
        while not self._stopping:
            await self._take()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SCAN_S)
            self._wake.clear()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop driving: every driver is cancelled and releases its lease, so another gateway takes over at once."""
        self._stopping = True
        self._wake.set()
        drivers = list(self._drivers.values())
        deadline = time.monotonic() + timeout
        while (running := [task for task in drivers if not task.done()]) and time.monotonic() < deadline:
            for task in running:
                task.cancel()  # again on each round: a cancellation can be lost
            await asyncio.wait(running, timeout=0.5)

    async def lifetime(self, _app: object) -> AsyncIterator[None]:
        """For aiohttp's `cleanup_ctx`: running from start-up to shutdown, stopped then."""
        task = asyncio.create_task(self.run(), name=f"{self.noun} drivers")
        yield
        await self.stop()
        await asyncio.wait([task], timeout=SCAN_S + 5)
        if not task.done():
            task.cancel()

    async def _take(self) -> None:
        for job_id, task in list(self._drivers.items()):
            if task.done():
                del self._drivers[job_id]
                if not task.cancelled() and task.exception() is not None:
                    log.error("driving %s %s failed", self.noun, job_id, exc_info=task.exception())
        try:
            for job_id in await self.store.active():
                if self._stopping:
                    return
                if job_id not in self._drivers and await self.store.take_lease(job_id, self.holder, LEASE_MS):
                    lease = Lease(self.store, job_id, self.holder)
                    self._drivers[job_id] = asyncio.create_task(self._drive(lease), name=f"drive {job_id}")
        except RedisError as exc:
            log.warning("could not look for a %s to drive: %s", self.noun, exc)

    async def _drive(self, lease: Lease) -> None:
        log.info("driving %s %s", self.noun, lease.job_id)
        try:
            await self.drive(lease)
        except RedisError as exc:
            log.warning("%s %s: redis: %s; handing it back", self.noun, lease.job_id, exc)
            await asyncio.sleep(RETRY_S)
        finally:
            with contextlib.suppress(RedisError):
                await asyncio.shield(self.store.release_lease(lease.job_id, self.holder))
