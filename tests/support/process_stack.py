"""Support for tests/system/test_faults.py: real processes to break, a raw SSE client, and what to expect.

A `Stack` is one Redis server (on a TCP port, append-only file on, so it can be SIGKILLed and
started again on the same port), `lmq gateway` processes and worker processes
(tests/support/worker_process.py: the tiny model in float32, each step slowed so a fault lands
mid-stream), each process in its own session and logging to its own file. A `ChatStream` is one
streaming chat completion read event by event, so a test sees exactly what a client saw: the text,
the finish, the usage, the `[DONE]`, an error inside the stream, a non-200, a dropped connection,
or nothing at all (a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisError, ResponseError

import protocol
from lmq.redis_server import free_tcp_port
from protocol import REQUEST_GROUP
from tests.support.redis_topology import SingleRedis
from worker.engine import Engine, GenRequest, SeqOutput
from worker.prompt import build_prompt_ids

REPO = Path(__file__).resolve().parents[2]
LMQ = Path(sys.executable).with_name("lmq")  # the console script next to this Python
WORKER_SCRIPT = REPO / "tests" / "support" / "worker_process.py"

MODEL = "tiny"
STREAM = protocol.request_stream(MODEL)
MAX_TOKENS = 32
STEP_SECONDS = 0.06  # a 32-token answer takes about 2 s
CLAIM_IDLE_MS = 1000
WORKER_SETTINGS = {
    "LMQ_CLAIM_IDLE_MS": str(CLAIM_IDLE_MS),
    "LMQ_MAX_SEQS": "4",
    "LMQ_KV_MEMORY": "4MiB",
    "LMQ_THREADS": "1",
    "LMQ_GRACE_SECONDS": "2",
}
GATEWAY_SETTINGS = {
    "LMQ_HOST": "127.0.0.1",
    "LMQ_PICKUP_TIMEOUT": "10",  # a request nobody starts: 504 after 10 s, not the default 60
    "LMQ_REQUEST_TIMEOUT": "25",
    "LMQ_KEEPALIVE_SECONDS": "2",
}
CLIENT_TIMEOUT_S = 40.0  # above the gateway's own limits: running into it is a hang
START_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 25


# ---------------------------------------------------------------- waiting


async def eventually(
    check: Callable[[], Any], what: str, timeout: float, stack: Stack | None = None, interval: float = 0.1
) -> Any:
    """Poll `check` (a plain function) until it returns something true; fail with the logs."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except RedisError as exc:  # Redis down for a moment: keep polling
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            tails = f"\n{stack.log_tails()}" if stack else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{detail}{tails}")
        await asyncio.sleep(interval)


# ---------------------------------------------------------------- processes


class Processes:
    """Named child processes, each in its own session and logging to its own file."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], environment: dict[str, str]) -> subprocess.Popen:
        with open(self.log_path(name), "ab") as log:
            process = subprocess.Popen(
                argv,
                cwd=REPO,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.running[name] = process
        return process

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_text(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def alive(self, name: str) -> bool:
        return self.running[name].poll() is None

    def signal(self, name: str, sig: int) -> None:
        process = self.running[name]
        if process.poll() is None:
            os.killpg(process.pid, sig)
        if sig == signal.SIGKILL:
            process.wait(timeout=10)

    def kill(self, name: str) -> None:
        process = self.running.pop(name)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)  # a stopped process dies only once running
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def kill_all(self) -> None:
        for name in list(self.running):
            self.kill(name)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, even without running its finalizers."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _clean_environment() -> dict[str, str]:
    """This process's environment without any lmq setting."""
    drop = ("REDIS_URL", "PORT")
    return {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in drop}


# ---------------------------------------------------------------- a stack of Redis, gateways, workers


@dataclass(frozen=True)
class StackSpec:
    kind: str  # "redis6" or "valkey9" (lmq.redis_server.find_redis_server)
    acl: bool = False  # gateways and workers connect as the limited `lmq` ACL user (docs/deploy.md)
    workers: int = 2
    gateways: int = 1

    @property
    def name(self) -> str:
        return f"{self.kind}{'-acl' if self.acl else ''}-{self.workers}w{self.gateways}g"


