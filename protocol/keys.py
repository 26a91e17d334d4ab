"""Redis key and channel names: the one place that spells them."""

REQUEST_GROUP = "workers"
DEAD_LETTER_STREAM = "lmq:dead"
CANCEL_CHANNEL = "lmq:cancel"
WORKER_KEY_PREFIX = "lmq:worker:"
PROGRESS_KEY_PREFIX = "lmq:progress:"
HOLDER_KEY_PREFIX = "lmq:holder:"
APPLIED_STEP_KEY_PREFIX = "lmq:applied:"


INTERACTIVE, BATCH = "interactive", "batch"  # protocol.messages.PRIORITIES, in the order workers serve them


def request_stream(model: str, priority: str = INTERACTIVE) -> str:
    """The stream that workers serving `model` read requests of `priority` from.

    A stream cannot be reordered, so each priority has its own: `lmq:req:<model>` (interactive, the
    name it always had) and `lmq:req-batch:<model>`. The prefixes differ before the model name
    starts, so no model name (which may hold ':') can make one collide with the other.
    """
    if priority == INTERACTIVE:
        return f"lmq:req:{model}"
    if priority == BATCH:
        return f"lmq:req-batch:{model}"
    raise ValueError(f"unknown priority {priority!r}")


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


# ---------------------------------------------------------------- batch jobs (gateway/batches/): state in Redis

BATCH_INDEX_PREFIX = "lmq:batches:"  # + api: a sorted set of that API's batch ids by creation time
ACTIVE_BATCHES = "lmq:batches-active"  # the ids of batches some gateway must drive
FILE_INDEX = "lmq:files"  # sorted set of file ids by creation time


def batch_index(api: str) -> str:
    """The ids of one API's batches ("openai" or "anthropic"), scored by creation time, for listing."""
    return f"{BATCH_INDEX_PREFIX}{api}"


def batch_key(batch_id: str, part: str = "") -> str:
    """A batch's hash (`part` empty) or one of its parts: `items` (list), `results`, `inflight` (hashes), `lease`."""
    return f"lmq:batch:{batch_id}" + (f":{part}" if part else "")


def batch_reply_stream(batch_id: str, index: int, attempt: int) -> str:
    """The durable reply stream of one run of one batch item."""
    return f"lmq:batch:{batch_id}:reply:{index}.{attempt}"


def file_key(file_id: str, part: str = "") -> str:
    """An uploaded or generated file's hash (`part` empty), or its bytes (`data`)."""
    return f"lmq:file:{file_id}" + (f":{part}" if part else "")


def rate_limit_key(key_digest: str, what: str) -> str:
    """One API key's counter (`requests` or `tokens`) in the current rate-limit window."""
    return f"lmq:ratelimit:{key_digest}:{what}"
