"""The step script's hand-made msgpack, held to msgpack's own bytes (worker/step_script.py)."""

from __future__ import annotations

import msgpack
import pytest

from protocol import decode_event_batch, delta_event, encode, encode_event_batch
from worker.step_script import ARRAY_HEADER_LUA, LUA


@pytest.mark.parametrize("count", [0, 1, 15, 16, 255, 256, 65_535, 65_536, 1 << 24])
async def test_the_scripts_array_header_is_msgpacks(redis_client, count):
    header = await redis_client.eval(ARRAY_HEADER_LUA + "return array_header(tonumber(ARGV[1]))", 0, count)
    assert header == msgpack.Packer().pack_array_header(count)


async def test_the_scripts_batch_is_the_protocols_encoding(redis_client):
    """The script's batch prefix and array header, then the events' bytes: what encode_event_batch makes."""
    start = LUA.index("local batch_prefix")
    prefix_line = LUA[start : LUA.index("\n", start)]
    script = ARRAY_HEADER_LUA + prefix_line + "\nreturn batch_prefix .. array_header(#ARGV) .. table.concat(ARGV)"
    for count in (1, 17):
        events = [delta_event(f"r{i}", 0, "x", [i], 0) for i in range(count)]
        batch = await redis_client.eval(script, 0, *(encode(event) for event in events))  # as the publisher sends them
        assert batch == encode_event_batch(events)
        assert decode_event_batch(batch) == events