class Stack:
    """The lmq processes on a Redis topology (tests/support/redis_topology.py: one server, a Sentinel
    set, a cluster). `prepare()` before each test makes it whole again. What it reads from the request
    path (pending entries, the group, what is left, dead letters) it reads from every shard."""

    def __init__(self, spec: StackSpec, root: Path, model_dir: Path, topology=None):
        """`topology` default: a `SingleRedis` of `spec.kind` that the stack owns (and stops on close)."""
        self.spec, self.root, self.model_dir = spec, root, model_dir
        self._owns_topology = topology is None
        self.topology = topology if topology is not None else SingleRedis(root, spec.kind)
        self.redis, self.admin, self.layout = self.topology.server, self.topology.admin, self.topology.layout
        self.url = self._lmq_url()
        self.processes = Processes(root / "logs")
        self.workers: list[str] = []
        self.gateways: list[str] = []
        self.gateway_urls: dict[str, str] = {}
        self._started = 0

    def _lmq_url(self) -> str:
        if not self.spec.acl:
            return self.topology.url
        from tests.support.redis_acl import create_lmq_user

        return create_lmq_user(self.topology.url)

    # ------------------------------------------------------------ processes

    def start_worker(self, **settings: str) -> str:
        self._started += 1
        name = f"worker-{self._started}"
        environment = {**_clean_environment(), "PYTHONPATH": str(REPO), **WORKER_SETTINGS, **settings}
        argv = [sys.executable, str(WORKER_SCRIPT), str(self.model_dir), self.url, name, str(STEP_SECONDS)]
        self.processes.start(name, argv, environment)
        self.workers.append(name)
        return name

    def start_gateway(self, port: int | None = None, **settings: str) -> str:
        """A gateway on `port` (default: a free one; a restarted gateway takes its predecessor's), with `settings`."""
        self._started += 1
        name = f"gateway-{self._started}"
        port = port or free_tcp_port()
        environment = {
            **_clean_environment(),
            **GATEWAY_SETTINGS,
            **settings,
            "REDIS_URL": self.url,
            "PORT": str(port),
        }
        self.processes.start(name, [str(LMQ), "gateway"], environment)
        self.gateways.append(name)
        self.gateway_urls[name] = f"http://127.0.0.1:{port}"
        return name

    def kill_worker(self, name: str) -> None:
        """SIGKILL, as a crash; the worker is no longer one of the stack's."""
        self.processes.signal(name, signal.SIGKILL)
        self.workers.remove(name)

    def signal(self, name: str, sig: int) -> None:
        self.processes.signal(name, sig)

    @property
    def urls(self) -> list[str]:
        return [self.gateway_urls[name] for name in self.gateways]

    def assert_alive(self, names: list[str] | None = None) -> None:
        names = self.workers + self.gateways if names is None else names
        exited = {name: self.processes.running[name].returncode for name in names if not self.processes.alive(name)}
        assert not exited, f"processes exited: {exited}\n{self.log_tails(list(exited) + names)}"

    def log_tails(self, names: list[str] | None = None, lines: int = LOG_TAIL_LINES) -> str:
        names = list(dict.fromkeys(names or list(self.processes.running)))
        parts = []
        for name in names:
            text = self.processes.log_text(name).splitlines()
            parts.append(f"--- {name} (last {lines} lines)\n" + "\n".join(text[-lines:]))
        parts.append(self.topology.log_tails())
        return "\n".join(parts)

    def log_marks(self) -> dict[str, int]:
        """Where each live process's log ends now (for `log_since`)."""
        return {name: self.processes.log_path(name).stat().st_size for name in self.workers + self.gateways}

    def log_since(self, marks: dict[str, int]) -> list[str]:
        """The log lines written since `marks`, each prefixed by its process name."""
        lines = []
        for name, offset in marks.items():
            with open(self.processes.log_path(name), "rb") as log:
                log.seek(offset)
                lines += [f"{name}: {line}" for line in log.read().decode(errors="replace").splitlines()]
        return lines

    # ------------------------------------------------------------ Redis

    def redis_alive(self) -> bool:
        return self.topology.alive()

    def restart_redis(self, *, persist: bool, down_s: float = 0.5) -> None:
        """SIGKILL the one Redis and start it again on its port (`SingleRedis.restart`)."""
        self.topology.restart(persist=persist, down_s=down_s)

    @property
    def streams(self) -> list[str]:
        """The interactive request stream of the test model in every shard."""
        return [shard.request_stream(MODEL) for shard in self.layout.shards]

    def pending(self) -> list[dict]:
        """The group's pending entries of every shard's stream: message_id, consumer, times_delivered, stream."""
        entries = []
        for stream in self.streams:
            try:
                found = self.admin.xpending_range(stream, REQUEST_GROUP, min="-", max="+", count=1000)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            entries += [{**entry, "stream": stream} for entry in found]
        return entries

    def holders(self) -> dict[str, int]:
        """Worker id -> how many entries it holds."""
        counts: dict[str, int] = {}
        for entry in self.pending():
            consumer = entry["consumer"].decode()
            counts[consumer] = counts.get(consumer, 0) + 1
        return counts

    def holder_by_request(self) -> dict[str, str]:
        """Request id -> the worker holding its entry, for the entries pending now."""
        held = {}
        for entry in self.pending():
            for _, fields in self.admin.xrange(entry["stream"], entry["message_id"], entry["message_id"]):
                with contextlib.suppress(Exception):
                    held[protocol.decode_map(fields[b"msg"])["id"]] = entry["consumer"].decode()
        return held

    def group_exists(self) -> bool:
        try:
            return all(
                any(group["name"] == REQUEST_GROUP.encode() for group in self.admin.xinfo_groups(stream))
                for stream in self.streams
            )
        except ResponseError:
            return False

    def heartbeating(self, names: list[str] | None = None) -> bool:
        names = self.workers if names is None else names
        return all(self.admin.exists(self.layout.home.worker_key(name)) for name in names)

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        return [fields for shard in self.layout.shards for _, fields in self.admin.xrange(shard.dead_letter_stream)]

    def entries_added(self, stream: str) -> int:
        """How many entries a stream ever got (XINFO STREAM, Redis 7): workers delete finished ones."""
        try:
            return int(self.admin.xinfo_stream(stream)["entries-added"])
        except ResponseError:  # no such key
            return 0

    def reply_events(self, key: str) -> list[tuple[str, dict]]:
        """(stream entry id, event) of each event on a reply stream, in order."""
        return [(entry_id.decode(), protocol.decode_map(fields[b"msg"])) for entry_id, fields in self.admin.xrange(key)]

    # ------------------------------------------------------------ readiness

    def gateway_ready(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def clean(self) -> bool:
        """Nothing waiting, nothing pending, the group there, every process alive and announced."""
        try:
            return (
                self.redis_alive()
                and all(self.processes.alive(name) for name in self.workers + self.gateways)
                and self.group_exists()
                and self.waiting() == 0
                and not self.pending()
            )
        except RedisError:
            return False

    def waiting(self) -> int:
        """Entries left in every shard's request stream (workers delete finished ones)."""
        return sum(self.admin.xlen(stream) for stream in self.streams)

    async def prepare(self) -> None:
        """Before a test: the stack whole (restarted from scratch on an emptied Redis if a test left it
        broken), the test keys and dead letters gone, `spec.workers` workers heartbeating and every
        gateway ready."""
        self.topology.start()
        if self.workers and not self.clean():
            self.reset()
        self.topology.delete_test_keys()
        while len(self.workers) < self.spec.workers:
            self.start_worker()
        while len(self.gateways) < self.spec.gateways:
            self.start_gateway()
        await self.wait_ready()

    async def wait_drained(self, timeout: float) -> None:
        """Until every shard's request stream is empty and nothing is pending: what ran across a fault
        finished, or was claimed and finished."""
        await eventually(
            lambda: self.waiting() == 0 and not self.pending(),
            "every request stream empty, nothing pending",
            timeout,
            self,
        )

    async def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        def ready() -> bool:
            self.assert_alive()
            return self.heartbeating() and all(self.gateway_ready(url) for url in self.urls)

        await eventually(ready, f"{self.spec.name}: workers heartbeating and gateways ready", timeout, self)

    def reset(self) -> None:
        """Kill every lmq process and empty Redis: the next `prepare()` starts anew."""
        self.processes.kill_all()
        self.workers.clear()
        self.gateways.clear()
        self.topology.flush()

    def close(self) -> None:
        self.processes.kill_all()
        self.admin.close()
        if self._owns_topology:
            self.topology.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# ---------------------------------------------------------------- a client's view of one stream


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@dataclass
class ChatStream:
    """One streaming chat completion, read as raw server-sent events."""

    base_url: str
    prompt: str
    max_tokens: int = MAX_TOKENS
    status: int | None = None
    request_id: str | None = None  # the `id` of the chunks: the request's id in the protocol
    text: str = ""
    chunks: int = 0  # chunks that carried text
    finish_reason: str | None = None
    usage: dict | None = None
    done_marker: bool = False  # `data: [DONE]` arrived
    error: str | None = None  # what made the failure visible: a status, an error event, a dropped connection
    hung: bool = False  # the client gave up waiting: neither an answer nor an error came
    after_done: list[str] = field(default_factory=list)  # anything sent after [DONE]

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": chat_messages(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def run(self, session: aiohttp.ClientSession, timeout: float = CLIENT_TIMEOUT_S) -> ChatStream:
        try:
            async with asyncio.timeout(timeout):
                async with session.post(f"{self.base_url}/v1/chat/completions", json=self.body()) as response:
                    self.status = response.status
                    if response.status != 200:
                        self.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                        return self
                    async for line in response.content:
                        self._line(line.decode("utf-8").rstrip("\r\n"))
        except TimeoutError:
            self.hung = True
        except aiohttp.ClientError as exc:
            self.error = self.error or f"connection: {exc!r}"
        return self

    def _line(self, line: str) -> None:
        if not line.startswith("data:"):
            return  # blank separators, `: waiting` keep-alives
        data = line[len("data:") :].strip()
        if self.done_marker or self.error:
            self.after_done.append(data)
            return
        if data == "[DONE]":
            self.done_marker = True
            return
        chunk = json.loads(data)
        self.request_id = self.request_id or chunk.get("id")
        if "error" in chunk:
            self.error = f"error event: {json.dumps(chunk['error'])}"
            return
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.text += content
                self.chunks += 1
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def describe(self) -> str:
        return (
            f"stream {self.prompt!r}: status={self.status} text={self.text!r} finish={self.finish_reason} usage={self.usage} "
            f"[DONE]={self.done_marker} error={self.error} hung={self.hung} after_done={self.after_done[:3]}"
        )

    # ------------------------------------------------------------ what the promise allows

    def is_exact(self, expected: str) -> bool:
        return (
            self.error is None
            and not self.hung
            and self.done_marker
            and not self.after_done
            and self.finish_reason == "length"
            and self.usage is not None
            and self.usage.get("completion_tokens") == self.max_tokens
            and self.text == expected
        )

    def assert_exact(self, expected: str, context: str = "") -> None:
        assert self.is_exact(expected), (
            f"expected the whole answer exactly once\n{self.describe()}\nexpected text={expected!r}\n{context}"
        )

    def assert_exact_or_visible_error(self, expected: str, context: str = "") -> str:
        """The whole answer exactly once, or an error the client can see, after nothing but a
        prefix of the answer: never a hang, a hole, a duplicate or a silent cut. Returns which."""
        assert not self.hung, (
            f"the stream hung: no answer, no error within {CLIENT_TIMEOUT_S} s\n{self.describe()}\n{context}"
        )
        if self.error is not None:
            assert expected.startswith(self.text), (
                f"text with a hole or a duplicate before the error\n{self.describe()}\nexpected text={expected!r}\n{context}"
            )
            assert not self.after_done, f"events after the error\n{self.describe()}\n{context}"
            return "error"
        assert self.is_exact(expected), (
            f"no visible error, so the whole answer exactly once (text, finish 'length', usage of {self.max_tokens} tokens, [DONE])\n"
            f"{self.describe()}\nexpected text={expected!r}\n{context}"
        )
        return "exact"


def client_session() -> aiohttp.ClientSession:
    """Each request on its own connection, so a test's disconnect closes just that one."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))


async def streaming(
    stack: Stack,
    streams: list[ChatStream],
    tasks: list[asyncio.Task],
    chunks: int,
    also: Callable[[], bool] = lambda: True,
) -> None:
    """Wait until every stream has `chunks` text chunks (and `also()`): the moment to inject a
    fault. A stream that ended before it fails the test here, with what it got."""

    def ready() -> bool:
        early = [s.describe() for s, t in zip(streams, tasks) if t.done()]
        assert not early, "a stream ended before the fault:\n" + "\n".join(early) + f"\n{stack.log_tails()}"
        return all(s.chunks >= chunks for s in streams) and also()

    await eventually(ready, f"{chunks} text chunks on every stream", 30, stack)


async def stream_all(session: aiohttp.ClientSession, streams: list[ChatStream]) -> list[ChatStream]:
    return list(await asyncio.gather(*(s.run(session) for s in streams)))


async def through_a_fault(
    stack: Stack,
    expected: dict[str, Expected],
    fault: Callable[[list[ChatStream]], Awaitable[None]],
    chunks: int = 2,
) -> list[ChatStream]:
    """A stream of each prompt of `expected` over the stack's gateways, `fault(streams)` once every one
    shows `chunks` text chunks; the streams, once all have ended (each within the client's timeout)."""
    async with client_session() as session:
        streams = [ChatStream(stack.urls[i % len(stack.urls)], prompt) for i, prompt in enumerate(expected)]
        tasks = [asyncio.create_task(stream.run(session)) for stream in streams]
        try:
            await streaming(stack, streams, tasks, chunks)
            await fault(streams)
        finally:
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), CLIENT_TIMEOUT_S + 10)
    return streams


