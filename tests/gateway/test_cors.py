"""CORS (`--allowed-origins`): off by default; preflights answered before auth; headers on every
answer to an allowed origin, streams and errors included; nothing for other origins."""

from __future__ import annotations

import argparse

import aiohttp

from gateway.config import GatewayConfig
from gateway.cors import parse_origins
from lmq.settings import build
from tests.support.gateway_harness import MODEL, running_gateway, words_script, worker_running

PAGE = "http://localhost:3000"
OTHER = "https://evil.example"
KEY = "sk-cors"


def preflight_headers(origin: str, headers: str | None = "authorization, content-type") -> dict[str, str]:
    result = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if headers is not None:
        result["Access-Control-Request-Headers"] = headers
    return result


def test_origins_are_read_from_the_environment_comma_separated() -> None:
    config = build(
        GatewayConfig,
        argparse.Namespace(),
        environ={"LMQ_ALLOWED_ORIGINS": "https://a.example, http://LOCALHOST:3000/ ,"},
    )
    assert config.allowed_origins == "https://a.example, http://LOCALHOST:3000/ ,"
    assert parse_origins(config.allowed_origins) == {"https://a.example", "http://localhost:3000"}
    assert GatewayConfig().allowed_origins == ""
    assert parse_origins("") == frozenset()


async def test_off_by_default_preflight_is_refused_and_no_headers_are_added(redis_url) -> None:
    async with running_gateway(redis_url) as url, aiohttp.ClientSession() as http:
        async with http.options(url + "/v1/chat/completions", headers=preflight_headers(PAGE)) as response:
            assert response.status == 405
            assert "Access-Control-Allow-Origin" not in response.headers
        async with http.get(url + "/v1/models", headers={"Origin": PAGE}) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers


async def test_a_preflight_from_an_allowed_origin_passes_before_auth(redis_url) -> None:
    async with (
        running_gateway(redis_url, allowed_origins=f"{PAGE}, https://other.example", api_keys=KEY) as url,
        aiohttp.ClientSession() as http,
    ):
        requested = "authorization, content-type, x-stainless-os"  # browser SDKs add headers of their own
        async with http.options(url + "/v1/chat/completions", headers=preflight_headers(PAGE, requested)) as response:
            assert response.status == 204  # no key: browsers never send one with a preflight
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Access-Control-Allow-Headers"] == requested
            assert int(response.headers["Access-Control-Max-Age"]) > 0
            assert "Origin" in response.headers["Vary"]
        async with http.options(url + "/v1/messages", headers=preflight_headers(PAGE, headers=None)) as response:
            assert response.status == 204
            allowed = {name.strip().lower() for name in response.headers["Access-Control-Allow-Headers"].split(",")}
            assert {"authorization", "content-type", "x-api-key", "anthropic-version", "x-request-id"} <= allowed


async def test_a_preflight_from_another_origin_gets_no_cors_headers(redis_url) -> None:
    async with running_gateway(redis_url, allowed_origins=PAGE, api_keys=KEY) as url, aiohttp.ClientSession() as http:
        async with http.options(url + "/v1/chat/completions", headers=preflight_headers(OTHER)) as response:
            assert response.status == 401  # as without CORS: the request reaches auth, and the browser blocks it
            assert not [name for name in response.headers if name.lower().startswith("access-control-")]
        async with http.get(
            url + "/v1/models", headers={"Origin": OTHER, "Authorization": f"Bearer {KEY}"}
        ) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers


async def test_answers_and_errors_to_an_allowed_origin_carry_the_headers(redis_url) -> None:
    async with running_gateway(redis_url, allowed_origins=PAGE, api_keys=KEY) as url, aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
            exposed = {name.strip().lower() for name in response.headers["Access-Control-Expose-Headers"].split(",")}
            assert {"x-request-id", "retry-after"} <= exposed
            assert response.headers["Vary"] == "Origin"
        async with http.get(url + "/v1/models", headers={"Origin": PAGE}) as response:
            assert response.status == 401  # the page can read why
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
        async with http.get(url + "/health") as response:
            assert "Access-Control-Allow-Origin" not in response.headers  # no Origin: not a CORS request


async def test_a_stream_carries_the_headers_and_any_origin_gets_a_star(redis_url, redis_client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        worker_running(redis_client, words_script(["Hello", " there"])),
        running_gateway(redis_url, allowed_origins="*") as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.options(url + "/v1/chat/completions", headers=preflight_headers("null")) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == "*"
        async with http.post(url + "/v1/chat/completions", json=body, headers={"Origin": OTHER}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            assert response.headers["Access-Control-Allow-Origin"] == "*"
            assert "Vary" not in response.headers
            text = await response.text()
        assert "Hello" in text and "[DONE]" in text
