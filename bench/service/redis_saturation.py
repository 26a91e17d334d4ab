"""Where one Redis saturates: N gateways and M stub workers on one Redis, streaming at rising concurrency.

    python bench/service/redis_saturation.py --gateways 2 --workers 2 --streams 16,64,256 --max-tokens 128 \\
        --json bench/results/redis_saturation.json
    python bench/service/redis_saturation.py --cluster 3 --shards 6 ...   # the same on a 3-primary Redis Cluster

Starts an embedded Redis, N `lmq gateway` processes and M workers whose model answers at once
(bench/harness/stub_services.py), so that no model cost hides the queue's. Each level runs
streams × --requests-per-stream streaming chat completions from that many closed-loop streams,
spread over the gateways in turn. Per level it reports streamed tokens/s, requests/s and errors; the
CPU seconds of Redis (each node's INFO used_cpu_sys + used_cpu_user), the gateways, the workers
and this client, and each one's utilisation (CPU
seconds ÷ wall seconds, per process: a single-threaded Redis or asyncio process saturates near
1.0); the CPU each costs per 10k streamed tokens; how many cores of the machine were busy in all
(other work included); and Redis's own INFO commandstats, which say what its time went on.

Redis becomes the limit where its utilisation nears one core, or where tokens/s stops growing while
the gateways and workers still have headroom. On a machine whose few cores everything shares, the
client and gateways usually fill the cores first; then the figure that carries over to a bigger
machine is Redis's CPU per 10k tokens: one Redis core carries about 10k ÷ that many tokens/s.

With `--cluster P` the Redis is an embedded cluster of P primaries and K = `--shards` request
shards (default 2P). Its figures are sums over the nodes (CPU seconds, commandstats), so they
compare with one Redis's directly: what the cluster costs in all per token. A cluster is full when
its busiest node is, not when the mean one is, so each level also reports every node's CPU share
and EVALSHA calls, and the busiest node's utilisation decides `limit`. A worker writes each step
with one script call per shard the step touches, so on a cluster the calls per token rise and with
them the fixed per-call cost; that, not the per-token cost, is what sharding adds. A worker's read
is a script too (one XREVRANGE in each): each level also prints the step scripts' calls per 10k
tokens apart from the reads'.

`--versus-one-redis` (with `--cluster`) runs the same levels on one Redis too, in the same run and
with the same code: both layouts are up at once and each level runs on one, then the other, for
`--rounds` rounds, the order reversed every other round (this machine's load drifts by tens of
percent within minutes). It prints per level what the cluster carries against one Redis, derived from CPU per token rather than from tokens/s (which on a
small machine measures the machine):

    capacity (× one Redis) = one Redis's CPU per 10k tokens ÷ the busiest node's CPU per 10k tokens

A Redis is full at one core, so one Redis carries 10k tokens/s ÷ its CPU per 10k tokens, and a
cluster as many as its busiest node does: the ratio of the two. Beside it, the nodes' balance
(the busiest node's CPU over the idlest's).

That ratio is read at light load, where a node at a few percent of a core wakes for nearly every
call; a saturated node handles several calls a wake-up, and its CPU per token falls. `--redis-cpu F`
caps every Redis node at F of one core (bench/harness/cpu_cap.py: a cgroup each; needs root), low
enough (0.005–0.01 here) that the nodes, not the machine, are the limit: then tokens/s measure Redis,
and each level with --versus-one-redis also prints what the cluster carried at saturation:

    capacity at saturation (× one Redis) = the cluster's tokens/s ÷ one Redis's, every node capped alike

beside each node's CPU over its cap (near 1.0: it was the limit). (Commandstats' microseconds count
wall time, so a command that a throttled period cut in two reads long; the CPU figures do not.)

`--balance` samples, every 50 ms of each level, each request stream's length and its entries
pending per consumer (XLEN, XPENDING; so its own commands are in that run's Redis figures): with
`--max-seqs` below streams ÷ workers a backlog builds, and the pull model's promise is that no
worker has a free slot while requests wait. Per worker it prints, over the samples with a
backlog, the share in which it held nothing (idle while requests waited), the share in which it
held all its slots, and the mean share of its slots it held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import sys
import threading
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.client import ChatClient
from bench.harness.cpu_cap import CpuCap
from bench.harness.prompts import question
from bench.harness.stats import RequestResult, summarize
from bench.harness.stub_services import STUB_MAX_SEQS, StubServices
from bench.service.serve import int_list, run_level
from protocol import REQUEST_GROUP
from protocol.keys import BATCH, INTERACTIVE
from protocol.redis_client import connect_sync

COMPONENTS = ("redis", "gateway", "worker", "client")
TOKENS_UNIT = 10_000
SATURATED = 0.9  # a process at this share of one core, or a machine at this share of its cores, is full
TOP_COMMANDS = 6
BALANCE_SAMPLE_S = 0.05
IDLE_S = 5.0  # how long each layout's Redis CPU is measured with nothing streaming


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", type=int, default=2, help="N: `lmq gateway` processes")
    parser.add_argument("--workers", type=int, default=2, help="M: stub worker processes")
    parser.add_argument(
        "--streams", type=int_list, default=[16, 64, 256], help="concurrent streams per level, e.g. 16,64,256"
    )
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens streamed per request")
    parser.add_argument(
        "--kv-memory", default="2GiB", help="each stub worker's KV budget (pages are allocated as usual)"
    )
    parser.add_argument(
        "--level-timeout", type=float, default=300.0, help="seconds a level may take; the rest count as errors"
    )
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="P", help="P primaries of an embedded Redis Cluster (0: one Redis)"
    )
    parser.add_argument("--shards", type=int, metavar="K", help="request shards on the cluster (default 2×P)")
    parser.add_argument(
        "--versus-one-redis", action="store_true",
        help="with --cluster: run one Redis too, layouts alternated, and derive the cluster's capacity",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="with --versus-one-redis: rounds of both layouts")
    parser.add_argument("--max-seqs", type=int, default=STUB_MAX_SEQS, help="each stub worker's slots")
    parser.add_argument("--balance", action="store_true", help="sample backlog and slots held per worker")
    parser.add_argument(
        "--redis-cpu", type=float, metavar="FRACTION",
        help="cap each Redis node at this share of one core (a cgroup; needs root), so that Redis is the limit",
    )  # fmt: skip
    parser.add_argument("--logs", type=Path, default=Path("bench/results/logs"))
    parser.add_argument("--json", type=Path)
    return parser


class RoundRobin:
    """Hands each request to the next gateway in turn; run_level sees one client."""

    def __init__(self, clients: list[ChatClient]):
        self.clients = clients
        self._next = itertools.cycle(clients)

    async def stream_chat(self, body: dict, timeout_s: float) -> RequestResult:
        return await next(self._next).stream_chat(body, timeout_s)


class RedisCommandStats:
    """INFO commandstats of each of the benchmark's Redis servers (one, or a cluster's primaries),
    reset at the start of each level. Each node is asked alone: a node counts only what it ran."""

    def __init__(self, node_urls: list[str]):
        import redis

        self.clients = [redis.Redis.from_url(url) for url in node_urls]

    def cpu_seconds(self) -> list[float]:
        """Each node's CPU seconds so far, as it reports them (INFO used_cpu_sys + used_cpu_user: getrusage,
        finer than the 10 ms ticks of /proc, which a 5 s idle measurement or a short level would round away)."""
        return [
            sum(float(client.info("cpu")[name]) for name in ("used_cpu_sys", "used_cpu_user"))
            for client in self.clients
        ]

    def reset(self) -> None:
        for client in self.clients:
            client.config_resetstat()

    def read(self) -> list[dict[str, dict[str, int]]]:
        """Per node, {command: {"calls", "usec"}}; commands that a script calls are counted too (and inside its time)."""
        return [
            {
                name.removeprefix("cmdstat_"): {"calls": int(values["calls"]), "usec": int(values["usec"])}
                for name, values in client.info("commandstats").items()
            }
            for client in self.clients
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def summed(per_node: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """The nodes' commandstats added up, command by command."""
    total: dict[str, dict[str, int]] = {}
    for commands in per_node:
        for name, values in commands.items():
            entry = total.setdefault(name, {"calls": 0, "usec": 0})
            entry["calls"] += values["calls"]
            entry["usec"] += values["usec"]
    return total