def inexact(streams: list[ChatStream], expected: dict[str, Expected]) -> list[str]:
    """The streams that did not end with exactly their undisturbed text, described."""
    return [stream.describe() for stream in streams if not stream.is_exact(expected[stream.prompt].text)]


async def assert_serves_exactly_again(stack: Stack, pool: PromptPool, after: str, streams: int = 4) -> None:
    """After a fault (`after` names it): every process alive and ready, and fresh streams exact."""
    stack.assert_alive()
    await stack.wait_ready(timeout=30)
    fresh = pool.take(streams)
    async with client_session() as session:
        ended = await stream_all(session, [ChatStream(stack.urls[0], prompt) for prompt in fresh])
    problems = [f"{after}: {problem}" for problem in inexact(ended, fresh)]
    assert not problems, "\n".join(problems) + f"\n{stack.log_tails()}"


# ---------------------------------------------------------------- foreign producers (reply streams)


def foreign_request(
    request_id: str,
    prompt: str,
    reply_key: str,
    *,
    reply_kind: str = "stream",
    max_tokens: int = MAX_TOKENS,
    **sampling: Any,
) -> dict[str, Any]:
    """A request map as another service would write it (plain dict, msgpack'd by the caller)."""
    return {
        "v": 1,
        "id": request_id,
        "model": MODEL,
        "reply": {"kind": reply_kind, "key": reply_key},
        "messages": chat_messages(prompt),
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **sampling},
        "deadline": time.time() + 60,
    }


