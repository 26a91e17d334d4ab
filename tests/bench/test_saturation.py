"""bench/service/redis_saturation.py: the figures it derives from measured seconds, and its smallest real run.

The real run starts an embedded Redis, one `lmq gateway` process and one stub worker (the default
model's tokenizer with a transformer that answers at once), streams 4 requests of 4 tokens, and reads
the report it writes. No figure is asserted beyond what the run must produce. The cluster run does
the same on three primaries with six request shards: with enough requests, each primary's shards
get some, so each primary runs some of the workers' step scripts.
"""

from __future__ import annotations

import json

import pytest

from bench.harness.stats import RequestResult, summarize
from bench.service import redis_saturation


def test_level_figures_per_10k_tokens_utilisation_and_command_ranking():
    results = [RequestResult(start=0.0, first_token=0.1, end=2.0, output_tokens=2500) for _ in range(4)]
    summary = summarize(4, results, wall_s=2.0)  # 10,000 tokens in 2 s
    cpu_s = {"redis": 0.5, "gateway": 2.0, "worker": 3.0, "client": 1.0}
    commands = {
        "publish": {"calls": 300, "usec": 20_000},
        "evalsha": {"calls": 100, "usec": 90_000},
        "xadd": {"calls": 4, "usec": 100},
    }
    level = redis_saturation.level_figures(summary, cpu_s, commands, gateways=2, workers=3, cores_busy=1.0)

    assert level["output_tok_s"] == pytest.approx(5000.0)
    assert level["utilisation"] == pytest.approx({"redis": 0.25, "gateway": 0.5, "worker": 0.5, "client": 0.5})
    assert level["cpu_s_per_10k_tokens"] == pytest.approx(cpu_s)  # exactly 10k tokens
    assert level["redis_core_tok_s"] == pytest.approx(20_000.0)
    assert [c["command"] for c in level["redis_commands"]] == ["evalsha", "publish", "xadd"]
    assert level["redis_commands"][0]["usec_per_10k_tokens"] == pytest.approx(90_000)
    assert level["limit"] == "none measured (latency-bound)"


def test_the_step_scripts_calls_are_evalsha_s_less_the_reads():
    """A worker's read is one script with one XREVRANGE in it (worker/claims.py READ_LUA)."""
    summary = summarize(
        4, [RequestResult(start=0.0, first_token=0.1, end=2.0, output_tokens=5000) for _ in range(4)], 2.0
    )
    cpu_s = {"redis": 0.5, "gateway": 2.0, "worker": 3.0, "client": 1.0}
    commands = {
        "evalsha": {"calls": 700, "usec": 90_000},
        "xrevrange": {"calls": 200, "usec": 2_000},
        "xread": {"calls": 150, "usec": 1_000},
    }
    level = redis_saturation.level_figures(summary, cpu_s, commands, gateways=2, workers=3, cores_busy=1.0)
    calls = level["script_calls_per_10k_tokens"]  # 20k tokens: half the calls per 10k
    assert calls == pytest.approx({"evalsha": 350, "reads": 100, "step_scripts": 250, "waits": 75})
    assert "step scripts 250 (EVALSHA 350 less 100 reads), waits (XREAD) 75" in redis_saturation.calls_line(level)


def test_a_level_without_tokens_has_no_per_token_figures():
    summary = summarize(2, [RequestResult(start=0.0, end=1.0, error="HTTP 503: busy")], wall_s=1.0)
    cpu_s = {"redis": 0.0, "gateway": 0.1, "worker": 0.1, "client": 0.1}
    level = redis_saturation.level_figures(summary, cpu_s, {"ping": {"calls": 1, "usec": 1}}, 1, 1, cores_busy=0.3)
    assert level["redis_core_tok_s"] is None
    assert set(level["cpu_s_per_10k_tokens"].values()) == {None}
    assert level["redis_commands"][0]["calls_per_10k_tokens"] is None
    assert level["script_calls_per_10k_tokens"] is None


def test_limit_names_the_full_machine_first_then_the_busiest_process():
    idle = {"redis": 0.2, "gateway": 0.3, "worker": 0.1, "client": 0.4}
    assert redis_saturation.limit(idle, cores_busy=7.5, cores=8).startswith("machine")
    assert redis_saturation.limit(idle | {"redis": 0.97}, cores_busy=3.0, cores=8).startswith("redis")
    assert redis_saturation.limit(idle | {"client": 0.95, "redis": 0.93}, cores_busy=3.0, cores=8).startswith("client")
    assert redis_saturation.limit(idle, cores_busy=3.0, cores=8).startswith("none")


