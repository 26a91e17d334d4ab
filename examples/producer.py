"""A producer in another service: enqueue a chat request straight into Redis, no gateway, no lmq import.

    python examples/producer.py --redis-url redis://localhost:6379/0 --reply stream "Tell me a joke"
    python examples/producer.py --reply pubsub --model SmolLM2-135M-Instruct "Hello"

It needs only `redis` and `msgpack`. The protocol it speaks is documented in docs/protocol.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import msgpack
import redis

PROTOCOL_VERSION = 1


def live_models(client: redis.Redis) -> list[str]:
    """The models that live workers serve, read from their heartbeat keys."""
    models = set()
    for key in client.scan_iter(match="lmq:worker:*"):
        beat = client.get(key)
        if beat:
            models.add(msgpack.unpackb(beat)["model"])
    return sorted(models)


def make_request(request_id: str, model: str, reply: dict, text: str, max_tokens: int, timeout_s: float) -> bytes:
    return msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "id": request_id,
            "model": model,
            "reply": reply,
            "messages": [{"role": "user", "content": text}],
            "sampling": {"max_tokens": max_tokens, "temperature": 0},
            "deadline": time.time() + timeout_s,
        }
    )


def ask_with_reply_stream(client: redis.Redis, model: str, text: str, max_tokens: int, timeout_s: float) -> dict:
    """Durable replies: the worker XADDs each event to a stream of our own; we read it from the start."""
    request_id = uuid.uuid4().hex
    reply_key = f"myapp:reply:{request_id}"
    client.xadd(
        f"lmq:req:{model}",
        {"msg": make_request(request_id, model, {"kind": "stream", "key": reply_key}, text, max_tokens, timeout_s)},
    )
    last_id, deadline = "0-0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, entries in client.xread({reply_key: last_id}, block=1000) or []:
            for last_id, fields in entries:  # noqa: B007 (last_id: where the next XREAD starts)
                event = msgpack.unpackb(fields[b"msg"])
                if handle(event):
                    client.delete(reply_key)
                    return event
    raise TimeoutError(f"no answer within {timeout_s} s")


def ask_with_pubsub(client: redis.Redis, model: str, text: str, max_tokens: int, timeout_s: float) -> dict:
    """Fast replies: subscribe to a channel BEFORE enqueueing; each message holds a list of events."""
    request_id = uuid.uuid4().hex
    channel = f"myapp:replies:{uuid.uuid4().hex}"  # one channel per process is enough: events carry their id
    pubsub = client.pubsub()
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=5)  # the subscription is confirmed: nothing can be missed now
    client.xadd(
        f"lmq:req:{model}",
        {"msg": make_request(request_id, model, {"kind": "pubsub", "key": channel}, text, max_tokens, timeout_s)},
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is None:
                continue
            for event in msgpack.unpackb(message["data"])["events"]:
                if event["id"] == request_id and handle(event):
                    return event
    finally:
        pubsub.close()
    raise TimeoutError(f"no answer within {timeout_s} s")


def handle(event: dict) -> bool:
    """Print text as it arrives; True once the request is over."""
    if event["type"] == "delta":
        print(event["text"], end="", flush=True)
        return False
    print(flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://localhost:6379/0"))
    parser.add_argument("--model", help="default: the first model a live worker serves")
    parser.add_argument("--reply", choices=["stream", "pubsub"], default="stream")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    client = redis.Redis.from_url(args.redis_url)
    model = args.model or next(iter(live_models(client)), None)
    if model is None:
        print("no live worker found", file=sys.stderr)
        return 2
    ask = ask_with_reply_stream if args.reply == "stream" else ask_with_pubsub
    final = ask(client, model, args.text, args.max_tokens, args.timeout)
    if final["type"] == "error":
        print(f"error {final['code']}: {final['message']}", file=sys.stderr)
        return 1
    print(f"[{final['finish_reason']}; usage {final['usage']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
