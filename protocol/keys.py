"""Redis key and channel names: the one place that spells them.

On one Redis every key has the name it always had (`lmq:req:<model>`, `lmq:progress:<id>`, ...).
On a Redis Cluster (protocol/cluster_url.py) the request path is split into K *shards*: each
shard's keys carry a hash tag (`lmq:{<tag>}:req:<model>`), so everything one worker step writes
for the requests of one shard (their streams, progress, holders, dead letters, the step's fence)
lives in one hash slot, which is what a Lua script on a cluster may touch. The tags are chosen so
that shard k's slot lies in the middle of the k-th of K equal slot ranges: with the usual even
split of slots over P primaries and K a multiple of P, every primary serves K/P shards. A request's shard is
`crc32(request id) mod K`, so two requests with one id meet in one shard (the holder key that
keeps one id from running twice is per shard).

Shard 0 is also the *home* shard: worker heartbeats, batch jobs and files live there, so that
what a transaction touches together shares its slot.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

REQUEST_GROUP = "workers"
CANCEL_CHANNEL = "lmq:cancel"  # published to every node of a cluster: any node may be subscribed to

INTERACTIVE, BATCH = "interactive", "batch"  # protocol.messages.PRIORITIES, in the order workers serve them


@dataclass(frozen=True)
class Shard:
    """The names of one shard's keys; `tag` None is the single-Redis layout (no hash tag)."""

    index: int = 0
    tag: str | None = None

    def key(self, rest: str) -> str:
        return f"lmq:{rest}" if self.tag is None else f"lmq:{{{self.tag}}}:{rest}"

    def holds(self, key: str) -> bool:
        """Whether this shard's step script may write `key` (a producer's reply stream): on a cluster,
        only a key of the shard's own hash slot."""
        return self.tag is None or key_slot(key.encode()) == key_slot(self.tag.encode())

    def request_stream(self, model: str, priority: str = INTERACTIVE) -> str:
        """The stream that workers serving `model` read requests of `priority` from.

        A stream cannot be reordered, so each priority has its own: `...req:<model>` (interactive,
        the name it always had) and `...req-batch:<model>`. The prefixes differ before the model
        name starts, so no model name (which may hold ':') can make one collide with the other.
        """
        if priority == INTERACTIVE:
            return self.key(f"req:{model}")
        if priority == BATCH:
            return self.key(f"req-batch:{model}")
        raise ValueError(f"unknown priority {priority!r}")

    @property
    def dead_letter_stream(self) -> str:
        return self.key("dead")

    def progress_key(self, request_id: str) -> str:
        """Token ids already streamed for a request (protocol/progress.py), so a re-run after a worker death continues from there."""
        return self.key(f"progress:{request_id}")

    def holder_key(self, request_id: str) -> str:
        """The stream entry that runs a request id: one entry per id at a time, across all workers."""
        return self.key(f"holder:{request_id}")

    def applied_step_key(self, consumer: str, process_token: str) -> str:
        """The last step a worker process wrote to this shard, so that a retried step is not written twice."""
        return self.key(f"applied:{consumer}:{process_token}")

    # Home shard only: heartbeats, batch jobs, files.

    @property
    def worker_key_prefix(self) -> str:
        return self.key("worker:")

    def worker_key(self, worker_id: str) -> str:
        """Heartbeat key of one worker (expires when the worker stops refreshing it)."""
        return f"{self.worker_key_prefix}{worker_id}"

    def batch_index(self, api: str) -> str:
        """The ids of one API's batches ("openai" or "anthropic"), scored by creation time, for listing."""
        return self.key(f"batches:{api}")

    @property
    def active_batches(self) -> str:
        """The ids of batches some gateway must drive."""
        return self.key("batches-active")

    @property
    def file_index(self) -> str:
        """Sorted set of file ids by creation time."""
        return self.key("files")

    def batch_key(self, batch_id: str, part: str = "") -> str:
        """A batch's hash (`part` empty) or one of its parts: `items` (list), `results`, `inflight` (hashes), `lease`."""
        return self.key(f"batch:{batch_id}" + (f":{part}" if part else ""))

    def batch_reply_stream(self, batch_id: str, index: int, attempt: int) -> str:
        """The durable reply stream of one run of one batch item (written by the step script of this shard)."""
        return self.key(f"batch:{batch_id}:reply:{index}.{attempt}")

    def file_key(self, file_id: str, part: str = "") -> str:
        """An uploaded or generated file's hash (`part` empty), or its bytes (`data`)."""
        return self.key(f"file:{file_id}" + (f":{part}" if part else ""))


UNSHARDED = Shard()


@dataclass(frozen=True)
class ShardLayout:
    """The shards of one deployment: one untagged shard on a single Redis, K tagged ones on a cluster."""

    shards: tuple[Shard, ...] = field(default=(UNSHARDED,))

    @property
    def home(self) -> Shard:
        return self.shards[0]

    def for_request(self, request_id: str) -> Shard:
        return self.shards[zlib.crc32(request_id.encode()) % len(self.shards)]


SINGLE = ShardLayout()


def sharded(count: int) -> ShardLayout:
    """K = `count` hash-tagged shards, shard k's slot in the middle of the k-th of K equal slot ranges."""
    if not 1 <= count <= 1024:
        raise ValueError(f"the number of shards is from 1 to 1024, not {count}")
    return ShardLayout(tuple(Shard(index, _spread_tag(index, count)) for index in range(count)))


def _spread_tag(index: int, count: int) -> str:
    """The first of `<index>.0`, `<index>.1`, ... whose slot lies in the middle half of the index-th
    of `count` equal slot ranges: away from the ends, so a primary boundary rounded a slot either way
    (as `redis-cli --cluster create` rounds them) cannot move a shard to the neighbouring primary."""
    low, high = index * REDIS_CLUSTER_HASH_SLOTS // count, (index + 1) * REDIS_CLUSTER_HASH_SLOTS // count
    quarter = (high - low) // 4
    attempt = 0
    while not low + quarter <= key_slot(f"{index}.{attempt}".encode()) < high - quarter:
        attempt += 1
    return f"{index}.{attempt}"


# The single-Redis names, as module functions (what producers on one Redis and most tests use).
request_stream = UNSHARDED.request_stream
progress_key = UNSHARDED.progress_key
holder_key = UNSHARDED.holder_key
applied_step_key = UNSHARDED.applied_step_key
worker_key = UNSHARDED.worker_key
batch_index = UNSHARDED.batch_index
batch_key = UNSHARDED.batch_key
batch_reply_stream = UNSHARDED.batch_reply_stream
file_key = UNSHARDED.file_key
DEAD_LETTER_STREAM = UNSHARDED.dead_letter_stream
WORKER_KEY_PREFIX = UNSHARDED.worker_key_prefix
ACTIVE_BATCHES = UNSHARDED.active_batches
FILE_INDEX = UNSHARDED.file_index


def gateway_reply_channel(gateway_id: str) -> str:
    """The pub/sub channel one gateway process subscribes to at start-up (on a cluster, PUBLISH reaches every node)."""
    return f"lmq:reply:{gateway_id}"


def rate_limit_key(key_digest: str, what: str) -> str:
    """One API key's counter (`requests` or `tokens`) in the current rate-limit window; both in one slot."""
    return f"lmq:ratelimit:{{{key_digest}}}:{what}"