def test_cluster_nodes_get_shares_and_the_busiest_node_decides_the_limit():
    summary = summarize(
        4, [RequestResult(start=0.0, first_token=0.1, end=2.0, output_tokens=2500) for _ in range(4)], wall_s=2.0
    )
    cpu_s = {"redis": 2.4, "gateway": 0.2, "worker": 0.2, "client": 0.2}
    per_node = [
        {"evalsha": {"calls": 50, "usec": 9_000}, "publish": {"calls": 10, "usec": 100}},
        {"evalsha": {"calls": 30, "usec": 4_000}},
        {},
    ]
    nodes = [(1.9, per_node[0]), (0.4, per_node[1]), (0.1, per_node[2])]
    commands = redis_saturation.summed(per_node)
    level = redis_saturation.level_figures(summary, cpu_s, commands, gateways=1, workers=1, cores_busy=1.0, nodes=nodes)

    assert commands == {"evalsha": {"calls": 80, "usec": 13_000}, "publish": {"calls": 10, "usec": 100}}
    assert level["utilisation"]["redis"] == pytest.approx(0.4), "the mean over the three nodes"
    assert [n["cpu_share"] for n in level["redis_nodes"]] == pytest.approx([1.9 / 2.4, 0.4 / 2.4, 0.1 / 2.4])
    assert [n["evalsha_calls"] for n in level["redis_nodes"]] == [50, 30, 0]
    assert list(level["redis_nodes"][0]["top_commands"]) == ["evalsha", "publish"]
    assert level["redis_max_node_utilisation"] == pytest.approx(0.95)
    assert level["limit"].startswith("redis (0.95"), "one full node fills the cluster though the mean is 0.4"


async def test_round_robin_spreads_requests_over_the_gateways():
    class Gateway:
        def __init__(self):
            self.bodies: list[dict] = []

        async def stream_chat(self, body: dict, timeout_s: float) -> RequestResult:
            self.bodies.append(body)
            return RequestResult(start=0.0)

    gateways = [Gateway(), Gateway(), Gateway()]
    spread = redis_saturation.RoundRobin(gateways)
    for i in range(7):
        await spread.stream_chat({"n": i}, 1.0)
    assert [[b["n"] for b in g.bodies] for g in gateways] == [[0, 3, 6], [1, 4], [2, 5]]


def test_bad_arguments_are_rejected():
    bad_arguments = (["--gateways", "0"], ["--workers", "0"], ["--streams", "0,4"], ["--max-tokens", "0"],
                     ["--cluster", "-1"], ["--shards", "4"], ["--cluster", "3", "--shards", "0"], ["--versus-one-redis"],
                     ["--cluster", "3", "--rounds", "0"], ["--max-seqs", "0"])  # fmt: skip
    for bad in bad_arguments:
        with pytest.raises(SystemExit):
            redis_saturation.main(bad)


