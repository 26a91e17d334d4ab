"""Resuming a stream whose reply subscription broke: the `lmq:resume` message and the `resumed` event.

Pub/sub keeps nothing for a subscriber that is away, so the events a worker published while a
consumer's subscription was down (a Redis restart, a Sentinel failover, a network cut) are gone;
the worker that holds the request still has them. Once subscribed again, the consumer publishes,
for each request it still waits on, `{v, id, seq, offset, token}` on `lmq:resume`: `seq` is the
last event it has of the request (-1 for none), `offset` the completion tokens it has relayed,
`token` the request's cancel token (required when the request names a `cancel_digest`, as for a
cancel: no one else can make a worker send a request's events again). The worker holding the
request (running, or ended within a minute) re-establishes what the Redis it now talks to may
lack (the entry's pending state, the holder and progress keys), sends again every event it sent
after `seq`, then one `resumed` event. docs/protocol.md ("Resuming after a broken subscription")
states the consumer's side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codec import decode_map, encode
from .messages import VERSION, _fail, _int, decode_cancel

RESUME_CHANNEL = "lmq:resume"  # published like lmq:cancel: on a cluster, PUBLISH reaches every node
MAX_SEQ = 1 << 62


@dataclass(frozen=True)
class Resume:
    """Send again the events of request `id` after event `seq`; `digest` as Cancel's (None: no token)."""

    id: str
    seq: int
    offset: int
    digest: str | None = None


def resume_message(request_id: str, seq: int, offset: int, token: str | None = None) -> bytes:
    message: dict[str, Any] = {"v": VERSION, "id": request_id, "seq": seq, "offset": offset}
    if token is not None:
        message["token"] = token
    return encode(message)


def decode_resume(raw: bytes) -> Resume:
    """`id` and `token` are checked as a cancel's are; `seq` (-1 or more) and `offset` (0 or more) are required."""
    cancel = decode_cancel(raw)
    data = decode_map(raw)
    seq = _int(data, "seq", None, -1, MAX_SEQ)
    offset = _int(data, "offset", None, 0, MAX_SEQ)
    if seq is None or offset is None:
        raise _fail("seq" if seq is None else "offset", "is required")
    return Resume(cancel.id, seq, offset, cancel.digest)


def resumed_event(request_id: str, seq: int, offset: int) -> dict[str, Any]:
    """The worker sent again what followed the resume's `seq`: events after it are new. `seq` is the
    last event sent before this one (no new number), `offset` the completion tokens streamed so far."""
    return {"v": VERSION, "type": "resumed", "id": request_id, "seq": seq, "offset": offset}
