"""What the soak samples over time, and the leftovers it checks at the end.

Every `interval_s`: the resident memory of each process (gateway, workers, Redis), Redis's
`used_memory`, how many keys of each short-lived kind exist (progress, holder, step fence, reply
streams, dead letters) and how long the request queue is (entries, pending). All must stay flat: a
key kind that only grows, or a queue that does not drain, is a leak.

Batch and file records are counted apart: they are kept for their retention (30 days), so they
grow with every batch job by design, and Redis's `used_memory` with them.

At the end, with traffic stopped and every request over: the request streams empty with nothing
pending, and every short-lived key carrying a TTL (a key without one would stay for ever).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from redis.exceptions import RedisError

# key kind -> SCAN pattern, on one Redis (the single-Redis layout of protocol/keys.py)
SHORT_LIVED = {
    "progress": "lmq:progress:*",
    "holder": "lmq:holder:*",
    "fence": "lmq:applied:*",
    "foreign_reply": "soak:reply:*",
    "batch_reply": "lmq:batch:*:reply:*",
}

# kept on purpose for their retention (gateway/batches/store.py RETENTION_S, 30 days): they grow with
# every batch job, and account for Redis's used_memory growing while batch jobs run
RETAINED = {"batch": "lmq:batch:batch_*", "file": "lmq:file:file-*"}
RETAINED_EXCLUDE = (":reply:", ":data", ":items", ":results", ":inflight", ":lease")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class ResourceSampler:
    def __init__(self, stack, interval_s: float):
        self.stack = stack
        self.interval_s = interval_s
        self.samples: list[dict] = []

    async def run(self, until: Callable[[], bool]) -> None:
        started = time.monotonic()
        while not until():
            sample = await asyncio.to_thread(self.sample)
            if sample is not None:
                sample["t"] = round(time.monotonic() - started, 1)
                self.samples.append(sample)
            await asyncio.sleep(self.interval_s)

    def sample(self) -> dict | None:
        admin = self.stack.admin
        try:
            keys = {
                kind: sum(1 for _ in admin.scan_iter(match=pattern, count=1000))
                for kind, pattern in SHORT_LIVED.items()
            }
            return {
                "rss_mib": {name: rss_mib(pid) for name, pid in self.stack.pids().items()},
                "redis_used_memory_mib": round(admin.info("memory")["used_memory"] / 2**20, 2),
                "keys": keys,
                "retained": {kind: self._count_records(pattern) for kind, pattern in RETAINED.items()},
                "queue": self.stack.queue(),
                "dead_letters": self.stack.dead_letter_count(),
            }
        except (RedisError, OSError):
            return None  # Redis down for a fault: skip this sample

    def _count_records(self, pattern: str) -> int:
        """Batch or file records (their hashes, not their parts)."""
        keys = self.stack.admin.scan_iter(match=pattern, count=1000)
        return sum(1 for key in keys if not any(part in key.decode(errors="replace") for part in RETAINED_EXCLUDE))

    def leftovers(self) -> list[str]:
        """What is left that should not be: queued or pending entries, short-lived keys without a TTL."""
        admin = self.stack.admin
        found = [
            f"queue not drained: {queue}" for queue in [self.stack.queue()] if queue["entries"] or queue["pending"]
        ]
        for kind, pattern in SHORT_LIVED.items():
            for key in admin.scan_iter(match=pattern, count=1000):
                if admin.ttl(key) == -1:
                    found.append(f"{kind} key without a TTL: {key.decode(errors='replace')}")
        return found[:50]

    def trend(self) -> dict:
        """First, middle and last sample of each figure, and the largest: enough to see a slope."""
        if not self.samples:
            return {}
        picks = [self.samples[0], self.samples[len(self.samples) // 2], self.samples[-1]]
        return {
            "samples": len(self.samples),
            "at_s": [s["t"] for s in picks],
            "redis_used_memory_mib": [s["redis_used_memory_mib"] for s in picks],
            "redis_used_memory_max_mib": max(s["redis_used_memory_mib"] for s in self.samples),
            "rss_mib": {
                name: [s["rss_mib"].get(name) for s in picks]
                for name in sorted({name for s in self.samples for name in s["rss_mib"]})
            },
            "keys": {kind: [s["keys"][kind] for s in picks] for kind in SHORT_LIVED},
            "keys_max": {kind: max(s["keys"][kind] for s in self.samples) for kind in SHORT_LIVED},
            "retained": {kind: [s["retained"][kind] for s in picks] for kind in RETAINED},
            "queue": [s["queue"] for s in picks],
            "dead_letters": [s["dead_letters"] for s in picks],
        }
