"""Redis key and channel names: the one place that spells them."""

REQUEST_GROUP = "workers"
DEAD_LETTER_STREAM = "lmq:dead"
CANCEL_CHANNEL = "lmq:cancel"
WORKER_KEY_PREFIX = "lmq:worker:"
PROGRESS_KEY_PREFIX = "lmq:progress:"
HOLDER_KEY_PREFIX = "lmq:holder:"
APPLIED_STEP_KEY_PREFIX = "lmq:applied:"


def request_stream(model: str) -> str:
    """The stream that workers serving `model` read requests from."""
    return f"lmq:req:{model}"


def gateway_reply_channel(gateway_id: str) -> str:
    """The pub/sub channel one gateway process subscribes to at start-up."""
    return f"lmq:reply:{gateway_id}"


def worker_key(worker_id: str) -> str:
    """Heartbeat key of one worker (expires when the worker stops refreshing it)."""
    return f"{WORKER_KEY_PREFIX}{worker_id}"


def holder_key(request_id: str) -> str:
    """The stream entry that runs a request id: one entry per id at a time, across all workers."""
    return f"{HOLDER_KEY_PREFIX}{request_id}"


def progress_key(request_id: str) -> str:
    """Token ids already streamed for a request (protocol/progress.py), so a re-run after a worker death continues from there."""
    return f"{PROGRESS_KEY_PREFIX}{request_id}"


def applied_step_key(consumer: str, process_token: str) -> str:
    """The last step a worker process wrote, so that a retried step is not written twice."""
    return f"{APPLIED_STEP_KEY_PREFIX}{consumer}:{process_token}"
