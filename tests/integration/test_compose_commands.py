"""docker-compose.yml's commands and healthchecks, run here as real processes.

There is no Docker engine to run the images, so each command runs as the image would run
it: the simulator with its compose ``command`` and environment (ports moved to free ones),
probed by its compose healthcheck and scraped by Prometheus's port; the Kafka healthcheck's
tool (``bin/kafka-broker-api-versions.sh`` runs ``BrokerApiVersionsCommand``) from the
Kafka 4.4 jars against a real broker.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from services.demo.run import wait_http

ROOT = Path(__file__).resolve().parents[2]
EXE = os.path.join(os.path.dirname(sys.executable), "draftstream")
KAFKA_LIBS = Path(os.environ.get("KAFKA_LIBS_DIR", ROOT / ".run" / "kafka" / "libs"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    return data["services"]


def _healthcheck(test: list[str], port: str, moved_to: int) -> list[str]:
    """A compose ``CMD`` healthcheck as an argv for this machine (its port moved)."""
    assert test[0] == "CMD"
    argv = [arg.replace(f":{port}/", f":{moved_to}/") for arg in test[1:]]
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


async def test_the_simulator_runs_as_compose_starts_it(tmp_path: Path) -> None:
    services = _services()
    sim = services["simulator"]
    command = list(sim["command"])
    port = command[command.index("--port") + 1]
    api_port, metrics_port = _free_port(), _free_port()
    command[command.index("--port") + 1] = str(api_port)
    # the compose environment, without the caller's pass-through variables; no config file
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "DRAFTSTREAM_"))}
    env.update({k: str(v) for k, v in sim["environment"].items() if v is not None and "${" not in str(v)})
    env["DRAFTSTREAM_METRICS__SIMULATOR_PORT"] = str(metrics_port)  # 9406 in the container
    log_path = tmp_path / "simulator.log"
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(EXE, *command, stdout=log, stderr=log, env=env, cwd=tmp_path)
    probe = _healthcheck(sim["healthcheck"]["test"], port, api_port)
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{api_port}/health", 90)
        healthy = await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True, timeout=30)
        assert healthy.returncode == 0, healthy.stderr
        # Prometheus's simulator job scrapes the port the settings give the simulator
        async with httpx.AsyncClient() as client:
            scraped = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200 and "draftstream_simulator_requests_total" in scraped.text
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, log_path.read_text()
    # the same probe fails once nothing answers: the healthcheck can fail
    down = await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True, timeout=30)
    assert down.returncode != 0


@pytest.mark.kafka
def test_the_kafka_healthcheck_tool_answers_for_a_running_broker(kafka_bootstrap: str) -> None:
    java = shutil.which("java")
    if java is None or not any(KAFKA_LIBS.glob("kafka-tools-*.jar")):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"java or the Kafka jars ({KAFKA_LIBS}) are missing (CI=true: a failure)")
        pytest.skip(f"java or the Kafka jars ({KAFKA_LIBS}) are missing")
    test = _services()["kafka"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "kafka-broker-api-versions.sh --bootstrap-server localhost:9092" in test[1]
    tool = [java, "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", f"{KAFKA_LIBS}/*",
            "org.apache.kafka.tools.BrokerApiVersionsCommand"]
    up = subprocess.run([*tool, "--bootstrap-server", kafka_bootstrap], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "ApiVersions(" in up.stdout or "Produce(" in up.stdout
    closed = subprocess.run(
        [*tool, "--bootstrap-server", f"127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=180
    )
    assert closed.returncode != 0