class BalanceSampler:
    """Every BALANCE_SAMPLE_S, from a thread of its own: the entries waiting in the request streams
    (their length less those pending: a finished entry is deleted) and the entries each worker holds
    (pending for it). `figures` says, per worker, how often it held all its slots while some waited."""

    def __init__(self, redis_url: str, streams: list[str], workers: list[str]):
        self.client = connect_sync(redis_url)
        self.streams = streams
        self.workers = workers
        self.samples: list[tuple[int, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="balance", daemon=True)

    def __enter__(self) -> BalanceSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(BALANCE_SAMPLE_S):
            self.samples.append(self.sample())

    def sample(self) -> tuple[int, dict[str, int]]:
        waiting, held = 0, dict.fromkeys(self.workers, 0)
        for stream in self.streams:
            summary = self.client.xpending(stream, REQUEST_GROUP)
            waiting += self.client.xlen(stream) - summary["pending"]
            for consumer in summary["consumers"] or []:
                name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
                held[name] = held.get(name, 0) + int(consumer["pending"])
        return waiting, held

    def figures(self, max_seqs: int) -> dict:
        return balance_figures(self.samples, self.workers, max_seqs)


def balance_figures(samples: list[tuple[int, dict[str, int]]], workers: list[str], max_seqs: int) -> dict:
    """Over the samples with entries waiting, per worker: the share in which it held nothing (idle while
    requests waited: what the pull model must never let last), the share in which it held all
    `max_seqs` slots, and the mean share of its slots it held. With no backlog at all, None."""
    backlog = [held for waiting, held in samples if waiting > 0]

    def share(test) -> float | None:
        return sum(test(held) for held in backlog) / len(backlog) if backlog else None

    per_worker = {
        worker: {
            "idle_share": share(lambda held: held.get(worker, 0) == 0),
            "full_share": share(lambda held: held.get(worker, 0) >= max_seqs),
            "held_share": share(lambda held: held.get(worker, 0) / max_seqs),
        }
        for worker in workers
    }
    return {"samples": len(samples), "backlog_samples": len(backlog), "max_seqs": max_seqs, "workers": per_worker}


def capacity_figures(one: dict, cluster: dict) -> dict:
    """What a cluster carries against one Redis at one level, from CPU per token: one Redis is full at
    one core, the cluster when its busiest node is, so the ratio of their CPU per 10k tokens."""
    one_ms = one["cpu_s_per_10k_tokens"]["redis"]
    tokens = cluster["output_tokens"]
    nodes = cluster["redis_nodes"]
    if not one_ms or not tokens or not all(node["cpu_s"] > 0 for node in nodes):
        return {"streams": cluster["concurrency"], "capacity": None}
    one_ms *= 1000
    busiest = max(node["cpu_s"] for node in nodes)
    busiest_ms = busiest * TOKENS_UNIT / tokens * 1000
    return {
        "streams": cluster["concurrency"],
        "one_redis_ms_per_10k": one_ms,
        "cluster_ms_per_10k": cluster["cpu_s_per_10k_tokens"]["redis"] * 1000,
        "busiest_share": busiest / cluster["cpu_s"]["redis"],
        "busiest_ms_per_10k": busiest_ms,
        "capacity": one_ms / busiest_ms,
        "node_balance": busiest / min(node["cpu_s"] for node in nodes),
        **beyond_idle(one, cluster),
    }


def saturated_figures(one: dict, cluster: dict, cap: float | None) -> dict:
    """With every node capped at `cap` of a core, Redis is the limit and tokens/s measure it: the cluster's
    tokens/s over one Redis's, beside each node's CPU as a share of its cap (near 1: it was the limit)."""
    if not cap or not one["output_tok_s"]:
        return {}
    return {
        "cap": cap,
        "saturated_capacity": cluster["output_tok_s"] / one["output_tok_s"],
        "tok_s": {"one_redis": one["output_tok_s"], "cluster": cluster["output_tok_s"]},
        "share_of_cap": {
            "one_redis": one["redis_nodes"][0]["utilisation"] / cap,
            "cluster": [node["utilisation"] / cap for node in cluster["redis_nodes"]],
        },
    }


def beyond_idle(one: dict, cluster: dict) -> dict:
    """The same ratio with each node's idle CPU (measured before the levels: the cluster bus, heartbeats,
    readers' timeouts) taken out of its level's: what grows with tokens, which is what fills a node at
    saturation, where the idle part is a vanishing share. Absent without idle figures."""
    if "redis_idle_cpu_per_s" not in one or "redis_idle_cpu_per_s" not in cluster:
        return {}

    def per_10k_ms(level: dict) -> list[float]:
        idle, wall = level["redis_idle_cpu_per_s"], level["wall_s"]
        return [(node["cpu_s"] - rate * wall) * TOKENS_UNIT / level["output_tokens"] * 1000
                for node, rate in zip(level["redis_nodes"], idle)]  # fmt: skip

    one_ms, cluster_ms = sum(per_10k_ms(one)), per_10k_ms(cluster)
    if one_ms <= 0 or max(cluster_ms) <= 0:
        return {}
    return {
        "idle_ms_per_s": {
            "one_redis": one["redis_idle_cpu_per_s"][0] * 1000,
            "cluster": [rate * 1000 for rate in cluster["redis_idle_cpu_per_s"]],
        },  # fmt: skip
        "one_redis_beyond_idle_ms_per_10k": one_ms,
        "busiest_beyond_idle_ms_per_10k": max(cluster_ms),
        "capacity_beyond_idle": one_ms / max(cluster_ms),
    }


def capacity_line(figures: dict, round_number: int) -> str:
    if figures["capacity"] is None:
        return f"{figures['streams']:>7} streams, round {round_number}: no capacity (no tokens or no CPU measured)"
    line = (
        f"{figures['streams']:>7} streams, round {round_number}: capacity = one Redis's CPU per 10k tokens ÷ the busiest"
        f" node's = {figures['one_redis_ms_per_10k']:.0f} ms ÷ {figures['busiest_ms_per_10k']:.0f} ms"
        f" ({figures['busiest_share'] * 100:.0f}% of the cluster's {figures['cluster_ms_per_10k']:.0f} ms)"
        f" = {figures['capacity']:.2f}× one Redis; busiest node ÷ idlest {figures['node_balance']:.2f}"
    )
    if "capacity_beyond_idle" in figures:
        idle = figures["idle_ms_per_s"]
        line += (
            f"\n{'':>7}          beyond idle CPU (one Redis {idle['one_redis']:.1f} ms/s, nodes"
            f" {' '.join(f'{rate:.1f}' for rate in idle['cluster'])} ms/s): {figures['one_redis_beyond_idle_ms_per_10k']:.0f} ms"
            f" ÷ {figures['busiest_beyond_idle_ms_per_10k']:.0f} ms = {figures['capacity_beyond_idle']:.2f}× one Redis"
        )
    if "saturated_capacity" in figures:
        tok_s, share = figures["tok_s"], figures["share_of_cap"]
        line += (
            f"\n{'':>7}          at saturation (each node capped at {figures['cap']:g} of a core): {tok_s['cluster']:.0f}"
            f" ÷ {tok_s['one_redis']:.0f} tok/s = {figures['saturated_capacity']:.2f}× one Redis; CPU ÷ cap: one Redis"
            f" {share['one_redis']:.2f}, nodes {' '.join(f'{s:.2f}' for s in share['cluster'])}"
        )
    return line


def balance_line(level: dict) -> str:
    balance = level.get("balance")
    if not balance or not balance["backlog_samples"]:
        return (
            f"{level['concurrency']:>7} streams, balance: no backlog in {balance['samples'] if balance else 0} samples"
        )
    workers = ", ".join(
        f"{name} idle {w['idle_share'] * 100:.0f}%, full {w['full_share'] * 100:.0f}%,"
        f" held {w['held_share'] * 100:.0f}% of {balance['max_seqs']} slots"
        for name, w in sorted(balance["workers"].items())
    )
    return (
        f"{level['concurrency']:>7} streams, balance over {balance['backlog_samples']} of {balance['samples']}"
        f" samples with requests waiting: {workers}"
    )


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores, every process), from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def level_figures(summary: dict, cpu_s: dict[str, float], commands: dict[str, dict[str, int]],
                  gateways: int, workers: int, cores_busy: float,
                  nodes: list[tuple[float, dict]] | None = None) -> dict:  # fmt: skip
    """A level's summary (bench/harness/stats.py) with the CPU figures derived from the measured seconds.

    `cpu_s["redis"]` and `commands` are sums over the Redis nodes; `nodes` has each node's
    (CPU seconds, commandstats), by default the one Redis that had them all."""
    wall = max(summary["wall_s"], 1e-9)
    tokens = summary["output_tokens"]
    per_tokens = TOKENS_UNIT / tokens if tokens else None
    nodes = nodes if nodes is not None else [(cpu_s["redis"], commands)]
    processes = {"redis": len(nodes), "gateway": gateways, "worker": workers, "client": 1}
    level = dict(summary)
    level["cpu_s"] = cpu_s
    level["utilisation"] = {name: cpu_s[name] / wall / processes[name] for name in COMPONENTS}
    level["cpu_s_per_10k_tokens"] = {name: (cpu_s[name] * per_tokens if per_tokens else None) for name in COMPONENTS}
    level["machine_cores_busy"] = cores_busy
    level["redis_core_tok_s"] = tokens / cpu_s["redis"] if tokens and cpu_s["redis"] > 0 else None
    ranked = sorted(commands.items(), key=lambda item: item[1]["usec"], reverse=True)
    level["redis_commands"] = [
        {
            "command": name,
            "calls": values["calls"],
            "usec": values["usec"],
            "calls_per_10k_tokens": values["calls"] * per_tokens if per_tokens else None,
            "usec_per_10k_tokens": values["usec"] * per_tokens if per_tokens else None,
        }
        for name, values in ranked
    ]
    level["script_calls_per_10k_tokens"] = call_figures(level)
    level["redis_nodes"] = node_figures(nodes, wall)
    level["redis_max_node_utilisation"] = max(node["utilisation"] for node in level["redis_nodes"])
    busiest_redis = level["utilisation"] | {"redis": level["redis_max_node_utilisation"]}
    level["limit"] = limit(busiest_redis, cores_busy, os.cpu_count() or 1)
    return level


