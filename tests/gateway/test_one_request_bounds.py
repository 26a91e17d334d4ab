"""No single request's output can break another's: a /tokenize of a huge prompt beside running
streams (gateway and a real worker on the tiny model, real Redis). Its answer would be several MB:
it gets a 413 in the API's shape, and the streams of the same worker steps finish whole."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.support.gateway_harness import REAL_MODEL

STREAMS = 3
PROMPT = "The quick brown fox jumps over the lazy dog. " * 11_600  # 522 KB, as in issue 28


async def _stream(http: aiohttp.ClientSession, api_url: str, index: int, first_chunk: asyncio.Event) -> list[dict]:
    body = {
        "model": REAL_MODEL,
        "messages": [{"role": "user", "content": f"story {index}"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    chunks = []
    async with http.post(api_url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            if text == "data: [DONE]":
                chunks.append({"done": True})
                break
            chunks.append(json.loads(text[6:]))
            first_chunk.set()
    return chunks


@pytest.mark.slow  # a huge tokenize: seconds
async def test_a_huge_tokenize_beside_three_streams_fails_alone_and_the_streams_finish_intact(api_url):
    timeout = aiohttp.ClientTimeout(total=240)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(_stream(http, api_url, index, started[index])) for index in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
        async with http.post(
            api_url + "/tokenize", json={"model": REAL_MODEL, "prompt": PROMPT, "return_token_strs": True}
        ) as response:
            status, answer = response.status, await response.json()
        results = await asyncio.gather(*streams)
    assert status == 413, answer
    assert answer["error"]["code"] == "too_large" and "tokenize" in answer["error"]["message"]
    for chunks in results:
        assert "error" not in json.dumps(chunks)
        assert chunks[-1] == {"done": True}
        finishes = [
            choice["finish_reason"]
            for chunk in chunks[:-1]
            for choice in chunk.get("choices", [])
            if choice.get("finish_reason")
        ]
        assert finishes == ["length"]
        tokens = sum(
            1 for chunk in chunks[:-1] for choice in chunk.get("choices", []) if choice.get("delta", {}).get("content")
        )
        assert tokens > 0
