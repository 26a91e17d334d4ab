"""Raw HTTP against the gateway: every error before enqueue answers in the called API's shape."""

from __future__ import annotations

import aiohttp
import msgpack
import pytest

import protocol
from tests.support.gateway_harness import MODEL, announce, running_gateway, words_script, worker_running

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def chat_body(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def anthropic_body(**fields):
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.fixture
async def gateway_url(redis_url, redis_client):
    await announce(redis_client)
    async with running_gateway(redis_url, max_body_bytes=64 * 1024) as url:
        yield url


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http, url, body=None, **kwargs):
    async with http.post(url, json=body, **kwargs) as response:
        return response.status, await response.json(), response.headers


def assert_openai_error(status, body, expected_status, param=None):
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


def assert_anthropic_error(status, body, expected_status, kind):
    assert status == expected_status, body
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert body["error"]["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"n": 17}, "n"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"functions": []}, "functions"),
        ({"store": True}, "store"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        ({"stop": 7}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": "x"}, "seed"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        ({"model": 5}, "model"),
    ],
)
async def test_openai_bad_parameters_are_400_naming_the_field(gateway_url, http, fields, param):
    status, body, _ = await post(http, gateway_url + CHAT, chat_body(**fields))
    assert_openai_error(status, body, 400, param)


async def test_openai_missing_model_is_400(gateway_url, http):
    status, body, _ = await post(http, gateway_url + CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(status, body, 400, "model")


async def test_unknown_model_is_404_in_each_shape(gateway_url, http):
    status, body, _ = await post(http, gateway_url + CHAT, chat_body(model="gpt-4"))
    assert_openai_error(status, body, 404, "model")
    assert body["error"]["code"] == "model_not_found"
    status, body, _ = await post(http, gateway_url + MESSAGES, anthropic_body(model="claude-3"))
    assert_anthropic_error(status, body, 404, "not_found_error")


async def test_malformed_json_and_non_objects_are_400(gateway_url, http):
    async with http.post(
        gateway_url + CHAT, data=b"{not json", headers={"Content-Type": "application/json"}
    ) as response:
        assert_openai_error(response.status, await response.json(), 400)
    status, body, _ = await post(http, gateway_url + CHAT, [1, 2])
    assert_openai_error(status, body, 400)
    async with http.post(
        gateway_url + MESSAGES, data=b"\xff\xfe", headers={"Content-Type": "application/json"}
    ) as response:
        assert_anthropic_error(response.status, await response.json(), 400, "invalid_request_error")


async def test_wrong_content_type_is_415(gateway_url, http):
    async with http.post(gateway_url + CHAT, data="model=x") as response:
        assert_openai_error(response.status, await response.json(), 415)


async def test_oversized_body_is_413_in_each_shape(gateway_url, http):
    big = "x" * (100 * 1024)
    status, body, _ = await post(http, gateway_url + CHAT, chat_body(messages=[{"role": "user", "content": big}]))
    assert_openai_error(status, body, 413)
    status, body, _ = await post(
        http, gateway_url + MESSAGES, anthropic_body(messages=[{"role": "user", "content": big}])
    )
    assert_anthropic_error(status, body, 413, "request_too_large")


async def test_a_request_over_the_protocol_limits_is_413(redis_url, redis_client, http):
    await announce(redis_client)
    too_long = "x" * (protocol.messages.MAX_TEXT_CHARS + 1)  # within the body limit, over the protocol's
    async with running_gateway(redis_url) as url:
        status, body, _ = await post(http, url + CHAT, chat_body(messages=[{"role": "user", "content": too_long}]))
        assert_openai_error(status, body, 413)
        status, body, _ = await post(
            http, url + "/v1/completions", {"model": MODEL, "prompt": "fox", "stop": ["a"] * 17}
        )
        assert_openai_error(status, body, 400)
    assert not await redis_client.exists(protocol.request_stream(MODEL))  # nothing was enqueued


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": None},
        {"temperature": 1.5},
        {"top_k": -1},
        {"stop_sequences": "END"},
        {"system": 5},
        {"messages": [{"role": "system", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"thinking": {"type": "enabled"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1 << 20}},  # not fewer than max_tokens
        {"thinking": {"type": "adaptive"}},
        {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"}]}]},
        {"container": "c1"},
        {"tool_choice": {"type": "any"}},
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    ],
)
async def test_anthropic_bad_parameters_are_400(gateway_url, http, fields):
    status, body, _ = await post(http, gateway_url + MESSAGES, anthropic_body(**fields))
    assert_anthropic_error(status, body, 400, "invalid_request_error")


async def test_unknown_route_and_wrong_method_answer_in_shape(gateway_url, http):
    async with http.get(gateway_url + "/v1/nothing") as response:
        body = await response.json()
        assert_openai_error(response.status, body, 404)
        assert body["error"]["message"].startswith("no such endpoint: GET /v1/nothing")
    async with http.get(gateway_url + MESSAGES) as response:
        body = await response.json()
        assert_anthropic_error(response.status, body, 405, "invalid_request_error")
        assert body["error"]["message"] == f"{MESSAGES} does not take GET; it takes POST"


async def test_keys_are_required_when_configured(redis_url, redis_client, http, tmp_path):
    await announce(redis_client)
    key_file = tmp_path / "keys"
    key_file.write_text("# one key a line\nfile-key\n")
    async with running_gateway(redis_url, api_keys="k1, k2", api_keys_file=str(key_file)) as url:
        status, body, _ = await post(http, url + CHAT, chat_body(temperature=9))
        assert_openai_error(status, body, 401)
        status, body, _ = await post(
            http, url + CHAT, chat_body(temperature=9), headers={"Authorization": "Bearer wrong"}
        )
        assert_openai_error(status, body, 401)
        status, body, _ = await post(
            http, url + MESSAGES, anthropic_body(temperature=9), headers={"x-api-key": "wrong"}
        )
        assert_anthropic_error(status, body, 401, "authentication_error")
        # a right key gets past auth (to the validation error the bad temperature earns)
        for headers in ({"Authorization": "Bearer k2"}, {"x-api-key": "k1"}, {"Authorization": "Bearer file-key"}):
            status, body, _ = await post(http, url + CHAT, chat_body(temperature=9), headers=headers)
            assert_openai_error(status, body, 400, "temperature")
        async with http.get(url + "/health") as response:
            assert response.status == 200
        async with http.get(url + "/v1/models") as response:
            assert response.status == 401


async def test_full_queue_is_429_for_openai_and_529_for_anthropic(redis_url, redis_client, http):
    await announce(redis_client)
    async with running_gateway(redis_url, max_queue=2, retry_after=7) as url:
        stream = protocol.request_stream(MODEL)
        for _ in range(2):  # two requests waiting, none taken by a worker
            await redis_client.xadd(stream, {"msg": b"waiting"})
        status, body, headers = await post(http, url + CHAT, chat_body())
        assert_openai_error(status, body, 429)
        assert headers["Retry-After"] == "7"
        status, body, headers = await post(http, url + MESSAGES, anthropic_body())
        assert_anthropic_error(status, body, 529, "overloaded_error")
        assert headers["Retry-After"] == "7"
        assert await redis_client.xlen(stream) == 2  # nothing was added


async def test_health_ready_models_and_metrics(redis_url, redis_client, http):
    async with running_gateway(redis_url) as url:
        async with http.get(url + "/health") as response:
            assert response.status == 200
        async with http.get(url + "/ready") as response:
            assert response.status == 503  # no worker yet
        await announce(redis_client, "model-a", "w1")
        await announce(redis_client, "model-b", "w2")
        async with http.get(url + "/ready") as response:
            assert response.status == 200
            assert (await response.json())["models"] == ["model-a", "model-b"]
        async with http.get(url + "/v1/models") as response:
            body = await response.json()
            assert body["object"] == "list"
            assert [model["id"] for model in body["data"]] == ["model-a", "model-b"]
        async with http.get(url + "/v1/models", headers={"anthropic-version": "2023-06-01"}) as response:
            body = await response.json()
            assert [model["id"] for model in body["data"]] == ["model-a", "model-b"]
            assert body["data"][0]["type"] == "model"
        async with http.get(url + "/v1/models/model-b") as response:
            assert (await response.json())["id"] == "model-b"
        async with http.get(url + "/v1/models/model-c") as response:
            assert response.status == 404
        async with http.get(url + "/metrics") as response:
            text = await response.text()
            assert 'lmq_queue_depth{model="model-a"} 0.0' in text
            assert 'lmq_errors_total{code="model_not_found"} 1.0' in text
            assert "lmq_http_requests_total" in text


async def test_a_malformed_heartbeat_is_skipped_not_a_500(redis_url, redis_client, http):
    """A heartbeat key with `model` a list (anything that can write lmq:worker:* could write it):
    /ready, /v1/models and requests still answer from the good heartbeats."""
    await announce(redis_client, MODEL, "good")
    bad = {
        "v": 1,
        "worker_id": "evil",
        "model": ["x"],
        "capacity": 4,
        "running": 0,
        "waiting": 0,
        "kv_pages_used": 0,
        "kv_pages_total": 8,
        "time": 1.0,
    }
    await redis_client.set(protocol.worker_key("evil"), msgpack.packb(bad), ex=60)
    async with running_gateway(redis_url) as url:
        async with http.get(url + "/ready") as response:
            assert response.status == 200 and (await response.json())["models"] == [MODEL]
        async with http.get(url + "/v1/models") as response:
            assert response.status == 200 and [model["id"] for model in (await response.json())["data"]] == [MODEL]
        async with worker_running(redis_client, words_script(["Hi"])):
            async with http.post(
                url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            ) as response:
                assert response.status == 200, await response.text()