def node_figures(nodes: list[tuple[float, dict]], wall: float) -> list[dict]:
    """Per Redis node: its CPU seconds, utilisation, share of all the nodes' CPU, and EVALSHA calls
    (the step, keep and read scripts of the shards it serves)."""
    total = sum(cpu for cpu, _ in nodes)
    return [
        {
            "cpu_s": cpu,
            "utilisation": cpu / wall,
            "cpu_share": cpu / total if total > 0 else None,
            "evalsha_calls": commands.get("evalsha", {}).get("calls", 0),
            "top_commands": {
                name: values
                for name, values in sorted(commands.items(), key=lambda item: item[1]["usec"], reverse=True)[
                    :TOP_COMMANDS
                ]
            },
        }
        for cpu, commands in nodes
    ]


def limit(utilisation: dict[str, float], cores_busy: float, cores: int) -> str:
    """What held this level back: all the machine's cores, else the busiest kind of process if it is full."""
    if cores_busy >= SATURATED * cores:
        return f"machine ({cores_busy:.2f} of {cores} cores busy)"
    name, busiest = max(utilisation.items(), key=lambda item: item[1])
    if busiest >= SATURATED:
        return f"{name} ({busiest:.2f} of a core per process)"
    return "none measured (latency-bound)"


async def measured_level(services: StubServices, stats: RedisCommandStats, spread: RoundRobin,
                         bodies: list[dict], streams: int, args: argparse.Namespace,
                         sampler: BalanceSampler | None = None) -> dict:  # fmt: skip
    """One level's requests, and what they cost: every process's CPU seconds, each Redis node's, and its commands."""
    stats.reset()
    cpu_before, nodes_before, busy_before = services.cpu(), stats.cpu_seconds(), machine_busy_seconds()
    if sampler is not None:
        sampler.samples.clear()
    results, wall = await run_level(spread, bodies, streams, args.level_timeout)
    cpu_after, nodes_after = services.cpu(), stats.cpu_seconds()
    busy = (machine_busy_seconds() - busy_before) / max(wall, 1e-9)
    cpu_s = {name: cpu_after[name] - cpu_before[name] for name in COMPONENTS}
    cpu_s["redis"] = sum(nodes_after) - sum(nodes_before)  # the nodes' own count, as below
    per_node = stats.read()
    nodes = [(after - before, commands) for before, after, commands in zip(nodes_before, nodes_after, per_node)]
    level = level_figures(
        summarize(streams, results, wall), cpu_s, summed(per_node), args.gateways, args.workers, busy, nodes
    )
    if sampler is not None:
        level["balance"] = sampler.figures(args.max_seqs)
    return level