def delta_tokens(events: list[dict]) -> list[int]:
    """Every delta's token ids in arrival order, nothing dropped: a duplicate shows as extra tokens."""
    return [token for event in events if event.get("type") == "delta" for token in event["token_ids"]]


def assert_contiguous(events: list[dict], what: str) -> None:
    """Each delta starts where the previous ones ended (no overlap, no gap), seq strictly increases,
    and exactly one terminal event comes, last."""
    streamed = 0
    seqs = [event["seq"] for event in events if event.get("type") in ("delta", "done", "error")]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), f"{what}: seq not strictly increasing: {seqs}"
    for event in events:
        if event.get("type") == "delta":
            assert event["offset"] == streamed, (
                f"{what}: delta at offset {event['offset']} after {streamed} tokens: {_short(events)}"
            )
            streamed += len(event["token_ids"])
    ends = [i for i, event in enumerate(events) if event.get("type") in ("done", "error")]
    assert len(ends) == 1 and ends[0] == max(
        i for i, e in enumerate(events) if e.get("type") in ("delta", "done", "error")
    ), f"{what}: not exactly one final event, last: {_short(events)}"


def _short(events: list[dict]) -> list:
    return [
        (
            e.get("type"),
            e.get("seq"),
            e.get("offset"),
            len(e.get("token_ids") or []),
            e.get("code") or e.get("finish_reason"),
        )
        for e in events
    ]


