"""Property: whatever bytes or maps arrive, the decoder answers a Request or a ProtocolError, nothing else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from protocol import ProtocolError, Request

FIELDS = [
    "v",
    "id",
    "model",
    "reply",
    "sampling",
    "deadline",
    "messages",
    "prompt",
    "prompt_ids",
    "truncate",
    "kind",
    "key",
    "role",
    "content",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "logit_bias",
    "seed",
]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20), st.sampled_from(["pubsub", "stream", "user", "r1"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=6)
    ),
    max_leaves=20,
)
maps = st.dictionaries(st.sampled_from(FIELDS), values, max_size=12)


def decode_or_refuse(raw: bytes) -> None:
    try:
        parsed = protocol.decode_request(raw)
    except ProtocolError as exc:
        assert exc.code in protocol.ERROR_CODES
        assert exc.reply is None or isinstance(exc.reply, protocol.Reply)
        return
    assert isinstance(parsed, Request)
    assert protocol.decode_request(parsed.encode()) == parsed


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(raw):
    decode_or_refuse(raw)


@pytest.mark.slow  # 500 examples: seconds
@settings(max_examples=500, deadline=None)
@given(maps)
def test_random_maps(data):
    decode_or_refuse(msgpack.packb(data, use_bin_type=True))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_as_event_batches_and_cancels(raw):
    for decode in (protocol.decode_event_batch, protocol.decode_cancel, protocol.decode_event):
        try:
            decode(raw)
        except ProtocolError:
            pass
