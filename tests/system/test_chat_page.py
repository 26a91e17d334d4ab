"""The chat page at `/`: served as three public files, and driven in a real headless Chromium
against a gateway and a real worker on the tiny model (streaming, stats, multi-turn, Stop).

The browser test needs Playwright for Python (`pip install playwright`, in the `test` extra) and a
Chromium executable: Debian's (`apt-get install -y chromium`, /usr/bin/chromium) or the one named by
LMQ_CHROMIUM. Without either it is skipped. It never runs `playwright install` (a CDN download).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
from pathlib import Path

import aiohttp
import pytest

from tests.support.gateway_harness import REAL_MODEL, real_worker, running_gateway
from tests.support.worker_process import SlowModel

KEY = "sk-page"
LAST_ANSWER = ".message.assistant:last-of-type"


def chromium_executable() -> str | None:
    candidates = [
        os.environ.get("LMQ_CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ]
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def finished(worker, outcome: str) -> float:
    """Requests the worker finished with this outcome (whatever other labels the counter has)."""
    samples = [sample for metric in worker.metrics.finished.collect() for sample in metric.samples]
    return sum(
        sample.value for sample in samples if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome
    )


async def test_the_page_is_public_while_the_api_keeps_its_keys(redis_url) -> None:
    async with running_gateway(redis_url, api_keys=KEY) as url, aiohttp.ClientSession() as http:
        async with http.get(url + "/") as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            page = await response.text()
            assert "default-src 'self'" in response.headers["Content-Security-Policy"]
        assert set(re.findall(r'(?:src|href)="(/static/[\w.]+)"', page)) == {"/static/app.js", "/static/style.css"}
        texts = [page]
        for path, content_type in [("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")]:
            async with http.get(url + path) as response:
                assert response.status == 200 and response.content_type == content_type
                texts.append(await response.text())
        assert not [text for text in texts if "://" in text]  # nothing from elsewhere (no CDN)
        async with http.get(url + "/v1/models") as response:
            assert response.status == 401
        async with http.get(url + "/static/missing.js") as response:
            assert response.status == 401  # only the page's own files are public
        async with http.get(url + "/static/missing.js", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404


def save_artifact(png: bytes, tmp_path: Path, name: str) -> Path:
    """Write the screenshot under the test's tmp dir, and into $LMQ_TEST_ARTIFACTS when set."""
    path = tmp_path / name
    path.write_bytes(png)
    if os.environ.get("LMQ_TEST_ARTIFACTS"):
        folder = Path(os.environ["LMQ_TEST_ARTIFACTS"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(png)
    return path


@pytest.mark.timeout(90)
async def test_chat_in_a_real_browser_streams_counts_and_stops(redis_url, tiny, tmp_path) -> None:
    playwright = pytest.importorskip(
        "playwright.async_api", reason="Playwright is not installed: pip install playwright"
    )
    executable = chromium_executable()
    if executable is None:
        pytest.skip("no Chromium executable: apt-get install -y chromium (or set LMQ_CHROMIUM)")
    # Slow steps, so Stop lands mid-stream; no end-of-turn token, so answers run to max_tokens.
    model = dataclasses.replace(tiny, model=SlowModel(tiny.model, 0.03), stop_token_ids=frozenset())
    posted: list[dict] = []
    page_errors: list[str] = []
    async with (
        real_worker(redis_url, model) as worker,
        running_gateway(redis_url, api_keys=KEY) as url,
        playwright.async_playwright() as driver,
    ):
        browser = await driver.chromium.launch(executable_path=executable)
        page = await browser.new_page(viewport={"width": 1200, "height": 760})
        try:
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            page.on(
                "request",
                lambda request: (
                    posted.append(request.post_data_json) if request.url.endswith("/v1/chat/completions") else None
                ),
            )
            expect = playwright.expect
            await page.goto(url + "/")

            # The gateway has keys: the page says so, and lists the models once it has one.
            await expect(page.locator("#model-status")).to_contain_text("API key")
            await page.fill("#api-key", KEY)
            await page.locator("#api-key").dispatch_event("change")
            await expect(page.locator(f"#model option[value='{REAL_MODEL}']")).to_have_count(1)
            await page.select_option("#model", REAL_MODEL)
            await expect(page.locator("#model-status")).to_be_empty()
            assert await page.evaluate("localStorage.getItem('lmq.apiKey')") == KEY

            # First turn: streamed to the end, with its figures.
            await page.fill("#system", "You are terse.")
            await page.fill("#temperature", "0.7")
            await page.fill("#max-tokens", "12")
            await page.fill("#prompt", "Hello there")
            await page.press("#prompt", "Enter")
            first = page.locator(LAST_ANSWER)
            await expect(first).to_have_attribute("data-state", "length", timeout=30_000)
            first_text = await first.locator(".content").text_content()
            assert first_text.strip()
            figures = await first.locator("footer").text_content()
            assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tokens/s · 12 tokens · max tokens reached", figures), figures

            # Second turn, long (the tiny model's context is 256 tokens): Stop while text is arriving
            # and the figures are counting (two tokens in, so there is a rate).
            await page.fill("#max-tokens", "120")
            await page.fill("#prompt", "Tell me more")
            await page.click("#send")
            await page.wait_for_function(
                """() => { const answer = [...document.querySelectorAll('.message.assistant')].pop();
                           const state = answer.dataset.state, figures = answer.querySelector('footer').textContent;
                           return state !== 'waiting' && (state !== 'streaming' || figures.includes('tokens/s')); }""",
                timeout=30_000,
            )
            assert await page.locator(LAST_ANSWER).get_attribute("data-state") == "streaming"
            await page.click("#stop")
            second = page.locator(LAST_ANSWER)
            await expect(second).to_have_attribute("data-state", "stopped")
            await expect(second.locator("footer")).to_contain_text("stopped")
            await expect(second.locator("footer")).to_contain_text("tokens/s")
            await expect(page.locator("#send")).to_be_visible()
            await expect(page.locator("#stop")).to_be_hidden()

            # The worker cancelled the stopped request: it ended early and freed its pages.
            for _ in range(500):
                if not worker.engine.stats.running and finished(worker, "cancelled") >= 1:
                    break
                await asyncio.sleep(0.02)
            assert finished(worker, "cancelled") == 1 and not worker.engine.stats.running
            assert worker.engine.stats.kv_pages_used == 0
            assert finished(worker, "length") == 1  # only the first answer ran to its end

            screenshot = save_artifact(await page.screenshot(full_page=True), tmp_path, "chat-page.png")
            print(f"screenshot: {screenshot}")
        except BaseException:
            with contextlib.suppress(Exception):  # what the page showed, for the failure report
                save_artifact(await page.screenshot(full_page=True), tmp_path, "chat-page-failed.png")
                print(await page.locator("#messages").inner_html())
            raise
        finally:
            await browser.close()

    assert not page_errors
    # The second request carried the whole conversation, and asked for usage in the stream.
    assert len(posted) == 2
    first_body, second_body = posted
    assert first_body["stream"] is True and first_body["stream_options"] == {"include_usage": True}
    assert first_body["temperature"] == 0.7 and first_body["max_tokens"] == 12
    roles = [message["role"] for message in second_body["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert second_body["messages"][0]["content"] == "You are terse." and second_body["max_tokens"] == 120
    assert second_body["messages"][2]["content"] == first_text
