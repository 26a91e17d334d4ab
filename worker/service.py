"""The worker service: a member of the `workers` consumer group that feeds the engine.

It reads new entries only while the engine has room (pull = load balancing), takes over
entries that dead workers left idle, keeps the idle time of its own entries low, listens for
cancellations, heartbeats, and on SIGTERM (or `stop`) drains within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator

import redis.asyncio as aioredis
import torch
from redis.exceptions import ResponseError

from protocol import (
    CANCEL_CHANNEL,
    Heartbeat,
    ProtocolError,
    Request,
    decode_cancel,
    decode_progress,
    decode_request,
)
from protocol.cancelling import cancel_and_wait
from protocol.cluster_url import shard_layout
from protocol.keys import BATCH, INTERACTIVE
from protocol.redis_client import REDIS_FAILURES, connect, pubsub
from protocol.resume import RESUME_CHANNEL
from worker import compute_thread
from worker.admission import AdmissionBudget
from worker.affinity import ShardAffinity
from worker.claims import FIRST_ID, Entry, EntryRef, Read, RequestStreams, is_missing_group, model_lanes
from worker.config import WorkerConfig, parse_kv_memory
from worker.engine import Engine, GenRequest, SeqOutput
from worker.heartbeat import heartbeat_loop
from worker.logprob_events import LogprobEvents
from worker.metrics import WorkerMetrics
from worker.model.loader import LoadedModel, load_model
from worker.prompt import PromptTooLong, build_prompt_ids
from worker.reasoning_budget import thinking_of
from worker.resume import RecordingPublisher, Resumer
from worker.tasks import answer_task
from worker.tracking import RequestTable

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
REDIS_RETRY_S = 1.0
HOLDER_MARGIN_S = 60  # a request's holder key outlives its deadline by this much
CANCEL_WAITS_S = (1.0,) * 10  # a stopping task is cancelled up to ten times, a second apart
# SET NX EX, and answer who holds the key now (this entry, or the one that held it already).
HOLD_LUA = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return ARGV[1] end return redis.call('GET', KEYS[1])"


async def run_worker(
    config: WorkerConfig, *, model: LoadedModel | None = None, stop: asyncio.Event | None = None
) -> None:
    """Serve until `stop` is set (by default: until SIGTERM), then drain; cancelling stops at once."""
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    if model is None:
        model = await compute_thread.run_async(
            load_model,
            config.model or None,
            dtype=config.dtype,
            quant=config.quant,
            device=config.device,
            cpu_steps=config.cpu_steps,
        )
    redis = connect(config.redis_url)
    try:
        await Worker(config, model, redis).run(stop)
    finally:
        await redis.aclose()


class Worker:
    def __init__(self, config: WorkerConfig, model: LoadedModel, redis: aioredis.Redis):
        self.config = config
        self.model = model
        self.model_name = config.model_name or model.name
        self.redis = redis
        self.shards = shard_layout(config.redis_url)
        lanes = model_lanes(self.shards, self.model_name)
        self.stream = RequestStreams(redis, lanes, config.worker_id)
        self.affinity = ShardAffinity(self.stream.lanes, len(self.shards.shards), config.worker_id)
        self.publisher = RecordingPublisher(
            redis, lanes, config.worker_id, on_refused=self._on_refused, on_written=self._on_written
        )
        self.resumer = Resumer(redis, self.stream, self.publisher, config.worker_id)
        self.engine = Engine(
            model,
            kv_memory_bytes=parse_kv_memory(config.kv_memory),
            page_size=config.page_size,
            max_seqs=config.max_seqs,
            step_tokens=config.step_tokens,
            on_step=self._on_step,
            on_step_seconds=lambda seconds: self.metrics.observe_step(seconds),
        )
        self.metrics = WorkerMetrics(self.model_name, lambda: self.engine.stats)
        self.table = RequestTable(
            self.publisher, self.engine.cancel, self.metrics.count_finished, LogprobEvents(model.tokenizer)
        )
        # A script, not MULTI: redis-py 8.1's cluster client runs a transaction that finds its slot map
        # stale on another event loop, which fails (seen after a primary came back).
        self._hold = redis.register_script(HOLD_LUA)
        self._room = asyncio.Event()
        self.budget = AdmissionBudget(on_returned=self._room.set)  # slots promised to reads in flight

    # ------------------------------------------------------------ lifetime

    async def run(self, stop: asyncio.Event | None = None) -> None:
        await self.stream.ensure_group()
        if stop is not None:
            await self._serve(stop)
            return
        stop = asyncio.Event()
        with _stop_on_sigterm(stop):
            await self._serve(stop)

    async def _serve(self, stop: asyncio.Event) -> None:
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        engine = asyncio.create_task(self.engine.run(), name="engine")
        background = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(
                heartbeat_loop(self.redis, self.config.worker_id, self._heartbeat, self.shards.home), name="heartbeat"
            ),
            asyncio.create_task(self._listen_for_cancels(), name="cancels"),
            asyncio.create_task(self._keep_loop(), name="keep"),
        ]
        if len(self.shards.shards) > 1:
            follow = self.affinity.follow(self.redis, self.shards.home, self.model_name)
            background.append(asyncio.create_task(follow, name="affinity"))
        intake = [
            asyncio.create_task(self._read_loop(), name="read"),
            asyncio.create_task(self._claim_loop(), name="claim"),
        ]
        log.info("worker %s serving %s from %s", self.config.worker_id, self.model_name, self.stream.stream)
        try:
            await _until_stop_or_failure(stop, [engine, *intake, *background])
            await _cancel(intake)
            await self._drain(engine)
        finally:
            await _cancel([engine, *intake, *background])
            self.metrics.close()

    async def _drain(self, engine: asyncio.Task) -> None:
        """Finish what the engine holds within the grace period; what is left stays pending for others."""
        log.info("worker %s stopping: draining %d requests", self.config.worker_id, len(self.table.running))
        self.engine.stop()
        try:
            await asyncio.wait_for(asyncio.shield(engine), self.config.grace_seconds)
        except TimeoutError:
            log.warning("grace period over: %d requests handed back to the group", len(self.table.running))
        await self.publisher.flush()

    def _heartbeat(self) -> Heartbeat:
        stats = self.engine.stats
        return Heartbeat(
            worker_id=self.config.worker_id,
            model=self.model_name,
            capacity=self.config.max_seqs,
            running=stats.running,
            waiting=stats.waiting,
            kv_pages_used=stats.kv_pages_used,
            kv_pages_total=stats.kv_pages_total,
            time=time.time(),
        )

    # ------------------------------------------------------------ Redis loops

    async def _read_loop(self) -> None:
        """One reader per lane (a priority's stream in one shard), each waiting on its own stream: an
        interactive request is read the moment it arrives, even while a batch reader waits for room.
        However many lanes there are, together they take no more than the room (worker/admission.py)."""
        readers = [asyncio.create_task(self._read_lane(lane), name=f"read-{lane}") for lane in self.stream.lanes]
        try:
            await asyncio.gather(*readers)
        finally:
            await _cancel(readers)

    async def _read_lane(self, lane: str) -> None:
        """Take slots from the budget, read that many without blocking; with nothing there, wait for a new
        entry holding no slot (so another lane's reader may use them meanwhile). On another worker's
        shard, only entries that were there before the deferral (worker/affinity.py)."""
        priority = self.stream.lanes[lane].priority
        seen = FIRST_ID  # the newest entry id this reader knew of, before its next deferral begins
        while True:
            if not self.affinity.may_read(lane):  # another worker's shard, while ours have work
                await self.affinity.changed()
                continue
            up_to = self.affinity.up_to(lane, seen)
            await self.affinity.defer(lane)  # another's shard: its own worker first
            if not self.affinity.may_read(lane):
                continue
            slots = self.budget.take(self._room_for(priority))
            if slots <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                read = await self.stream.read_available(lane, slots, up_to)
            except REDIS_FAILURES as exc:
                self.budget.give_back(slots)
                await self._recover_from(exc)
                continue
            self.budget.give_back(slots - len(read.entries))
            self.affinity.found(lane, bool(read.entries))
            seen = await self._admit_or_wait(lane, read)

    async def _admit_or_wait(self, lane: str, read: Read) -> str:
        """Start what a read took, or with nothing left to take wait for a new entry; the newest entry id
        known now (the one that ended the wait, else the read's)."""
        try:
            if read.entries:
                await self._admit_all(read.entries, claimed=False)
            elif read.drained:
                block_ms = self.affinity.block_ms(lane, READ_BLOCK_MS)
                return await self.stream.wait_beyond(lane, read.newest, block_ms) or read.newest
        except REDIS_FAILURES as exc:
            await self._recover_from(exc)
        return read.newest

    async def _admit_all(self, entries: list[Entry], *, claimed: bool) -> None:
        """Start or refuse each entry, giving its promised slot back once the engine counts it (all that
        are left when Redis fails midway: those stay pending here, and the claim loop finds them)."""
        left = len(entries)
        try:
            for entry in entries:
                await self._admit(entry, claimed=claimed)
                left -= 1
                self.budget.give_back(1)
        finally:
            self.budget.give_back(left)

    def _room_for(self, priority: str) -> int:
        """How many entries of `priority` to take now.

        Batch work takes only free slots (none while anything waits for pages), so a busy worker leaves
        it to others. Interactive work also counts the slots batch work holds as room: the scheduler
        preempts batch sequences for it. With no batch work held, both are the engine's free slots.
        """
        free = self.engine.free_slots()
        held = [running.request.priority for running in self.table.running.values()]
        if priority == BATCH or BATCH not in held:
            return free
        return max(free, self.config.max_seqs - held.count(INTERACTIVE))

    async def _claim_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.claim_idle_ms / 2000)
            try:
                for priority in (INTERACTIVE, BATCH):
                    await self._claim(priority)
            except REDIS_FAILURES as exc:
                await self._recover_from(exc)

    async def _claim(self, priority: str) -> None:
        """Take over idle entries of `priority`, as many as the budget gives."""
        slots = self.budget.take(self._room_for(priority))
        if slots <= 0:
            return
        try:
            claimed = await self.stream.claim_idle(self.config.claim_idle_ms, {priority: slots})
        except BaseException:
            self.budget.give_back(slots)
            raise
        self.budget.give_back(slots - len(claimed))
        await self._admit_all(claimed, claimed=True)

    async def _keep_loop(self) -> None:
        """Keep our entries from looking abandoned, and time out those past their deadline."""
        while True:
            await asyncio.sleep(self.config.claim_idle_ms / 3000)
            self.table.time_out_overdue(time.time())
            try:
                lost = await self.stream.keep([running.entry for running in self.table.running.values()])
            except REDIS_FAILURES as exc:
                log.warning("could not refresh held entries: %s", exc)
                continue
            for entry in lost:
                self._on_refused(entry, "lost", "another worker took it over")

    async def _recover_from(self, error: Exception) -> None:
        """Recreate a lost stream or group (FLUSHALL, a Redis restarted empty); else wait and retry."""
        if isinstance(error, ResponseError) and is_missing_group(error):
            log.warning("the consumer group of %s is gone; recreating it", self.stream.stream)
            try:
                await self.stream.ensure_group()
                return
            except REDIS_FAILURES as exc:
                error = exc
        await _pause_after(error)

    def _on_written(self, entries: list[EntryRef]) -> None:
        self.table.written(entries)

    def _on_refused(self, entry: EntryRef, status: str, detail: str) -> None:
        """The publisher or the keep loop found an entry this worker may no longer answer: end its request."""
        self.publisher.sent_events.forget_entry(entry)
        self.table.refused(entry, status)

    async def _listen_for_cancels(self) -> None:
        while True:
            try:
                await self._cancel_subscription()
            except REDIS_FAILURES as exc:
                await _pause_after(exc)

    async def _cancel_subscription(self) -> None:
        cancels = await pubsub(self.redis)
        await cancels.subscribe(CANCEL_CHANNEL, RESUME_CHANNEL)
        try:
            async for message in cancels.listen():
                if message["type"] == "message" and message["channel"] == RESUME_CHANNEL.encode():
                    self.resumer.on_message(message["data"])
                elif message["type"] == "message":
                    self._cancel(message["data"])
        finally:
            await cancels.aclose()

    def _cancel(self, raw: bytes) -> None:
        try:
            cancel = decode_cancel(raw)
        except ProtocolError as exc:
            log.info("ignored a malformed cancellation: %s", exc)
            return
        self.table.cancel(cancel)

    # ------------------------------------------------------------ from entry to engine

    async def _admit(self, entry: Entry, *, claimed: bool) -> None:
        if claimed and (self._running_entry(entry.ref) or self.publisher.writing(entry.ref)):
            # Claimed back from ourselves (XAUTOCLAIM does not skip the caller's own entries: we stalled
            # past the claim time, or Redis refused our writes and keeps): it runs here already, or its
            # last writes are on their way and end it; the claim only made it ours again.
            log.info("entry %s claimed back while running or being written here: it goes on", entry.ref)
            return
        raw = entry.fields.get(b"msg", b"")
        try:
            request = decode_request(raw)
        except ProtocolError as exc:
            self.table.reject(entry.ref, raw, exc.code, exc.message, request_id=exc.request_id, reply=exc.reply)
            return
        shard = self.stream.lane_of(entry.ref).shard
        if request.reply.kind != "pubsub" and not shard.holds(request.reply.key):
            # A script may write any key its node holds, so without this check where the slots lie would decide.
            message = f"the reply {request.reply.kind} {request.reply.key!r} is outside the request's shard: on a Redis Cluster it carries the shard's hash tag {{{shard.tag}}}"
            self.table.reject(entry.ref, raw, "reply_denied", message, request_id=request.id, reply=None)
            return
        streamed: list[int] = []
        try:
            if claimed:
                streamed = await self._check_attempts_and_progress(entry, request)
            if time.time() > request.deadline:
                raise ProtocolError("timeout", "the request's deadline passed before it started")
            if request.task != "generate":
                self.table.answer(entry.ref, request, answer_task(self.model, request))
                return
            await self._hold_id(request, entry.ref)
            self._start(request, entry.ref, streamed)
        except REDIS_FAILURES:
            raise
        except Exception as exc:
            code, message = _rejection(exc)
            # The request ends here: forget its progress and holder, unless those belong to the other run of its id.
            forget = code != "duplicate_id"
            log.info("request_id=%s refused: %s: %s", request.id, code, message, extra={"request_id": request.id})
            self.table.reject(
                entry.ref,
                raw,
                code,
                message,
                request_id=request.id,
                reply=request.reply,
                seq=len(streamed),
                forget=forget,
            )

    def _running_entry(self, entry: EntryRef) -> bool:
        return any(running.entry == entry for running in self.table.running.values())

    async def _check_attempts_and_progress(self, entry: Entry, request: Request) -> list[int]:
        """For an entry taken over from a dead worker: the tokens it streamed, unless it ran too often."""
        progress = self.stream.lane_of(entry.ref).shard.progress_key(request.id)
        streamed = decode_progress(await self.redis.get(progress))
        attempts = await self.stream.delivery_count(entry.ref)
        if attempts > self.config.max_attempts:
            raise ProtocolError(
                "retry_limit", f"abandoned by {attempts - 1} workers; the limit is {self.config.max_attempts} runs"
            )
        return streamed

    async def _hold_id(self, request: Request, entry: EntryRef) -> None:
        """Make this entry the one that runs the request's id, on every worker: two entries with one id
        would share a reply address and a progress record. The entry finishing deletes the key."""
        key = self.stream.lane_of(entry).shard.holder_key(request.id)
        holder_name = str(entry)  # unique in the shard: its two streams number their entries independently
        ttl = max(int(request.deadline - time.time()), 0) + HOLDER_MARGIN_S
        holder = await self._hold(keys=[key], args=[holder_name, ttl])
        if holder is not None and holder.decode() != holder_name:
            raise ProtocolError("duplicate_id", f"a request with id {request.id} is already running")

    def _start(self, request: Request, entry: EntryRef, streamed: list[int]) -> None:
        prompt_ids = build_prompt_ids(
            self.model,
            messages=request.messages,
            prompt=request.prompt,
            prompt_ids=request.prompt_ids,
            max_tokens=request.sampling.max_tokens,
            truncate=request.truncate,
            tools=request.tools,
            continue_final=request.continue_final,
            template_kwargs=request.template_kwargs,
        )
        thinking = thinking_of(self.model, prompt_ids) if request.messages is not None else None
        work = GenRequest(
            request.id,
            prompt_ids,
            request.sampling,
            generated_ids=streamed,
            constraint=request.constraint,
            logprobs=request.logprobs,
            priority=request.priority,
            thinking=thinking,
            reasoning_budget=request.reasoning_budget,
        )
        self.engine.add(work)
        self.publisher.sent_events.started(request, entry, streamed)  # before table.start sends `started`
        self.table.start(request, entry, len(streamed), len(prompt_ids), thinking)
        resumed = f", resuming after {len(streamed)} streamed tokens" if streamed else ""
        log.info(
            "request_id=%s started: %d prompt tokens%s",
            request.id,
            len(prompt_ids),
            resumed,
            extra={"request_id": request.id},
        )

    def _on_step(self, outputs: list[SeqOutput]) -> None:
        self.table.on_step(outputs)
        for out in outputs:
            if out.finish_reason is not None:
                log.info(
                    "request_id=%s finished: %s, %d prompt tokens (%d cached), %d completion tokens",
                    out.id, out.finish_reason, out.prompt_tokens, out.cached_tokens, out.completion_tokens, extra={"request_id": out.id},
                )  # fmt: skip
        self._room.set()


@contextlib.contextmanager
def _stop_on_sigterm(stop: asyncio.Event) -> Iterator[None]:
    """Set `stop` on SIGTERM while inside (where this loop can handle signals: the main thread)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _rejection(exc: Exception) -> tuple[str, str]:
    """The error code and message for a request that could not start."""
    if isinstance(exc, ProtocolError):
        return exc.code, exc.message
    if isinstance(exc, PromptTooLong):
        return "prompt_too_long", str(exc)
    if isinstance(exc, ValueError):  # e.g. token ids outside the vocabulary
        return "bad_request", str(exc)
    log.error("could not start a request", exc_info=exc)
    return "internal", f"{type(exc).__name__}: {exc}"


async def _until_stop_or_failure(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Wait for `stop`; a task that ends first (it failed) re-raises its exception."""
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    for task in done:
        if task is not stopped:
            task.result()
            raise RuntimeError(f"the {task.get_name()} task ended unexpectedly")


async def _pause_after(error: Exception) -> None:
    log.warning("redis: %s; retrying in %.0f s", error, REDIS_RETRY_S)
    await asyncio.sleep(REDIS_RETRY_S)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel and await the tasks (protocol/cancelling.py: a task that swallowed its cancellation is cancelled again)."""
    left = await cancel_and_wait(tasks, CANCEL_WAITS_S)
    if left:
        log.error("tasks did not stop when cancelled: %s", [task.get_name() for task in left])
