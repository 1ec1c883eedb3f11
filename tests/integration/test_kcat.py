"""A client nobody here wrote (kcat, librdkafka) talks to the broker draftstream runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kafka


def kcat() -> str:
    path = shutil.which("kcat") or shutil.which("kafkacat")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kcat is not installed (make test installs the Debian package)")
        pytest.skip("kcat is not installed: apt-get install kcat")
    return path


def test_kcat_lists_the_broker_and_reads_what_draftstream_wrote(kafka_bootstrap: str, unique_prefix: str) -> None:
    listing = subprocess.run([kcat(), "-b", kafka_bootstrap, "-L"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    host, _, port = kafka_bootstrap.rpartition(":")
    assert f"at {host}:{port}" in listing.stdout, listing.stdout
    # Create the topics with the draftstream CLI, then read them back with kcat.
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "DRAFTSTREAM_KAFKA__TOPIC_PREFIX": unique_prefix}
    created = subprocess.run(
        [sys.executable, "-m", "services.cli", "topics", "create", "-d", "math"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert created.returncode == 0, created.stderr
    assert f"{unique_prefix}prompts.math" in created.stdout
    topics = subprocess.run(
        [kcat(), "-b", kafka_bootstrap, "-L", "-t", f"{unique_prefix}control"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f'topic "{unique_prefix}control" with 1 partitions' in topics.stdout, topics.stdout


def test_broker_status_command_reports_the_running_version(kafka_bootstrap: str) -> None:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and not os.environ.get("KAFKA_PORT"):
        pytest.skip("the broker was given from outside; `draftstream broker status` reports the local one")
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "broker", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Kafka 4.4" in done.stdout