def worker_ids(services: StubServices) -> list[str]:
    """The stub workers' ids, from their heartbeat keys."""
    prefix = services.layout.home.worker_key_prefix
    client = connect_sync(services.redis_url)
    try:
        return sorted(key.decode().removeprefix(prefix) for key in client.scan_iter(match=f"{prefix}*"))
    finally:
        client.close()


class Layout:
    """One running set of services (one Redis or a cluster, its gateways and workers) and the client
    that drives them; `level(streams)` runs and measures one level on it."""

    def __init__(self, services: StubServices, session: aiohttp.ClientSession, args: argparse.Namespace):
        self.services = services
        self.args = args
        self.clients = [ChatClient(session, url) for url in services.urls]
        self.spread = RoundRobin(self.clients)
        self.stats = RedisCommandStats([node.url for node in services.redis_nodes])
        self.prompt = itertools.count()
        self.streams_of_model: list[str] = []
        self.idle_cpu_per_s: list[float] = []  # each node's, with everything up and nothing streaming

    async def warm_up(self) -> None:
        model = await self.clients[0].first_model()
        for client in self.clients:
            client.model = model
        self.streams_of_model = [
            shard.request_stream(model, priority)
            for priority in (INTERACTIVE, BATCH)
            for shard in self.services.layout.shards
        ]
        await run_level(self.spread, [self.body(4) for _ in range(2 * len(self.clients))], len(self.clients),
                        self.args.level_timeout)  # fmt: skip
        before = self.stats.cpu_seconds()
        await asyncio.sleep(IDLE_S)
        self.idle_cpu_per_s = [(after - cpu) / IDLE_S for cpu, after in zip(before, self.stats.cpu_seconds())]

    def body(self, max_tokens: int) -> dict:  # every request a question not sent before
        return self.clients[0].chat_body([{"role": "user", "content": question(next(self.prompt))}], max_tokens, True)

    async def level(self, streams: int) -> dict:
        return await self._level(streams) | {"redis_idle_cpu_per_s": self.idle_cpu_per_s}

    async def _level(self, streams: int) -> dict:
        args = self.args
        bodies = [self.body(args.max_tokens) for _ in range(streams * args.requests_per_stream)]
        if not args.balance:
            return await measured_level(self.services, self.stats, self.spread, bodies, streams, args)
        workers = worker_ids(self.services)
        with BalanceSampler(self.services.redis_url, self.streams_of_model, workers) as sampler:
            return await measured_level(self.services, self.stats, self.spread, bodies, streams, args, sampler)

    def close(self) -> None:
        self.stats.close()