@pytest.mark.slow
def test_the_smallest_real_run_reports_every_figure(tmp_path):
    out = tmp_path / "saturation.json"
    # 512 tokens: enough work that the stub worker's CPU time is counted in /proc's 10 ms ticks
    # (16 tokens took 21 ms and the worker's count read 0 on CI).
    args = ["--gateways", "1", "--workers", "1", "--streams", "2", "--requests-per-stream", "4", "--max-tokens", "64",
            "--kv-memory", "64MiB", "--level-timeout", "120", "--logs", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert redis_saturation.main(args) == 0
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert (level["completed"], level["errors"], level["output_tokens"]) == (8, 0, 512)
    assert set(level["cpu_s"]) == set(level["utilisation"]) == {"redis", "gateway", "worker", "client"}
    assert level["cpu_s"]["worker"] > 0 and level["machine_cores_busy"] > 0
    commands = {c["command"]: c for c in level["redis_commands"]}
    assert commands["evalsha"]["calls"] > 0, "the workers' step script runs as EVALSHA"
    assert commands["xadd"]["calls"] >= 4, "each request was appended to the request stream"
    assert report["redis_server"] and report["command"].startswith("python bench/service/redis_saturation.py")
    assert sorted(path.name for path in (tmp_path / "logs").iterdir()) == [
        "saturation-gateway-0.log",
        "saturation-worker-0.log",
    ]


@pytest.mark.slow
def test_a_cluster_run_reports_every_node_and_spreads_the_step_scripts_over_all_primaries(tmp_path):
    out = tmp_path / "saturation.json"
    args = ["--cluster", "3", "--shards", "6", "--gateways", "1", "--workers", "1", "--streams", "6", "--requests-per-stream", "4",
            "--max-tokens", "4", "--kv-memory", "64MiB", "--level-timeout", "120", "--logs", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert redis_saturation.main(args) == 0
    report = json.loads(out.read_text())
    assert report["redis_layout"] == {"nodes": 3, "shards": 6, "cluster": True}
    [level] = report["levels"]
    assert (level["completed"], level["errors"], level["output_tokens"]) == (24, 0, 96)
    nodes = level["redis_nodes"]
    assert len(nodes) == 3 and all(
        set(node) == {"cpu_s", "utilisation", "cpu_share", "evalsha_calls", "top_commands"} for node in nodes
    )
    if level["cpu_s"]["redis"] > 0:  # CPU time is counted in clock ticks (10 ms): a short level may show none
        assert sum(node["cpu_share"] for node in nodes) == pytest.approx(1.0)
    assert level["redis_max_node_utilisation"] == max(node["utilisation"] for node in nodes)
    assert all(node["evalsha_calls"] > 0 for node in nodes), f"24 requests over 6 shards reach every primary: {nodes}"
    commands = {c["command"]: c for c in level["redis_commands"]}
    assert commands["evalsha"]["calls"] == sum(node["evalsha_calls"] for node in nodes), (
        "the commandstats are summed over the nodes"
    )
    assert commands["xadd"]["calls"] >= 24, "each request was appended to its shard's request stream"
    assert report["redis_server"].startswith("valkey")


def test_capacity_is_one_redis_cpu_per_token_over_the_busiest_nodes():
    def level(tokens: int, node_cpu: list[float]) -> dict:
        summary = summarize(4, [RequestResult(start=0.0, first_token=0.1, end=2.0, output_tokens=tokens // 4)] * 4, 2.0)
        cpu_s = {"redis": sum(node_cpu), "gateway": 0.1, "worker": 0.1, "client": 0.1}
        nodes = [(cpu, {}) for cpu in node_cpu]
        return redis_saturation.level_figures(summary, cpu_s, {}, 1, 1, cores_busy=1.0, nodes=nodes)

    one = level(10_000, [0.3])  # 300 ms per 10k tokens
    cluster = level(20_000, [0.24, 0.16, 0.2])  # the busiest: 0.24 s for 20k tokens, 120 ms per 10k
    figures = redis_saturation.capacity_figures(one, cluster)
    assert figures["one_redis_ms_per_10k"] == pytest.approx(300)
    assert figures["busiest_ms_per_10k"] == pytest.approx(120)
    assert figures["busiest_share"] == pytest.approx(0.4)
    assert figures["capacity"] == pytest.approx(2.5)
    assert figures["node_balance"] == pytest.approx(1.5)
    assert "300 ms ÷ 120 ms" in redis_saturation.capacity_line(figures, 1)
    assert redis_saturation.capacity_figures(one, level(20_000, [0.2, 0.0, 0.1]))["capacity"] is None
    assert "capacity_beyond_idle" not in figures, "no idle figures measured"

    idle_one = one | {"redis_idle_cpu_per_s": [0.05]}  # 2 s at 50 ms/s: 100 of its 300 ms are idle
    idle_cluster = cluster | {"redis_idle_cpu_per_s": [0.02, 0.0, 0.0]}  # the busiest: 240 - 40 ms
    beyond = redis_saturation.capacity_figures(idle_one, idle_cluster)
    assert beyond["one_redis_beyond_idle_ms_per_10k"] == pytest.approx(200)
    assert beyond["busiest_beyond_idle_ms_per_10k"] == pytest.approx(100)
    assert beyond["capacity_beyond_idle"] == pytest.approx(2.0)
    assert "200 ms ÷ 100 ms = 2.00×" in redis_saturation.capacity_line(beyond, 1)


def test_capped_nodes_compare_by_tokens_per_second_beside_each_node_s_cpu_over_its_cap():
    def level(tok_s: float, node_cpu: list[float]) -> dict:
        nodes = [{"utilisation": cpu} for cpu in node_cpu]
        return {"output_tok_s": tok_s, "redis_nodes": nodes}

    figures = redis_saturation.saturated_figures(level(1_000, [0.01]), level(2_600, [0.01, 0.0095, 0.0098]), 0.01)
    assert figures["saturated_capacity"] == pytest.approx(2.6)
    assert figures["share_of_cap"]["one_redis"] == pytest.approx(1.0)
    assert figures["share_of_cap"]["cluster"] == pytest.approx([1.0, 0.95, 0.98])
    assert redis_saturation.saturated_figures(level(1_000, [0.01]), level(2_600, [0.01]), None) == {}, "no cap"


def test_balance_counts_only_samples_with_requests_waiting():
    samples = [(0, {"a": 0, "b": 0}), (3, {"a": 4, "b": 0}), (1, {"a": 4, "b": 2}), (2, {"a": 2})]
    figures = redis_saturation.balance_figures(samples, ["a", "b"], max_seqs=4)
    assert (figures["samples"], figures["backlog_samples"]) == (4, 3)
    a, b = figures["workers"]["a"], figures["workers"]["b"]
    assert (a["idle_share"], a["full_share"], a["held_share"]) == pytest.approx((0, 2 / 3, 10 / 12))
    assert (b["idle_share"], b["full_share"], b["held_share"]) == pytest.approx((2 / 3, 0, 2 / 12))
    assert redis_saturation.balance_figures([(0, {"a": 1})], ["a"], 4)["workers"]["a"]["idle_share"] is None