# ---------------------------------------------------------------- the undisturbed answers


@dataclass(frozen=True)
class Expected:
    text: str
    token_ids: list[int]
    text_steps: int  # steps whose output carried text: a client sees that many chunks


async def expected_answers(
    model, prompts: list[str], max_tokens: int = MAX_TOKENS, **sampling: Any
) -> dict[str, Expected]:
    """Each prompt's greedy answer from an undisturbed run of the engine in this process, as a
    worker renders it (chat template) and samples it (float32 greedy: the same in any batch)."""
    params = protocol.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    ids = {f"expected-{i}": prompt for i, prompt in enumerate(prompts)}
    texts: dict[str, list[str]] = {request_id: [] for request_id in ids}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    ended: set[str] = set()

    def on_step(outputs: list[SeqOutput]) -> None:
        for output in outputs:
            texts[output.id].append(output.text)
            tokens[output.id] += output.token_ids
            if output.finish_reason is not None:
                assert output.finish_reason == "length", output
                ended.add(output.id)
        if len(ended) == len(ids):
            engine.stop()

    engine = Engine(model, kv_memory_bytes=16 << 20, max_seqs=len(ids), on_step=on_step)
    for request_id, prompt in ids.items():
        prompt_ids = build_prompt_ids(model, messages=chat_messages(prompt), max_tokens=max_tokens, truncate=False)
        engine.add(GenRequest(request_id, prompt_ids, params))
    await asyncio.wait_for(engine.run(), 30)
    answers = {}
    for request_id, prompt in ids.items():
        assert len(tokens[request_id]) == max_tokens, (prompt, tokens[request_id])
        answers[prompt] = Expected(
            "".join(texts[request_id]), tokens[request_id], sum(1 for text in texts[request_id] if text)
        )
    return answers


