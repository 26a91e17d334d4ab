"""The soak's fault scheduler: one fault every `interval_s`, the kinds in turn.

- `worker_kill`: SIGKILL a worker mid-stream, start a new one (another worker claims its entries);
- `worker_stop`: SIGSTOP a worker past the claim time, then SIGCONT (exactly one of the two keeps each entry);
- `gateway_kill`: SIGKILL the gateway, start it again on the same port (its clients see dropped connections);
- `redis_restart`: SIGKILL Redis and start it again from its append-only file;
- `sentinel_failover`: SIGKILL a Sentinel set's primary (only on that topology);
- `poison`: three entries no worker can run (no `msg`, bytes that are no msgpack, an unknown version):
  each must be dead-lettered and acknowledged, and nothing else may break.

Each fault is a `Fault` in the ledger with its start and end, so what clients saw is attributed to it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import msgpack

from bench.soak.ledger import Fault, Ledger

KINDS = ("worker_kill", "worker_stop", "gateway_kill", "redis_restart", "poison")
SENTINEL_KINDS = ("worker_kill", "worker_stop", "gateway_kill", "sentinel_failover", "poison")
POISON = ({"other": b"x"}, {"msg": b"\xc1\xc1 no msgpack"}, {"msg": msgpack.packb({"v": 99, "id": "poison"})})
DEAD_LETTER_WAIT_S = 30.0


class FaultScheduler:
    """Injects faults into a `SoakStack` (bench/soak/stack.py); `problems` collects what went wrong doing so."""

    def __init__(self, stack, ledger: Ledger, interval_s: float, kinds: tuple[str, ...] = KINDS):
        self.stack = stack
        self.ledger = ledger
        self.interval_s = interval_s
        self.kinds = kinds
        self.problems: list[str] = []
        self._turn = 0

    async def run(self, until: Callable[[], bool]) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if until():
                return
            kind = self.kinds[self._turn % len(self.kinds)]
            self._turn += 1
            fault = Fault(kind, time.monotonic())
            self.ledger.faults.append(fault)
            try:
                fault.detail = await getattr(self, kind)()
            except Exception as exc:  # a fault that could not be injected or undone is a finding
                fault.detail = f"failed: {exc!r}"
                self.problems.append(f"{kind}: {exc!r}")
            fault.ended = time.monotonic()
            print(f"soak: fault {kind} ({fault.ended - fault.started:.1f} s) {fault.detail}", flush=True)

    def _next_worker(self) -> str:
        return self.stack.workers[self._turn % len(self.stack.workers)]

    async def worker_kill(self) -> str:
        name = self._next_worker()
        await asyncio.to_thread(self.stack.kill_worker, name)
        started = await asyncio.to_thread(self.stack.start_worker)
        await self.stack.wait_ready()
        return f"killed {name}, started {started}"

    async def worker_stop(self) -> str:
        name = self._next_worker()
        pause = self.stack.claim_idle_s * 2.5
        self.stack.signal(name, signal.SIGSTOP)
        try:
            await asyncio.sleep(pause)
        finally:
            self.stack.signal(name, signal.SIGCONT)
        return f"stopped {name} for {pause:.1f} s"

    async def gateway_kill(self) -> str:
        name = await asyncio.to_thread(self.stack.restart_gateway)
        await self.stack.wait_ready()
        return f"restarted as {name}"

    async def redis_restart(self) -> str:
        await asyncio.to_thread(self.stack.restart_redis)
        await self.stack.wait_ready()
        return "SIGKILL, restarted from its append-only file"

    async def sentinel_failover(self) -> str:
        detail = await self.stack.fail_over()
        await self.stack.wait_ready()
        return detail

    async def poison(self) -> str:
        before = await asyncio.to_thread(self.stack.dead_letter_count)
        await asyncio.to_thread(self.stack.add_entries, POISON)
        deadline = time.monotonic() + DEAD_LETTER_WAIT_S
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.stack.dead_letter_count) >= before + len(POISON):
                return f"{len(POISON)} entries dead-lettered"
            await asyncio.sleep(0.5)
        raise AssertionError(f"{len(POISON)} poison entries were not all dead-lettered within {DEAD_LETTER_WAIT_S:g} s")
