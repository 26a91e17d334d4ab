"""The Kubernetes manifests in compose/k8s/ are valid and agree with lmq and with each other.

No cluster runs here. The core objects are validated against the Kubernetes API schemas that the
`kubernetes-validate` package ships (strict: an unknown field is an error); the KEDA objects,
custom resources it does not know, are checked against KEDA's documented spec for ScaledObject,
TriggerAuthentication and the redis-streams trigger (https://keda.sh/docs/latest/scalers/redis-streams/).
Settings in the ConfigMaps are read with the lmq CLI's own parser, as in tests/compose/test_compose.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

import protocol
from gateway.config import GatewayConfig
from lmq.checks import check_gateway, check_worker
from lmq.settings import build, env_name
from worker.config import WorkerConfig, parse_kv_memory

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "compose" / "k8s"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
KUSTOMIZATION = K8S / "kustomization.yaml"
EXAMPLES = sorted(K8S.glob("*.example.yaml"))

# The oldest Kubernetes still commonly run, and the newest the package knows.
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]

# KEDA's documented fields (ScaledObject spec, the redis-streams trigger's metadata, TriggerAuthentication).
SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
SCALE_TARGET_REF = {"apiVersion", "kind", "name", "envSourceContainerName"}
TRIGGER = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
REDIS_STREAMS_METADATA = {
    "address",
    "host",
    "port",
    "addressFromEnv",
    "hostFromEnv",
    "portFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "enableTLS",
    "unsafeSsl",
    "databaseIndex",
}
# TriggerAuthentication parameters the redis-streams scaler reads.
REDIS_STREAMS_AUTH_PARAMETERS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}
TRIGGER_AUTHENTICATION_SPEC = {
    "secretTargetRef",
    "env",
    "configMapTargetRef",
    "podIdentity",
    "hashiCorpVault",
    "azureKeyVault",
    "awsSecretManager",
    "gcpSecretManager",
    "boundServiceAccountToken",
}


def load(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load(KUSTOMIZATION.read_text())


@pytest.fixture(scope="module")
def objects(kustomization: dict) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, for everything `kubectl apply -k compose/k8s` applies."""
    found = {}
    for resource in kustomization["resources"]:
        for document in load(K8S / resource):
            key = (document["kind"], document["metadata"]["name"])
            assert key not in found, f"{key} is defined twice"
            found[key] = document
    return found


