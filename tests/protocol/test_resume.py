"""The resume message (protocol/resume.py): strict, field-named validation, a cancel's token rules."""

from __future__ import annotations

import pytest

import protocol
from protocol import ProtocolError, encode
from protocol.resume import Resume, decode_resume, resume_message, resumed_event

TOKEN = "k" * 32


def test_a_resume_round_trips_with_the_digest_of_its_token():
    assert decode_resume(resume_message("req-1", 4, 7, TOKEN)) == Resume("req-1", 4, 7, protocol.cancel_digest(TOKEN))
    assert decode_resume(resume_message("req-1", -1, 0)) == Resume("req-1", -1, 0, None)


@pytest.mark.parametrize(
    "message, complaint",
    [
        ({"v": 1, "seq": 0, "offset": 0}, "id"),
        ({"v": 1, "id": "a b", "seq": 0, "offset": 0}, "id"),
        ({"v": 1, "id": "r", "offset": 0}, "seq: is required"),
        ({"v": 1, "id": "r", "seq": 0}, "offset: is required"),
        ({"v": 1, "id": "r", "seq": -2, "offset": 0}, "seq: must be between -1"),
        ({"v": 1, "id": "r", "seq": 0, "offset": -1}, "offset: must be between 0"),
        ({"v": 1, "id": "r", "seq": "1", "offset": 0}, "seq: must be an integer"),
        ({"v": 1, "id": "r", "seq": 0, "offset": 0, "token": "short"}, "token: must be at least 16"),
    ],
)
def test_a_malformed_resume_says_which_field_is_wrong(message, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode_resume(encode(message))


def test_the_resumed_event_is_an_event_readers_accept():
    event = resumed_event("req-1", 3, 9)
    assert protocol.decode_event(encode(event)) == event
