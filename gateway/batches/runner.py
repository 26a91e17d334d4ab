"""The batch runner: every gateway runs one; each active batch is driven by exactly one gateway at a time.

A gateway drives a batch while it holds the batch's lease (gateway/leased_drivers.py: renewed every
tick, about twice a second); a gateway that dies stops renewing, and after `LEASE_MS` another one
takes the batch over and continues from what Redis holds: which item is next, which runs are in flight (an
entry in a request stream each, with a durable reply stream of its own), which outcomes are
written. Nothing lives only in a driver's memory: what it folds from a run's events it reads again
from the reply stream after a takeover.

Driving a batch, tick by tick:

1. keep up to `batch_in_flight` items in the queue: each is a protocol request with priority
   `batch` (workers run it on spare capacity, after interactive work), its events on the reply
   stream `lmq:batch:<id>:reply:<index>.<attempt>` (all in the home shard: store.py); the XADD and
   the in-flight record are one script;
2. read the runs' reply streams (one blocking XREAD for all) and fold each run's events
   (item_run.py); a run that ended writes the item's outcome once (HSETNX: a result per item,
   whatever ran twice); a run whose stream shows a hole asks its worker for what is missing
   (`lmq:resume`, as a live relay does: gateway/resume.py) and is lost only if none answers; a
   driver that took a batch over asks the same, once, for each run read to its stream's end
   without an end (lost last entries, `done` among them, show no hole);
3. a run whose entry is gone from its stream and from the group's pending list without an end
   on its reply stream was lost (a Redis that lost data, an entry withdrawn before a worker read
   it): the item runs again, up to `MAX_ATTEMPTS`; so every item ends with exactly one outcome
   (at-least-once execution, written once);
4. when the batch is cancelled (or its completion window ends), in-flight runs are withdrawn (XDEL,
   and a cancellation for a worker that holds one), items never started are `canceled`
   (`expired`), and runs that finish anyway keep their answers;
5. when every item has an outcome: OpenAI's output and error files are written, and the batch
   ends (`completed`, `cancelled` or `expired`).

A worker's death needs nothing here: another worker claims the entry and continues on the same
reply stream (docs/protocol.md).

Redis unreachable (a restart, a Sentinel failover): the driver keeps its runs and what it folded
of each, and waits for Redis up to the gateway's `resume_timeout`; past it, it hands the batch
back as on any Redis error. Once Redis answers, its runs are those Redis holds in flight (a run it
already folds keeps what it took, re-read from its stream's start where the server lacks the entry
it read last: the events it has are dropped by `seq`), it takes the lease again if that expired
meanwhile and nobody else took it, and every run asks its worker for the events after the last one
it took: the worker, which never lost the request, re-establishes what the server lacks (the entry,
its pending state, progress and holder) and appends them, then `resumed`. So an item whose events
the server lost ends once, by its first run, with its exact text; only one whose worker died too
(or that it no longer keeps) runs again, and the claims go on for a run whose worker died alone.

Rate limits (gateway/rate_limits.py): a batch's items count against the limits of the key that owns
the batch (its `owner`, the key's digest). Items wait for the key's budget rather than being
charged after the fact only: each new item is admitted as a live request is (one request counted;
refused while the key's requests or tokens this minute are at its limit, and then the batch waits,
its item not enqueued, until the window resets). With a token limit, the driver also keeps in
flight no more items than the key's tokens left in the window cover (by each item's
`max_tokens`; one at least), so a batch cannot start hundreds of items on an almost spent budget.
Each item's real tokens (prompt + completion, as its `done` event counts them) are charged to the
key when its outcome is written, exactly once: the write records them as owed to the key (one
script), and the driver charges what is owed (once per item, by a marker in the counters' slot) and
clears it, at once and again each round, so a write whose reply was lost, or a driver that died
after it, charges them all the same. So a key overshoots by what its in-flight items use beyond their
`max_tokens`, and its prompts, as a live key overshoots by its running requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import protocol
from protocol.redis_client import UNREACHABLE

from ..context import Gateway
from ..errors import ApiError
from ..leased_drivers import LEASE_MS, Lease, LeasedDrivers
from ..resume import StreamOrder, ask_for
from . import items, outputs
from .item_run import Ended, ItemRun
from .store import Batch, BatchStore, Run

log = logging.getLogger(__name__)

READ_BLOCK_MS = 500
READ_COUNT = 256  # entries read from each reply stream a round: fewer, and the run's stream is read to its end
RECONNECT_S = 0.5  # while Redis is unreachable, how often the driver tries it again
LOST_CHECK_S = 5.0  # a run silent this long is checked for a vanished entry
MAX_ATTEMPTS = 3
DEFAULT_RESERVE = 16  # tokens an item without max_tokens is assumed to take, when a token limit sizes the window


def batch_runner(gateway: Gateway, store: BatchStore) -> LeasedDrivers:
    """This gateway's runner: a `Driver` for each batch it holds the lease of (gateway/leased_drivers.py)."""

    async def drive(lease: Lease) -> None:
        await Driver(gateway, store, lease).run()

    return LeasedDrivers(store, gateway.config.gateway_id, drive, "batch")