class PromptPool:
    """Prompts whose answers from the tiny model stream text at most steps, with those answers.

    The tiny model's random weights often answer with bytes that are no UTF-8: the detokenizer
    holds such text back and a client sees it in one piece at the end. A test that injects its
    fault once every stream showed some text needs answers that show text as they go. `take(n)`
    hands out the next n (round the pool again when it runs out: the same prompt twice is fine)."""

    def __init__(self, answers: dict[str, Expected], held_back: dict[str, Expected]):
        self.answers = answers
        self.prompts = list(answers)
        self.held_back = held_back  # answers whose text is mostly bytes that are no UTF-8, held back till the end
        self._next = 0

    @classmethod
    async def build(cls, model, size: int = 16, candidates: int = 40) -> PromptPool:
        answers = await expected_answers(
            model, [f"Fault {i}: the quick brown fox jumps over the lazy dog." for i in range(candidates)]
        )
        best = sorted(answers, key=lambda prompt: -answers[prompt].text_steps)[:size]
        assert answers[best[-1]].text_steps >= 8, (
            f"too few prompts that stream text: {[answers[p].text_steps for p in best]}"
        )
        held_back = [p for p in answers if "\ufffd" in answers[p].text and answers[p].text_steps <= 4]
        return cls({prompt: answers[prompt] for prompt in best}, {prompt: answers[prompt] for prompt in held_back[:2]})

    def take(self, n: int) -> dict[str, Expected]:
        taken = {}
        while len(taken) < n:
            prompt = self.prompts[self._next % len(self.prompts)]
            self._next += 1
            taken[prompt] = self.answers[prompt]
        return taken