async def measured_levels(services: list[StubServices], args: argparse.Namespace) -> list[list[dict]]:
    """Each level on every layout, `--rounds` times: the layouts in turn, their order reversed every
    other round (so a drift of the machine's load falls on both alike). Per layout, its levels."""
    levels: list[list[dict]] = [[] for _ in services]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        layouts = [Layout(each, session, args) for each in services]
        try:
            for layout in layouts:
                await layout.warm_up()
            for streams in args.streams:
                for round_number in range(1, args.rounds + 1):
                    order = list(enumerate(layouts))
                    for index, layout in order if round_number % 2 else reversed(order):
                        level = await layout.level(streams) | {"round": round_number}
                        levels[index].append(level)
                        name = "one Redis" if len(layout.services.redis_nodes) == 1 else "cluster"
                        print(f"{level_row(level)}   {name}, round {round_number}", file=sys.stderr, flush=True)
        finally:
            for layout in layouts:
                layout.close()
    return levels


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = "\n".join([
    f"{'':>26} | {'CPU seconds':^28} | {'utilisation: cores per process':^36} | {'Redis per 10k tokens':^24}",
    f"{'streams':>7} {'tok/s':>7} {'req/s':>6} {'err':>3} | {'redis':>6} {'gateway':>7} {'worker':>6} {'client':>6} | "
    f"{'redis':>6} {'gateway':>7} {'worker':>6} {'client':>6} {'machine':>7} | {'CPU ms':>7} {'1 core tok/s':>16}",
])  # fmt: skip