def core_documents() -> list[tuple[str, dict]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        for document in load(path):
            if document["apiVersion"].startswith(("keda.sh/", "kustomize.config.k8s.io/")):
                continue
            documents.append((f"{path.name}:{document['kind']}/{document['metadata']['name']}", document))
    return documents


def pod_templates(objects: dict) -> dict[str, dict]:
    return {
        name: obj["spec"]["template"] for (kind, name), obj in objects.items() if kind in ("Deployment", "StatefulSet")
    }


def container(objects: dict, kind: str, name: str) -> dict:
    (only,) = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return only


def config_map(objects: dict, container_spec: dict) -> dict[str, str]:
    (source,) = container_spec["envFrom"]
    return objects[("ConfigMap", source["configMapRef"]["name"])]["data"]


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("3Gi", "250m", "2") as a number (bytes or cores)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, text
    factor = {
        None: 1,
        "m": 1e-3,
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
    }
    return float(match.group(1)) * factor[match.group(2)]


def dockerfile_user() -> tuple[int, int]:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    return int(user[0]), int(user[1])


# ---------------------------------------------------------------- the files


def test_kustomization_applies_every_manifest_but_the_examples(kustomization: dict) -> None:
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kustomization["kind"] == "Kustomization"
    manifests = {path.name for path in K8S.glob("*.yaml")} - {KUSTOMIZATION.name} - {path.name for path in EXAMPLES}
    assert set(kustomization["resources"]) == manifests
    assert kustomization["namespace"] == "lmq"
    assert [image["name"] for image in kustomization["images"]] == ["lmq"]


def test_no_secret_value_is_applied(objects: dict) -> None:
    """The Redis password is made at install time (kubectl create secret), never kept in these files."""
    assert not [key for key in objects if key[0] == "Secret"]
    (example,) = [document for path in EXAMPLES for document in load(path) if document["kind"] == "Secret"]
    assert example["metadata"]["name"] == "lmq-redis" and set(example["stringData"]) == {"password"}
    assert "REPLACE" in example["stringData"]["password"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("where", "document"), core_documents(), ids=[where for where, _ in core_documents()])
def test_core_objects_match_the_kubernetes_schemas(where: str, document: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{where} (Kubernetes {error.version}): {'.'.join(map(str, error.path))}: {error.message}")


def test_objects_take_their_namespace_from_the_kustomization(objects: dict, kustomization: dict) -> None:
    (namespace,) = [obj for (kind, _), obj in objects.items() if kind == "Namespace"]
    assert namespace["metadata"]["name"] == kustomization["namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for (kind, name), obj in objects.items():
        assert obj["metadata"].get("namespace", kustomization["namespace"]) == kustomization["namespace"], (kind, name)


# ---------------------------------------------------------------- pods


def test_every_pod_meets_the_restricted_pod_security_standard(objects: dict) -> None:
    templates = pod_templates(objects)
    assert set(templates) == {"lmq-redis", "lmq-gateway", "lmq-worker"}
    uid, gid = dockerfile_user()
    for name, template in templates.items():
        spec = template["spec"]
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, name
        assert context["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["enableServiceLinks"] is False, (
            f"{name}: service links would put *_PORT variables in the environment"
        )
        assert spec["automountServiceAccountToken"] is False, name
        if name != "lmq-redis":
            assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), (
                f"{name}: the image's user (compose/Dockerfile)"
            )
        for each in spec["containers"]:
            assert each["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert each["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            resources = each["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"]), name


def test_pods_reach_redis_with_the_password_from_the_secret(objects: dict) -> None:
    service = objects[("Service", "lmq-redis")]
    (port,) = service["spec"]["ports"]
    for name in ("lmq-gateway", "lmq-worker"):
        env = container(objects, "Deployment", name)["env"]
        names = [variable["name"] for variable in env]
        # Kubernetes expands $(REDIS_PASSWORD) only from variables defined before.
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), name
        password = env[names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"]
        assert (password["name"], password["key"]) == ("lmq-redis", "password")
        url = urlsplit(env[names.index("REDIS_URL")]["value"])
        assert url.scheme == "redis" and url.password == "$(REDIS_PASSWORD)", name
        assert (url.hostname, url.port) == (service["metadata"]["name"], port["port"]), name
    redis = container(objects, "StatefulSet", "lmq-redis")
    (variable,) = redis["env"]
    assert variable["name"] == "REDIS_PASSWORD" and variable["valueFrom"]["secretKeyRef"] == {
        "name": "lmq-redis",
        "key": "password",
    }
    assert any(p["containerPort"] == 6379 and p["name"] == port["targetPort"] for p in redis["ports"])


def test_redis_persists_and_refuses_writes_before_it_runs_out_of_memory(objects: dict) -> None:
    redis = objects[("StatefulSet", "lmq-redis")]
    assert redis["spec"]["replicas"] == 1, "one primary: lmq does not support Redis replicas or cluster mode"
    (only,) = redis["spec"]["template"]["spec"]["containers"]
    command = " ".join(only["command"])
    assert '--requirepass "$REDIS_PASSWORD"' in command and "--appendonly yes" in command
    assert "--maxmemory-policy noeviction" in command, "an evicted request stream loses requests"
    maxmemory = re.search(r"--maxmemory (\d+)mb", command)
    assert maxmemory and int(maxmemory.group(1)) << 20 < quantity(only["resources"]["limits"]["memory"])
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in only["volumeMounts"]
    assert only["securityContext"]["readOnlyRootFilesystem"] is True


def test_gateway_deployment_and_service(objects: dict) -> None:
    deployment = objects[("Deployment", "lmq-gateway")]
    gateway = container(objects, "Deployment", "lmq-gateway")
    settings = config_map(objects, gateway)
    assert gateway["args"] == ["gateway"]
    assert deployment["spec"]["replicas"] >= 2, "two gateways, so one can restart"
    (port,) = gateway["ports"]
    assert port["containerPort"] == int(settings["PORT"]) and settings["LMQ_HOST"] == "0.0.0.0"
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    # preStop, then up to 60 s of draining open requests (aiohttp's shutdown timeout), then a margin.
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(pre_stop[1]) + 60
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    service = objects[("Service", "lmq-gateway")]
    assert service["spec"]["selector"] == labels
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]
    budget = objects[("PodDisruptionBudget", "lmq-gateway")]
    assert budget["spec"]["selector"]["matchLabels"] == labels and budget["spec"]["minAvailable"] >= 1
    # API keys come from an optional Secret: absent, the gateway runs without authentication.
    (keys,) = [variable for variable in gateway["env"] if variable["name"] == "LMQ_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"]["optional"] is True


def test_worker_deployment_is_sized_and_outlasts_its_grace_period(objects: dict) -> None:
    deployment = objects[("Deployment", "lmq-worker")]
    worker = container(objects, "Deployment", "lmq-worker")
    settings = config_map(objects, worker)
    assert worker["args"] == ["worker"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > float(settings["LMQ_GRACE_SECONDS"])
    (port,) = worker["ports"]
    assert port["containerPort"] == int(settings["LMQ_METRICS_PORT"]) > 0
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/metrics", "port": port["name"]}, probe
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "time to load a large model"
    # A new worker must serve before an old one leaves.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    requests, limits = worker["resources"]["requests"], worker["resources"]["limits"]
    assert int(settings["LMQ_THREADS"]) == quantity(requests["cpu"]), "one torch thread per requested core"
    assert settings["LMQ_DEVICE"] == "cpu"
    kv_bytes = parse_kv_memory(settings["LMQ_KV_MEMORY"])
    assert kv_bytes and quantity(limits["memory"]) >= kv_bytes + (1 << 30), "the KV cache, the model and torch fit"


@pytest.mark.parametrize(
    ("name", "config_class", "check"),
    [("lmq-gateway", GatewayConfig, check_gateway), ("lmq-worker", WorkerConfig, check_worker)],
)
def test_config_maps_hold_lmq_settings_the_cli_accepts(objects: dict, name: str, config_class: type, check) -> None:
    settings = objects[("ConfigMap", name)]["data"]
    known = {env_name(field) for field in dataclasses.fields(config_class)}
    assert set(settings) <= known, f"not settings of {config_class.__name__}: {set(settings) - known}"
    assert not {"LMQ_WORKER_ID", "LMQ_GATEWAY_ID"} & set(settings), "unique per process: leave unset"
    assert "REDIS_URL" not in settings, "REDIS_URL carries the password: it is built from the Secret"
    assert all(isinstance(value, str) for value in settings.values())
    config = build(config_class, argparse.Namespace(), environ=settings)  # raises on a value the CLI cannot parse
    check(config)  # raises on a setting the CLI refuses at start-up


# ---------------------------------------------------------------- KEDA


def test_trigger_authentication_reads_the_redis_secret(objects: dict) -> None:
    authentication = objects[("TriggerAuthentication", "lmq-redis")]
    assert authentication["apiVersion"] == "keda.sh/v1alpha1"
    assert set(authentication["spec"]) <= TRIGGER_AUTHENTICATION_SPEC
    (reference,) = authentication["spec"]["secretTargetRef"]
    assert set(reference) == {"parameter", "name", "key"}
    assert reference["parameter"] in REDIS_STREAMS_AUTH_PARAMETERS
    assert (reference["parameter"], reference["name"], reference["key"]) == ("password", "lmq-redis", "password")


def test_scaled_object_scales_workers_on_the_request_stream(objects: dict, kustomization: dict) -> None:
    scaled = objects[("ScaledObject", "lmq-worker")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
    target = spec["scaleTargetRef"]
    assert set(target) <= SCALE_TARGET_REF
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment"), target["name"]) == (
        "apps/v1",
        "Deployment",
        "lmq-worker",
    )
    # Gateways are ready only while a worker serves: with none, no request arrives to scale up on.
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert "idleReplicaCount" not in spec
    assert isinstance(spec["pollingInterval"], int) and spec["pollingInterval"] > 0

    worker = container(objects, "Deployment", "lmq-worker")
    settings = config_map(objects, worker)
    redis_service = objects[("Service", "lmq-redis")]
    (redis_port,) = redis_service["spec"]["ports"]
    redis_url = urlsplit(next(v["value"] for v in worker["env"] if v["name"] == "REDIS_URL"))
    triggers = spec["triggers"]
    assert triggers
    modes = set()
    for trigger in triggers:
        assert set(trigger) <= TRIGGER and trigger["type"] == "redis-streams"
        metadata = trigger["metadata"]
        assert set(metadata) <= REDIS_STREAMS_METADATA, set(metadata) - REDIS_STREAMS_METADATA
        assert all(isinstance(value, str) for value in metadata.values()), "KEDA metadata values are strings"
        # The KEDA operator runs in its own namespace: the Service's name with the namespace.
        assert (
            metadata["address"]
            == f"{redis_service['metadata']['name']}.{kustomization['namespace']}.svc:{redis_port['port']}"
        )
        assert int(metadata.get("databaseIndex", "0")) == int(redis_url.path.strip("/") or 0)
        assert metadata["stream"] == protocol.request_stream(settings["LMQ_MODEL_NAME"])
        assert metadata["consumerGroup"] == protocol.REQUEST_GROUP
        # KEDA reads lagCount when given (and then ignores pendingEntriesCount): one per trigger.
        (mode,) = {"pendingEntriesCount", "lagCount", "streamLength"} & set(metadata)
        assert int(metadata[mode]) > 0
        modes.add(mode)
        if mode == "pendingEntriesCount":
            # Pending entries are the requests workers hold, at most LMQ_MAX_SEQS each: a target at
            # or above that could never ask for a worker more than there are.
            assert int(metadata[mode]) < int(settings["LMQ_MAX_SEQS"])
        if mode == "lagCount":
            assert "activationLagCount" in metadata
        assert trigger["authenticationRef"]["name"] in {
            name for kind, name in objects if kind == "TriggerAuthentication"
        }
        assert "passwordFromEnv" not in metadata, "one source of the password: the TriggerAuthentication"
    assert modes == {"pendingEntriesCount", "lagCount"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_scaled_object_behavior_is_a_valid_autoscaler_behavior(objects: dict, version: str) -> None:
    """KEDA hands `advanced.horizontalPodAutoscalerConfig` to the HPA it creates: check it as one."""
    spec = objects[("ScaledObject", "lmq-worker")]["spec"]
    autoscaler = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-lmq-worker"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "lmq-worker"},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    kubernetes_validate.validate(autoscaler, version, strict=True)
    scale_down = autoscaler["spec"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 60, "do not stop workers on a short lull"
