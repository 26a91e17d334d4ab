"""The lmq protocol: what gateways, workers and foreign producers put into Redis."""

from .codec import MAX_MESSAGE_BYTES, decode_map, encode
from .errors import ERROR_CODES, ProtocolError
from .keys import (
    CANCEL_CHANNEL,
    DEAD_LETTER_STREAM,
    REQUEST_GROUP,
    applied_step_key,
    gateway_reply_channel,
    holder_key,
    progress_key,
    request_stream,
    worker_key,
)
from .messages import (
    DISTRIBUTION_FIELDS,
    VERSION,
    Cancel,
    Heartbeat,
    Reply,
    Request,
    SamplingParams,
    cancel_digest,
    cancel_message,
    decode_cancel,
    decode_event,
    decode_event_batch,
    decode_request,
    delta_event,
    done_event,
    encode_event_batch,
    error_event,
    parse_request,
    parse_sampling,
    started_event,
)
from .progress import decode_progress, encode_progress

__all__ = [name for name in dir() if not name.startswith("_")]
