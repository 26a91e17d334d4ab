"""What the batch tests share: a gateway with a real worker on the tiny model."""

from __future__ import annotations

import pytest

from tests.support.gateway_harness import real_worker, running_gateway


@pytest.fixture
async def url(redis_url, tiny):
    async with real_worker(redis_url, tiny), running_gateway(redis_url) as url:
        yield url