def level_row(level: dict) -> str:
    cpu, util = level["cpu_s"], level["utilisation"]
    redis_s = level["cpu_s_per_10k_tokens"]["redis"]
    return (
        f"{level['concurrency']:>7} {level['output_tok_s']:>7.0f} {level['req_s']:>6.1f} {level['errors']:>3} | "
        f"{cpu['redis']:>6.2f} {cpu['gateway']:>7.1f} {cpu['worker']:>6.1f} {cpu['client']:>6.1f} | "
        f"{util['redis']:>6.2f} {util['gateway']:>7.2f} {util['worker']:>6.2f} {util['client']:>6.2f} "
        f"{level['machine_cores_busy']:>7.2f} | {_num(None if redis_s is None else redis_s * 1000):>7} "
        f"{_num(level['redis_core_tok_s']):>16}"
    )


def commands_line(level: dict) -> str:
    top = level["redis_commands"][:TOP_COMMANDS]
    parts = [f"{c['command']} {_num(c['usec_per_10k_tokens'] / 1000 if c['usec_per_10k_tokens'] is not None else None, 1)} ms"
             f" ({_num(c['calls_per_10k_tokens'])} calls)" for c in top]  # fmt: skip
    return f"{level['concurrency']:>7} streams, Redis command time per 10k tokens: " + ", ".join(parts)


