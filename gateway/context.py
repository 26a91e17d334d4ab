"""The per-process state every handler uses, stored on the aiohttp application."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web

from protocol.keys import ShardLayout

from .config import GatewayConfig
from .metrics import Metrics
from .queue import RequestQueue
from .rate_limits import RateLimiter
from .replies import ReplyRouter
from .workers import ModelRegistry


@dataclass
class Gateway:
    config: GatewayConfig
    redis: aioredis.Redis
    replies: ReplyRouter
    queue: RequestQueue
    models: ModelRegistry
    metrics: Metrics
    shards: ShardLayout  # where keys live: one untagged shard, or K on a Redis Cluster (protocol/keys.py)
    limiter: RateLimiter | None = None  # the per-key limits, on a gateway with keys (rate_limits.py)


GATEWAY = web.AppKey("gateway", Gateway)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]
