"""The load generator (bench/serve.py) against a real local HTTP server that speaks OpenAI's streaming chat.

The server counts one token per whitespace-separated word (plus a fixed cost per message, like a chat
template), streams one chunk per output token, and records every body it receives. No timing asserts.
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
from aiohttp import web

from bench import serve
from bench.client import is_loopback
from bench.prompts import STAND_IN_SYSTEM
from bench.stats import RequestResult, percentile, summarize

TEMPLATE_TOKENS = 3
TOKENS_PER_MESSAGE = 4
NATURAL_ANSWER = 3  # output tokens when the client does not ask for ignore_eos


def count_prompt_tokens(messages: list[dict]) -> int:
    return TEMPLATE_TOKENS + sum(TOKENS_PER_MESSAGE + len(m["content"].split()) for m in messages)


class FakeOpenAI:
    def __init__(self, fail_every: int = 0, token_delay_s: float = 0.0):
        self.fail_every = fail_every
        self.token_delay_s = token_delay_s
        self.probes: list[list[dict]] = []
        self.streams: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt_tokens = count_prompt_tokens(body["messages"])
        if not body.get("stream"):
            self.probes.append(body["messages"])
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
            message = {"role": "assistant", "content": "ok"}
            return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "length"}], "usage": usage})
        self.streams.append(body)
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
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count, "prompt_tokens_details": {"cached_tokens": 0}}
        await send({"choices": [], "usage": usage})
        await send("[DONE]")
        return response


@pytest.fixture
async def fake_server(request):
    fake = FakeOpenAI(**getattr(request, "param", {}))
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def run_cli(args: list[str]) -> tuple[int, dict]:
    """serve.main in a thread (it runs its own event loop), returning its exit code and JSON report."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "report.json"
        code = await asyncio.to_thread(serve.main, [*args, "--json", str(out)])
        return code, json.loads(out.read_text())


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
    code, report = await run_cli(["--url", url, "--concurrency", "2", "--requests", "2", "--warmup", "0", "--max-tokens", "6"])
    assert code == 0
    assert report["levels"][0]["output_tokens"] == 2 * NATURAL_ANSWER
    assert all("ignore_eos" not in body for body in fake.streams)


@pytest.mark.parametrize("fake_server", [{"fail_every": 2}], indirect=True)
async def test_failed_requests_are_counted(fake_server):
    fake, url = fake_server
    code, report = await run_cli(["--url", url, "--concurrency", "2", "--requests", "4", "--warmup", "0", "--max-tokens", "3"])
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
