"""Fixtures shared by every tier: a real broker, per-test settings and topic prefixes."""

from __future__ import annotations

import gc
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.common.config import Settings, load_settings

pytest_plugins = ["tests.kafka_fixture"]


def pytest_configure(config: pytest.Config) -> None:
    # The smallest session timeout a broker accepts by default (group.min.session.timeout.ms):
    # a test that SIGKILLs a consumer waits this long for the group to hand its partitions
    # on. Set in the environment, it reaches the service processes tests start too.
    os.environ.setdefault("DRAFTSTREAM_KAFKA__SESSION_TIMEOUT_S", "6")


@pytest.hookimpl(trylast=True)  # after pytest's own regrouping by fixture
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, spread the tests marked ``long`` over the workers and run them first.

    The work-stealing scheduler hands worker k the k-th of N consecutive slices of the
    collection, and an idle worker later takes the tail half of the longest queue. Each slice
    here starts with its share of the long tests, longest first (``long(seconds)``, about what
    the test takes here; 20 when not given), dealt to the slice with the fewest seconds so far,
    so that they wait side by side from the start instead of one after another at the end. A
    module marked ``long(seconds, together=True)`` (its tests share a broker of their own, a
    module fixture) goes to one slice whole, so that one worker alone starts that broker.
    Every worker computes the same order, as xdist requires.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    units: dict[str, tuple[float, list[pytest.Item]]] = {}
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None:
            key = item.nodeid.split("::")[0] if mark.kwargs.get("together") else item.nodeid
            seconds = float(mark.args[0]) if mark.args else 20.0
            units.setdefault(key, (seconds, []))[1].append(item)
    if workers < 2 or not units:
        return
    long = {id(item) for _, unit in units.values() for item in unit}
    rest = [item for item in items if id(item) not in long]
    sizes, left = [], len(items)
    for k in range(workers):
        sizes.append(left // (workers - k))  # what the scheduler sends worker k (WorkStealingScheduling)
        left -= sizes[-1]
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for seconds, unit in sorted(units.values(), key=lambda u: -u[0]):
        k = loads.index(min(loads))
        shares[k] += unit
        loads[k] += seconds
    if any(len(share) > size for share, size in zip(shares, sizes, strict=True)):
        items[:] = [item for share in shares for item in share] + rest  # a few tests: the long ones first
        return
    ordered: list[pytest.Item] = []
    for share, size in zip(shares, sizes, strict=True):
        ordered += share + rest[: size - len(share)]
        del rest[: size - len(share)]
    items[:] = ordered + rest


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


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A service command run in this process (``run sink`` through a CLI runner) sets up logging
    for the whole process: a root handler on stderr that would put a later command's aiokafka
    errors next to its one error line. Each test leaves the root logger as it found it."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], level = saved
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _slow_collection_log_ends_with_the_session() -> Iterator[None]:
    """A service run in this process installs its slow-collection log on ``gc.callbacks``; pytest's
    last collections come after the log's stream is closed ("--- Logging error ---")."""
    yield
    from services.common import service

    if service._SLOW.on_phase in gc.callbacks:  # noqa: SLF001 - the service's own callback
        gc.callbacks.remove(service._SLOW.on_phase)  # noqa: SLF001
