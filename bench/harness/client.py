"""Streaming chat completions over aiohttp, timed token by token (no SDK in the measured path)."""

from __future__ import annotations

import ipaddress
import json
import time
from urllib.parse import urlsplit

import aiohttp

from bench.harness.stats import RequestResult


def is_loopback(url: str) -> bool:
    """True for localhost and loopback addresses; names are not resolved (no DNS surprises)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ChatClient:
    """One target: base URL (…/v1), model name, optional API key; shares one aiohttp session.

    Every call is bounded: GET /models and the sizing probes by `probe_timeout_s`, a streamed request
    by the timeout its caller gives. (aiohttp's own default is 5 minutes, as long as a test's limit.)
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str = "",
        api_key: str = "",
        probe_timeout_s: float = 60.0,
    ):
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.probe_timeout_s = probe_timeout_s

    async def first_model(self) -> str:
        url = f"{self.base_url}/models"
        try:
            async with self.session.get(
                url, headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)
            ) as response:
                response.raise_for_status()
                return (await response.json())["data"][0]["id"]
        except TimeoutError:
            raise RuntimeError(f"GET {url}: no answer within {self.probe_timeout_s:g} s") from None

    async def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """usage.prompt_tokens of a one-token answer: the prompt's length after the chat template."""
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "stream": False}
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self.session.post(
                f"{self.base_url}/chat/completions", json=body, headers=self.headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    raise RuntimeError(f"probe failed: HTTP {response.status}: {(await response.text())[:200]}")
                usage = (await response.json()).get("usage") or {}
        except TimeoutError:
            raise RuntimeError(f"probe failed: no answer within {self.probe_timeout_s:g} s") from None
        if "prompt_tokens" not in usage:
            raise RuntimeError("the target reports no usage.prompt_tokens")
        return usage["prompt_tokens"]

    def chat_body(self, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool) -> dict:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True  # an extension that lmq and llama.cpp's server both accept
        return body

    async def stream_chat(self, body: dict, timeout_s: float) -> RequestResult:
        """Send one streaming request; never raises for a failed request, records the error instead."""
        result = RequestResult(start=time.perf_counter())
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.post(
                f"{self.base_url}/chat/completions", json=body, headers=self.headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                else:
                    await _read_stream(response, result)
        except Exception as error:  # noqa: BLE001 - any failure (HTTP, timeout, a malformed chunk) is this request's error
            result.error = f"{type(error).__name__}: {error}"[:200]
        result.end = time.perf_counter()
        return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    content_chunks = 0
    usage: dict = {}
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
            return
        if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or []):
            content_chunks += 1
            if result.first_token is None:
                result.first_token = time.perf_counter()
        usage = chunk.get("usage") or usage
    result.output_tokens = usage.get("completion_tokens", content_chunks)
    result.prompt_tokens = usage.get("prompt_tokens")
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