class Driver:
    """One batch, while this gateway holds its lease."""

    def __init__(self, gateway: Gateway, store: BatchStore, lease: Lease):
        self.gateway = gateway
        self.store = store
        self.lease = lease
        self.me = lease.holder
        self.batch_id = lease.job_id
        self.limiter = gateway.limiter  # the per-key limits, on a gateway with keys
        self.runs: dict[int, ItemRun] = {}
        self.reserved: dict[int, int] = {}  # item index -> the tokens it may take (its max_tokens), while in flight
        self._tokens_left: int | None = None  # the owner's tokens left in its window, as last admitted
        self._checked_at = time.monotonic()
        self._reconnected = False  # Redis came back after an outage: the lease may need taking again
        self._unasked: dict[int, ItemRun] = {}  # runs taken over, until read to their stream's end

    async def run(self) -> None:
        await self._load_runs()
        self._unasked = dict(self.runs)
        while True:
            try:
                if not await self._held():
                    log.warning("batch %s: lease lost; another gateway drives it now", self.batch_id)
                    return
                if await self._round():
                    return
                self._reconnected = False
            except UNREACHABLE as exc:
                if not await self._ride_out(exc):
                    raise

    async def _round(self) -> bool:
        """One round on the batch as Redis holds it; True once the driver is done with it."""
        batch = await self.store.batch(self.batch_id)
        if batch is None:
            return True  # deleted
        if batch.ended:
            await self.store.ended(self.batch_id)
            return True
        return await self._tick(batch)

    async def _held(self) -> bool:
        """The lease is still this gateway's. Right after an outage it may have expired, or been lost
        with the server's last writes: taken again if nobody else took it, the runs held go on."""
        if await self.lease.renew():
            return True
        return self._reconnected and await self.store.take_lease(self.batch_id, self.me, LEASE_MS)

    # ------------------------------------------------------------ Redis unreachable

    async def _ride_out(self, exc: Exception) -> bool:
        """Keep the runs through an outage, up to the resume bound; True once Redis answers again
        (the runs reloaded, each asking its worker for what it missed), False past the bound."""
        bound = self.gateway.config.resume_timeout
        log.warning(
            "batch %s: redis unreachable (%s); keeping its %d runs for up to %g s",
            self.batch_id,
            exc,
            len(self.runs),
            bound,
        )
        for run in self.runs.values():
            run.order.lost_touch()
        until = time.monotonic() + bound
        while time.monotonic() < until:
            await asyncio.sleep(RECONNECT_S)
            try:
                await self._load_runs()
            except UNREACHABLE:
                continue
            for run in self.runs.values():
                run.reconnected()
            self._reconnected = True
            log.warning(
                "batch %s: redis answers again; %d runs ask their workers to resume", self.batch_id, len(self.runs)
            )
            return True
        return False

    async def _load_runs(self) -> None:
        """The runs in flight as Redis holds them. A run this driver folds already keeps what it took;
        where the server lacks the entry it read last (lost writes), its stream is read again from the
        start, and the events it has are dropped by their `seq`."""
        runs = {}
        for index, stored in (await self.store.runs(self.batch_id)).items():
            run = self.runs.get(index)
            if run is None or (run.attempt, run.entry_id) != (stored.attempt, stored.entry_id):
                run = self._item_run(index, stored)
            elif run.cursor != "0-0" and not await self.store.redis.xrange(run.reply_key, run.cursor, run.cursor):
                run.cursor = "0-0"
            runs[index] = run
        self.runs = runs
        self.reserved = {index: tokens for index, tokens in self.reserved.items() if index in runs}

    async def _tick(self, batch: Batch) -> bool:
        """One round; True once the batch has ended."""
        now = time.time()
        if batch.status == "validating":
            await self.store.update(self.batch_id, status="in_progress", in_progress_at=repr(now))
            batch.fields["status"] = "in_progress"
        await self._charge_owed(batch)
        ending = self._ending(batch, now)
        if ending:
            await self._withdraw_runs()
            await self._skip_unstarted(batch, ending)
        elif not await self._top_up(batch):
            return False
        if not self.runs and (ending or batch.number("next") >= batch.total):
            await self._finish(batch, ending)
            return True
        await self._read_events(batch, ending)
        await self._check_lost(batch, ending)
        return False

    @staticmethod
    def _ending(batch: Batch, now: float) -> str | None:
        """The outcome of items that will not run now: `canceled`, `expired`, or None while it goes on."""
        if batch.status == "cancelling":
            return "canceled"
        if batch.status == "finalizing":  # every item has its outcome: only the files are left to write
            return None
        if now >= (batch.time("expires_at") or float("inf")):
            return "expired"
        return None

    # ------------------------------------------------------------ enqueueing

    async def _top_up(self, batch: Batch) -> bool:
        """Fill the in-flight window; False when the batch moved on under us (the lease, a cancel)."""
        start, total = batch.number("next"), batch.total
        room = min(self.gateway.config.batch_in_flight - len(self.runs), total - start)
        if room <= 0:
            return True
        for offset, item in enumerate(await self.store.items(self.batch_id, start, room)):
            if not await self._admitted(batch, item):
                return True  # the owner's budget is spent: the rest waits
            if not await self._start(batch, start + offset, item, attempt=1):
                return False
            if start + offset in self.runs:  # not an item that failed before it ran
                self.reserved[start + offset] = _reserve(item)
        return True

    async def _admitted(self, batch: Batch, item: dict[str, Any]) -> bool:
        """The owner's rate limits let this new item start (and it is counted as a request)."""
        limits = self.limiter.limits_for_owner(batch.owner) if self.limiter else None
        if not limits:
            return True
        in_flight = sum(self.reserved.values())
        if (
            limits.tokens
            and in_flight
            and self._tokens_left is not None
            and in_flight + _reserve(item) > self._tokens_left
        ):
            return False
        assert self.limiter is not None
        window = await self.limiter.admit_owner(batch.owner, limits)
        self._tokens_left = limits.tokens - window.tokens if limits.tokens else None
        return not window.refused

    async def _start(
        self, batch: Batch, index: int, item: dict[str, Any], attempt: int, retries: int | None = None
    ) -> bool:
        request_id = f"{self.batch_id}.{index}.{attempt}"
        reply_key = self.store.reply_stream(self.batch_id, index, attempt)
        try:
            request = items.batch_request(
                self.gateway, item, request_id, reply_key, batch.time("expires_at") or time.time()
            )
        except Exception as exc:  # a body the endpoint refuses (checked here, not at upload: one bad item fails alone)
            error = (
                exc
                if isinstance(exc, ApiError)
                else ApiError(400, f"the request could not be read: {type(exc).__name__}")
            )
            if not isinstance(exc, ApiError):
                log.warning("batch %s: item %d: %r", self.batch_id, index, exc)
            outcome = {
                "outcome": "errored",
                "request_id": request_id,
                "error": {
                    "status": error.status,
                    "code": error.code or "invalid_request",
                    "message": error.message,
                    "param": error.param,
                },
            }
            if retries is not None:
                return await self.store.record(self.batch_id, index, outcome, retries)
            await self.store.record(self.batch_id, index, outcome, None)
            return await self.store.pass_over(self.me, self.batch_id, index)
        run = await self.store.enqueue(self.me, self.batch_id, index, attempt, request, retries)
        if run is None:
            return False
        self.runs[index] = self._item_run(index, run)
        return True

    def _item_run(self, index: int, run: Run) -> ItemRun:
        return ItemRun(
            index,
            run.attempt,
            run.stream,
            run.entry_id,
            self.store.reply_stream(self.batch_id, index, run.attempt),
            f"{self.batch_id}.{index}.{run.attempt}",
            order=StreamOrder(self.gateway.config.resume_timeout),
        )

    # ------------------------------------------------------------ reading the runs

    async def _read_events(self, batch: Batch, ending: str | None) -> None:
        for run in list(self.runs.values()):
            if run.ended is not None:  # folded before the connection broke, its outcome not written
                await self._settle(batch, run, run.ended, ending)
        await self._resume_runs(batch, ending)
        if not self.runs:
            await asyncio.sleep(READ_BLOCK_MS / 1000)
            return
        by_key = {run.reply_key: run for run in self.runs.values()}
        reply = await self.store.redis.xread(
            {key: run.cursor for key, run in by_key.items()}, count=READ_COUNT, block=READ_BLOCK_MS
        )
        read = {}
        for key, entries in reply or []:
            run = by_key[key.decode() if isinstance(key, bytes) else key]
            read[run.index] = len(entries)
            await self._fold(batch, run, entries, ending)
        self._ask_taken_over(read)

    def _ask_taken_over(self, read: dict[int, int]) -> None:
        """A run taken over and read to its stream's end without an end resumes once: the entries its
        worker wrote last (`done` among them) may be lost with Redis's data, and then no hole shows.
        Its worker, which keeps what it sent, sends the tail again and `resumed` (at once, rather than
        the item waiting for a claim or the lost check and running again)."""
        for index, run in list(self._unasked.items()):
            if self.runs.get(index) is not run or run.ended is not None:
                del self._unasked[index]
            elif read.get(index, 0) < READ_COUNT:
                del self._unasked[index]
                if not run.resuming:
                    run.order.resume_now()

    async def _resume_runs(self, batch: Batch, ending: str | None) -> None:
        """Ask the workers of resuming runs (again) for what they missed; a run past the bound with a
        hole is lost."""
        for run in list(self.runs.values()):
            if run.order.due_ask():
                await ask_for(self.store.redis, run.request_id, run.order.last_seq, run.tokens)
            ended = run.resume_expired()
            if ended is not None:
                run.ended = ended
                await self._settle(batch, run, ended, ending)

    async def _fold(self, batch: Batch, run: ItemRun, entries: list, ending: str | None) -> None:
        for entry_id, fields in entries:
            run.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                event = protocol.decode_event(fields.get(b"msg", b""))
            except protocol.ProtocolError:
                continue
            run.ended = run.feed(event)
            if run.ended is not None:  # kept on the run until its outcome is written
                await self._settle(batch, run, run.ended, ending)
                return

    async def _check_lost(self, batch: Batch, ending: str | None) -> None:
        """Runs silent for a while whose entry vanished without an end on their reply stream."""
        now = time.monotonic()
        if now - self._checked_at < LOST_CHECK_S:
            return
        self._checked_at = now
        quiet = [
            run for run in self.runs.values() if now - run.heard_at >= LOST_CHECK_S and not run.resuming
        ]  # a resuming run's worker may re-establish its entry: the resume decides
        gone = await self.store.gone([Run(run.attempt, run.stream, run.entry_id) for run in quiet])
        for run, vanished in zip(quiet, gone):
            if not vanished:
                continue
            # The step script writes a run's end and removes its entry in one step: read what it wrote.
            entries = await self.store.redis.xrange(
                run.reply_key, f"({run.cursor}" if run.cursor != "0-0" else "-", "+"
            )
            await self._fold(batch, run, entries, ending)
            if self.runs.get(run.index) is run and not run.resuming:
                run.ended = Ended("lost")
                await self._settle(batch, run, run.ended, ending)

    # ------------------------------------------------------------ ends

    async def _settle(self, batch: Batch, run: ItemRun, ended: Ended, ending: str | None) -> None:
        outcome = self._outcome(run, ended, ending)
        if outcome is None:
            await self._retry(batch, run)
            return
        usage = ended.event.get("usage") or {}
        owed = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        owed = owed if self.limiter is not None and batch.owner else 0
        recorded = await self.store.record(self.batch_id, run.index, outcome, run.attempt, owed)
        if recorded:
            await self.store.redis.delete(run.reply_key)
        if recorded == 2 and owed:
            await self._charge(batch, run.index, owed)
        self.runs.pop(run.index, None)
        self.reserved.pop(run.index, None)

    async def _charge(self, batch: Batch, index: int, tokens: int) -> None:
        assert self.limiter is not None
        await self.limiter.charge_owner_once(batch.owner, f"{self.batch_id}.{index}", tokens)
        await self.store.paid(self.batch_id, index)

    async def _charge_owed(self, batch: Batch) -> None:
        """Charge what recorded outcomes still owe the owner: a record whose reply was lost (its retry
        answered "already written"), a driver that died between the record and the charge."""
        if self.limiter is None:
            return
        for index, tokens in self.store.owed(batch).items():
            await self._charge(batch, index, tokens)

    def _outcome(self, run: ItemRun, ended: Ended, ending: str | None) -> dict[str, Any] | None:
        """The item's outcome from how its run ended; None: run it again."""
        event = ended.event
        base: dict[str, Any] = {"request_id": run.request_id}
        if ended.how == "done" and event.get("finish_reason") != "cancelled":
            finished = {key: event.get(key) for key in ("finish_reason", "stop_sequence")}
            finished["extra"] = {
                key: event[key] for key in ("prompt_ids", "pieces", "max_context", "text") if key in event
            }
            return base | {
                "outcome": "succeeded",
                **run.answer,
                "done": finished,
                "usage": event.get("usage") or {},
            }
        if ended.how == "error":
            code = str(event.get("code"))
            if code == "timeout" and ending == "expired":
                return base | {"outcome": "expired"}
            error = ApiError.from_worker(code, str(event.get("message")))
            return base | {
                "outcome": "errored",
                "error": {"status": error.status, "code": code, "message": error.message},
            }
        if ending:  # cancelled, or lost, while the batch ends: it will not run again
            return base | {"outcome": ending}
        if run.attempt >= MAX_ATTEMPTS:
            message = f"the item's answer was lost {run.attempt} times on the way from the workers"
            return base | {"outcome": "errored", "error": {"status": 503, "code": "retry_limit", "message": message}}
        return None

    async def _retry(self, batch: Batch, run: ItemRun) -> None:
        log.warning("batch %s: item %d's run %d was lost; running it again", self.batch_id, run.index, run.attempt)
        await self._withdraw(run)
        [item] = await self.store.items(self.batch_id, run.index, 1)
        self.runs.pop(run.index, None)
        await self._start(batch, run.index, item, run.attempt + 1, retries=run.attempt)
        await self.store.redis.delete(run.reply_key)

    async def _withdraw_runs(self) -> None:
        for run in self.runs.values():
            if not run.withdrawn:
                await self._withdraw(run)

    async def _withdraw(self, run: ItemRun) -> None:
        await self.store.withdraw(Run(run.attempt, run.stream, run.entry_id), run.request_id)
        run.withdrawn = True
        run.heard_at = 0.0  # check it for a vanished entry at the next chance

    async def _skip_unstarted(self, batch: Batch, ending: str) -> None:
        start = batch.number("next")
        if start < batch.total:
            await self.store.record_many(
                self.batch_id, [(index, {"outcome": ending}) for index in range(start, batch.total)]
            )
            await self.store.update(self.batch_id, next=batch.total)
            batch.fields["next"] = str(batch.total)

    async def _finish(self, batch: Batch, ending: str | None) -> None:
        status = {None: "completed", "canceled": "cancelled", "expired": "expired"}[ending]
        now = repr(time.time())
        fields: dict[str, Any] = {}
        if batch.api == "openai":
            if status == "completed":  # OpenAI's status while the files are written (a cancel or expiry keeps its own)
                await self.store.update(self.batch_id, status="finalizing", finalizing_at=now)
            batch = await self.store.batch(self.batch_id) or batch
            fields = await self._write_openai_files(batch)
        await self.store.ended(self.batch_id, status=status, **{f"{status}_at": repr(time.time())}, **fields)
        log.info("batch %s %s: %d items", self.batch_id, status, batch.total)

    async def _write_openai_files(self, batch: Batch) -> dict[str, str]:
        suffix = self.batch_id.removeprefix("batch_")
        fields = {}
        for succeeded, name in ((True, "output"), (False, "errors")):
            if not (batch.number("succeeded") if succeeded else batch.finished - batch.number("succeeded")):
                continue
            file_id = f"file-{suffix}-{name}"

            async def lines(wanted: bool = succeeded):
                async for ok, line in outputs.openai_lines(self.store, batch):
                    if ok == wanted:
                        yield line

            meta = {"filename": f"{self.batch_id}_{name}.jsonl", "purpose": "batch_output", "batch_id": self.batch_id}
            await self.store.write_generated_file(file_id, batch.owner, meta, lines())
            fields["output_file_id" if succeeded else "error_file_id"] = file_id
        return fields


def _reserve(item: dict[str, Any]) -> int:
    """The tokens an item may take: its body's max_completion_tokens or max_tokens."""
    body = item.get("body") if isinstance(item.get("body"), dict) else {}
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and value > 0 else DEFAULT_RESERVE