def call_figures(level: dict) -> dict[str, float] | None:
    """Script calls per 10k tokens, split: a worker's read is one script (worker/claims.py `READ_LUA`)
    that runs XREVRANGE once, so the step (and keep) scripts are EVALSHA's calls less XREVRANGE's;
    XREAD is a reader waiting for a new entry. None without tokens."""
    per = {c["command"]: c["calls_per_10k_tokens"] for c in level["redis_commands"]}
    if level["output_tokens"] == 0:
        return None
    evalsha, reads = per.get("evalsha", 0.0), per.get("xrevrange", 0.0)
    return {"evalsha": evalsha, "reads": reads, "step_scripts": evalsha - reads, "waits": per.get("xread", 0.0)}


def calls_line(level: dict) -> str:
    calls = level["script_calls_per_10k_tokens"]
    if calls is None:
        return f"{level['concurrency']:>7} streams, calls: no tokens"
    return (
        f"{level['concurrency']:>7} streams, calls per 10k tokens: step scripts {calls['step_scripts']:.0f}"
        f" (EVALSHA {calls['evalsha']:.0f} less {calls['reads']:.0f} reads), waits (XREAD) {calls['waits']:.0f}"
    )


def nodes_line(level: dict) -> str:
    nodes = level["redis_nodes"]
    shares = " ".join(f"{_num(None if n['cpu_share'] is None else n['cpu_share'] * 100)}%" for n in nodes)
    calls = " ".join(str(n["evalsha_calls"]) for n in nodes)
    return (f"{level['concurrency']:>7} streams, Redis nodes: busiest at {level['redis_max_node_utilisation']:.2f} of a core;"
            f" CPU shares {shares}; EVALSHA calls {calls}")  # fmt: skip


