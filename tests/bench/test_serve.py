"""The load generator (bench/service/serve.py) against a real local HTTP server that speaks OpenAI's streaming chat.

The server counts one token per whitespace-separated word (plus a fixed cost per message, like a chat
template), streams one chunk per output token, and records every body it receives. No timing asserts.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from bench.harness.client import is_loopback
from bench.harness.prompts import STAND_IN_SYSTEM
from bench.harness.stats import RequestResult, percentile, summarize
from bench.service import serve

TEMPLATE_TOKENS = 3
TOKENS_PER_MESSAGE = 4
NATURAL_ANSWER = 3  # output tokens when the client does not ask for ignore_eos


def count_prompt_tokens(messages: list[dict]) -> int:
    return TEMPLATE_TOKENS + sum(TOKENS_PER_MESSAGE + len(m["content"].split()) for m in messages)


class FakeOpenAI:
    """stall: "models" never answers GET /models, "stream" never answers a streamed request (until `release`)."""

    def __init__(self, fail_every: int = 0, token_delay_s: float = 0.0, stall: str = ""):
        self.fail_every = fail_every
        self.token_delay_s = token_delay_s
        self.stall = stall
        self.release = asyncio.Event()  # set at teardown, so that stalled handlers end
        self.probes: list[list[dict]] = []
        self.streams: list[dict] = []
        self.started = self.answered = 0  # requests that reached a handler / that it finished

    @web.middleware
    async def count(self, request: web.Request, handler):
        self.started += 1
        try:
            return await handler(request)
        finally:
            self.answered += 1

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.count])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def models(self, request: web.Request) -> web.Response:
        if self.stall == "models":
            await self.release.wait()
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt_tokens = count_prompt_tokens(body["messages"])
        if not body.get("stream"):
            self.probes.append(body["messages"])
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
            message = {"role": "assistant", "content": "ok"}
            return web.json_response(
                {"choices": [{"index": 0, "message": message, "finish_reason": "length"}], "usage": usage}
            )
        self.streams.append(body)
        if self.stall == "stream":
            await self.release.wait()
        if self.fail_every and len(self.streams) % self.fail_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return await self.stream(request, body, prompt_tokens)

    async def stream(self, request: web.Request, body: dict, prompt_tokens: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = body["max_tokens"] if body.get("ignore_eos") else min(NATURAL_ANSWER, body["max_tokens"])

        async def send(chunk: dict | str) -> None:
            data = chunk if isinstance(chunk, str) else json.dumps(chunk)
            await response.write(f"data: {data}\n\n".encode())

        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(count):
            await asyncio.sleep(self.token_delay_s)
            await send({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]})
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        await send({"choices": [], "usage": usage})
        await send("[DONE]")
        return response


SERVING: list[FakeOpenAI] = []  # the fake server of the running test, for failure reports


@pytest.fixture
async def fake_server(request):
    fake = FakeOpenAI(**getattr(request, "param", {}))
    SERVING.append(fake)
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}/v1"
    SERVING.remove(fake)
    fake.release.set()
    await runner.cleanup()


# The fake server answers at once, so every bound below is for a broken run only. The load generator's
# own timeouts come first and turn a stalled request into a reported error; the thread's deadline is
# the backstop, well inside pytest-timeout's 300 s.
PROBE_TIMEOUT_S = 30.0
LEVEL_TIMEOUT_S = 60.0
RUN_DEADLINE_S = 150.0


async def run_cli(args: list[str]) -> tuple[int, dict]:
    """serve.main in a thread (it runs its own event loop), returning its exit code and JSON report.

    The thread is a daemon thread of its own, not the event loop's shared executor: if serve.main ever
    hangs, this fails after RUN_DEADLINE_S with the thread's stack, and the stuck thread neither takes
    an executor slot from later tests nor keeps the interpreter from exiting.
    """
    defaults = {"--probe-timeout": str(PROBE_TIMEOUT_S), "--level-timeout": str(LEVEL_TIMEOUT_S)}
    args = [*args, *(item for flag, value in defaults.items() if flag not in args for item in (flag, value))]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "report.json"
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[int] = loop.create_future()

        def settle(code: int | None, error: BaseException | None) -> None:
            if finished.done():
                return
            if error is not None:
                finished.set_exception(error)
            else:
                finished.set_result(code)

        def target() -> None:
            try:
                code = serve.main([*args, "--json", str(out)])
            except BaseException as error:  # noqa: BLE001 - handed to the test, which raises it
                loop.call_soon_threadsafe(settle, None, error)
            else:
                loop.call_soon_threadsafe(settle, code, None)

        thread = threading.Thread(target=target, name="bench-serve", daemon=True)
        thread.start()
        try:
            code = await asyncio.wait_for(asyncio.shield(finished), RUN_DEADLINE_S)
        except TimeoutError:
            frame = sys._current_frames().get(thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the thread has ended)"
            error = AssertionError(
                f"bench/service/serve.py did not finish within {RUN_DEADLINE_S} s; its thread is at:\n{stack}"
            )
            _describe_the_server(error)
            raise error from None
        except BaseException as error:
            _describe_the_server(error)
            raise
        return code, json.loads(out.read_text())


def _describe_the_server(error: BaseException) -> None:
    """Note on a failure what the fake server saw and what else this event loop runs and watches.

    (A request that never reaches a handler while the loop runs means the loop never saw its socket:
    one way is a selector entry left behind for a file descriptor closed and then reused.)
    """
    for fake in SERVING:
        error.add_note(f"the fake server: {fake.started} requests reached a handler, {fake.answered} were answered")
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    error.add_note(f"other tasks on the test's event loop: {[task.get_coro() for task in others][:20]}")
    try:
        watched = []
        for fd, key in asyncio.get_running_loop()._selector.get_map().items():  # private: diagnostics only
            for handle in filter(None, key.data or ()):
                owner = getattr(getattr(handle, "_callback", None), "__self__", None)
                sock = getattr(owner, "_sock", None)
                watched.append(
                    f"fd {fd}: {type(owner).__name__}"
                    + ("" if sock is None or sock.fileno() == fd else f" STALE (its socket is now fd {sock.fileno()})")
                )
        error.add_note(f"file descriptors the loop watches: {watched}")
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the failure
        error.add_note(f"(could not list the loop's selector: {exc!r})")


def test_percentile_matches_numpy():
    rng = random.Random(7)
    for size in (1, 2, 5, 20, 101):
        values = [rng.uniform(0, 10) for _ in range(size)]
        for q in (0, 50, 95, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_summarize_figures():
    results = [
        RequestResult(start=0.0, first_token=0.1, end=1.1, output_tokens=11),  # TPOT 0.1 s
        RequestResult(start=0.0, first_token=0.3, end=2.3, output_tokens=11),  # TPOT 0.2 s
        RequestResult(start=0.0, end=0.5, error="HTTP 503: busy"),
    ]
    level = summarize(2, results, wall_s=2.0)
    assert level["completed"] == 2 and level["errors"] == 1
    assert level["error_samples"] == ["HTTP 503: busy"]
    assert level["ttft_median_s"] == pytest.approx(0.2)
    assert level["tpot_median_s"] == pytest.approx(0.15)
    assert level["stream_tok_s_median"] == pytest.approx(7.5)
    assert level["output_tok_s"] == pytest.approx(11.0)
    assert level["req_s"] == pytest.approx(1.0)


def test_loopback_detection():
    assert is_loopback("http://127.0.0.1:8000/v1")
    assert is_loopback("http://localhost:8000/v1")
    assert is_loopback("http://[::1]:8000/v1")
    assert is_loopback("http://127.3.2.1/v1")
    assert not is_loopback("http://10.0.0.5:8000/v1")
    assert not is_loopback("https://api.example.com/v1")


def test_remote_target_is_refused_without_allow_remote():
    with pytest.raises(SystemExit, match="allow-remote"):
        serve.main(["--url", "http://192.0.2.1:8000/v1", "--requests", "1"])


def test_bad_arguments_are_rejected():
    parser = serve.build_parser()
    for bad in (["--concurrency", "0,4"], ["--concurrency", "x"], ["--prompt-tokens", "60-50"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert parser.parse_args(["--prompt-tokens", "50-60", "--concurrency", "1,4"]).concurrency == [1, 4]


async def test_levels_prompts_and_report(fake_server):
    fake, url = fake_server
    code, report = await run_cli(["--url", url, "--concurrency", "1,3", "--requests", "2", "--warmup", "1",
                                  "--max-tokens", "6", "--ignore-eos"])  # fmt: skip
    assert code == 0
    assert report["model"] == "fake-model"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    assert [lv["completed"] for lv in report["levels"]] == [2, 3]  # a level runs at least one request per stream
    assert all(lv["errors"] == 0 and lv["output_tokens"] == 6 * lv["completed"] for lv in report["levels"])
    assert all(lv["tpot_median_s"] is not None and lv["output_tok_s"] > 0 for lv in report["levels"])

    sent = [body["messages"] for body in fake.streams]
    assert len(sent) == 1 + 2 + 3
    assert len({json.dumps(m) for m in sent}) == len(sent), "every request carries a distinct prompt"
    assert all(50 <= count_prompt_tokens(m) <= 60 for m in sent)
    assert all(lv["prompt_tokens"]["min"] >= 50 and lv["prompt_tokens"]["max"] <= 60 for lv in report["levels"])
    assert all(body["ignore_eos"] is True and body["max_tokens"] == 6 for body in fake.streams)
    assert not any(m in fake.probes for m in sent), "a probe must never warm the target's cache with a real prompt"


async def test_without_ignore_eos_the_server_decides_the_length(fake_server):
    fake, url = fake_server
    code, report = await run_cli(
        ["--url", url, "--concurrency", "2", "--requests", "2", "--warmup", "0", "--max-tokens", "6"]
    )
    assert code == 0
    assert report["levels"][0]["output_tokens"] == 2 * NATURAL_ANSWER
    assert all("ignore_eos" not in body for body in fake.streams)


@pytest.mark.parametrize("fake_server", [{"fail_every": 2}], indirect=True)
async def test_failed_requests_are_counted(fake_server):
    fake, url = fake_server
    code, report = await run_cli(
        ["--url", url, "--concurrency", "2", "--requests", "4", "--warmup", "0", "--max-tokens", "3"]
    )
    level = report["levels"][0]
    assert code == 0
    assert (level["completed"], level["errors"]) == (2, 2)
    assert level["error_samples"][0].startswith("HTTP 503")


@pytest.mark.parametrize("fake_server", [{"token_delay_s": 0.2}], indirect=True)
async def test_level_timeout_bounds_the_run(fake_server):
    fake, url = fake_server
    code, report = await run_cli(["--url", url, "--concurrency", "2", "--requests", "2", "--warmup", "0",
                                  "--max-tokens", "50", "--ignore-eos", "--level-timeout", "0.5"])  # fmt: skip
    level = report["levels"][0]
    assert code == 1  # nothing completed
    assert level["errors"] == 2
    assert all("timeout" in sample.lower() for sample in level["error_samples"])


@pytest.mark.parametrize("mode", ["shared", "unique"])
async def test_system_prefix_modes(fake_server, mode):
    fake, url = fake_server
    code, report = await run_cli(["--url", url, "--concurrency", "2", "--requests", "3", "--warmup", "0", "--max-tokens", "2",
                                  "--shared-prefix-tokens", "80", "--prefix-mode", mode])  # fmt: skip
    assert code == 0
    systems = [body["messages"][0] for body in fake.streams]
    assert all(s["role"] == "system" and s != STAND_IN_SYSTEM for s in systems)
    assert all(abs(len(s["content"].split()) + TOKENS_PER_MESSAGE - 80) <= 6 for s in systems)
    assert len({s["content"] for s in systems}) == (1 if mode == "shared" else len(systems))


@pytest.mark.parametrize("fake_server", [{"stall": "models"}], indirect=True)
async def test_a_target_that_never_answers_is_a_prompt_error_not_a_hang(fake_server):
    fake, url = fake_server
    with pytest.raises(RuntimeError, match="no answer within 0.5 s"):
        await run_cli(
            ["--url", url, "--concurrency", "1", "--requests", "1", "--warmup", "0", "--probe-timeout", "0.5"]
        )


@pytest.mark.parametrize("fake_server", [{"stall": "stream"}], indirect=True)
async def test_streams_that_never_answer_are_cut_by_the_level_timeout(fake_server):
    fake, url = fake_server
    code, report = await run_cli(["--url", url, "--concurrency", "2", "--requests", "3", "--warmup", "1",
                                  "--max-tokens", "4", "--level-timeout", "0.5"])  # fmt: skip
    [level] = report["levels"]
    assert code == 1  # nothing completed
    assert (level["completed"], level["errors"]) == (0, 3)
    assert all("timeout" in sample.lower() for sample in level["error_samples"])
