"""Fixtures shared by every tier: a real broker, per-test settings and topic prefixes."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.common.config import Settings, load_settings

pytest_plugins = ["tests.kafka_fixture"]


@pytest.fixture
def unique_prefix() -> str:
    """A topic prefix no other test uses, so tests never see each other's records."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def settings_factory(
    request: pytest.FixtureRequest, unique_prefix: str, tmp_path: Any
) -> Callable[..., Settings]:
    """Builds Settings for a test: the test broker, a unique topic prefix, no metrics ports.

    Keyword arguments are section overrides, e.g. ``provider={"base_url": url}``.
    Tests not marked ``kafka`` get a placeholder bootstrap address.
    """

    def build(**overrides: Any) -> Settings:
        bootstrap = "127.0.0.1:1"
        if request.node.get_closest_marker("kafka") or request.node.get_closest_marker("e2e"):
            bootstrap = request.getfixturevalue("kafka_bootstrap")
        kafka = {"bootstrap_servers": bootstrap, "topic_prefix": unique_prefix, **overrides.pop("kafka", {})}
        metrics = {
            "inference_port": 0,
            "reconstruct_port": 0,
            "audit_port": 0,
            "budget_port": 0,
            "sink_port": 0,
            "simulator_port": 0,
            "continuation_port": 0,
            **overrides.pop("metrics", {}),
        }
        sink = {"out_dir": str(tmp_path / "out"), **overrides.pop("sink", {})}
        return load_settings(None, kafka=kafka, metrics=metrics, sink=sink, **overrides)

    return build


@pytest.fixture(scope="session", autouse=True)
def _slow_collection_log_ends_with_the_session() -> Iterator[None]:
    """A service run in this process installs its slow-collection log on ``gc.callbacks``; pytest's
    last collections come after the log's stream is closed ("--- Logging error ---")."""
    yield
    from services.common import service

    if service._SLOW.on_phase in gc.callbacks:  # noqa: SLF001 - the service's own callback
        gc.callbacks.remove(service._SLOW.on_phase)  # noqa: SLF001