def text_report(report: dict) -> str:
    levels = report["levels"]
    lines = [HEADER, *(level_row(level) for level in levels), ""]
    lines += [commands_line(level) for level in levels]
    lines += ["(a script's time, EVALSHA's, includes that of the commands it calls, which are listed as well)"]
    lines += [calls_line(level) for level in levels]
    if report["redis_layout"]["nodes"] > 1:
        lines += ["", *(nodes_line(level) for level in levels)]
        lines += ["(Redis's CPU seconds and commands above are sums over the nodes, its utilisation their mean)"]
    if report.get("one_redis_levels"):
        one = report["one_redis_levels"]
        lines += ["", "one Redis, same code, same run:", *(level_row(level) for level in one), ""]
        lines += [commands_line(level) for level in one]
        lines += [calls_line(level) for level in one]
        lines += ["", *(capacity_line(figures, figures["round"]) for figures in report["capacity"])]
    if any("balance" in level for level in levels):
        lines += ["", *(balance_line(level) for level in levels)]
    lines += ["", *(f"{level['concurrency']:>7} streams, limit: {level['limit']}" for level in levels)]
    return "\n".join(lines)


def started_services(args: argparse.Namespace, cluster: int) -> StubServices:
    """The services of one layout; beside another layout its logs are named by it."""
    prefix = "saturation" if not args.versus_one_redis else f"saturation-{'cluster' if cluster else 'one'}"
    return StubServices(args.kv_memory, args.logs, args.gateways, args.workers, log_prefix=prefix,
                        max_seqs=args.max_seqs, cluster=cluster, shards=args.shards)  # fmt: skip


def run_all(args: argparse.Namespace) -> dict:
    """The asked layout's levels; with --versus-one-redis, one Redis's too, both up at once and
    measured in turn, and the cluster's capacity derived level by level."""
    layouts = ([0] if args.versus_one_redis else []) + [args.cluster]
    with contextlib.ExitStack() as stack:
        services = [stack.enter_context(started_services(args, cluster)) for cluster in layouts]
        if args.redis_cpu:
            cap = stack.enter_context(CpuCap(args.redis_cpu))
            for node in (node for each in services for node in each.redis_nodes):
                cap.add(node.process.pid)
        asked = services[-1]
        layout = {"nodes": len(asked.redis_nodes), "shards": len(asked.layout.shards), "cluster": bool(args.cluster)}
        server = asked.redis_server
        levels = asyncio.run(measured_levels(services, args))
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cores": os.cpu_count()},
        "redis_server": server,
        "redis_layout": layout,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "levels": levels[-1],
    }
    if args.versus_one_redis:
        one, cluster = levels
        report["one_redis_levels"] = one
        report["capacity"] = [
            capacity_figures(o, c) | saturated_figures(o, c, args.redis_cpu) | {"round": c["round"]}
            for o, c in zip(one, cluster)
        ]
    return report


def save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.gateways, args.workers, args.requests_per_stream, args.max_tokens, args.max_seqs) < 1:
        parser.error("--gateways, --workers, --requests-per-stream, --max-tokens and --max-seqs must be at least 1")
    if args.cluster < 0 or (args.shards is not None and (not args.cluster or args.shards < 1)):
        parser.error("--cluster is 0 (one Redis) or more primaries; --shards, at least 1, only with --cluster")
    if args.rounds < 1 or (args.versus_one_redis and not args.cluster):
        parser.error("--rounds is at least 1; --versus-one-redis needs --cluster")
    print(HEADER, file=sys.stderr, flush=True)
    report = run_all(args) | {"command": " ".join(["python", "bench/service/redis_saturation.py", *argv])}
    print(text_report(report))
    if args.json:
        save(report, args.json)
    return 0 if any(level["completed"] for level in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
