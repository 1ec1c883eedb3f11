"""The lifecycle every long-running service shares, and how the CLI runs one."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
)

from services.common import memory
from services.common.errors import PortInUse
from services.common.metrics import serve

if TYPE_CHECKING:
    from services.common.config import Settings

log = logging.getLogger(__name__)


@runtime_checkable
class Service(Protocol):
    """A stage or server: started, run until stopped, then closed."""

    async def start(self) -> None:
        """Connect clients and load heavy objects."""

    async def run(self) -> None:
        """Work until :meth:`stop` is called."""

    def stop(self) -> None:
        """Ask :meth:`run` to return soon."""

    async def close(self) -> None:
        """Release what :meth:`start` acquired."""


async def start_with_retry(
    build: Callable[[], Service], *, name: str, timeout_s: float, stopping: asyncio.Event
) -> Service | None:
    """Build and start a service, retrying with a fresh instance while Kafka is unreachable.

    A broker that is restarting or not up yet must not turn a service start into a crash
    loop; after ``timeout_s`` the last error is raised. Returns None when stopped meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        service = build()
        try:
            await service.start()
            return service
        except (TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError):
            with suppress(Exception):
                await service.close()
            raise  # the ACLs will not change by waiting
        except (KafkaError, OSError) as exc:
            with suppress(Exception):
                await service.close()
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s could not start (%s: %s); retrying in %.1f s", name, type(exc).__name__, exc, delay)
        with suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
        if stopping.is_set():
            return None
        delay = min(delay * 2, 10.0)


async def run_service(
    service: Service | Callable[[], Service],
    *,
    name: str,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    start_timeout_s: float = 300.0,
    trim_memory: bool = False,
) -> None:
    """Run a service until SIGINT/SIGTERM, serving its metrics on ``metrics_port``.

    ``trim_memory``: return the C heap's free pages every :data:`services.common.memory.TRIM_EVERY_S`
    (a ``draftstream run`` process, whose allocator :func:`run_from_cli` has tuned).

    A second SIGINT/SIGTERM calls the service's ``stop_now()`` when it has one.

    Given a factory instead of an instance, a start that fails because Kafka cannot be
    reached is retried with a fresh instance for up to ``start_timeout_s``.
    """
    try:
        serve(metrics_port, metrics_host)
    except OSError as exc:
        raise PortInUse(
            f"{name}: cannot serve metrics on {metrics_host}:{metrics_port} ({exc.strerror or exc}): is another "
            f"{name} running? Set [metrics] {name}_port (DRAFTSTREAM_METRICS__{name.upper()}_PORT) to a free "
            "port, or 0 to turn metrics off"
        ) from None
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    current: list[Service] = []

    signals = 0

    def on_signal() -> None:
        # The first signal stops gracefully (work in flight finishes and is committed); a
        # second one stops at once, for a service that can (``stop_now``).
        nonlocal signals
        signals += 1
        stopping.set()
        for running in current:
            stop_now = getattr(running, "stop_now", None)
            if signals > 1 and callable(stop_now):
                log.warning("%s: second signal, stopping at once", name)
                stop_now()
            else:
                running.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    if isinstance(service, Service):
        running = service
        await running.start()
    else:
        started = await start_with_retry(service, name=name, timeout_s=start_timeout_s, stopping=stopping)
        if started is None:
            return
        running = started
    current.append(running)
    if stopping.is_set():
        running.stop()
    log.info("%s started%s", name, f" (metrics on :{metrics_port})" if metrics_port else "")
    freeze_after_start()
    trimming = asyncio.create_task(_trim_every(memory.TRIM_EVERY_S)) if trim_memory else None
    quiet = getattr(running, "quiet", None)
    collector = QuietCollector(quiet) if _FREEZE_AFTER_START and callable(quiet) else None
    if collector is not None:
        collector.start()
    try:
        await running.run()
    finally:
        if collector is not None:
            await asyncio.to_thread(collector.stop)
        await release(trimming)
        await running.close()
        log.info("%s stopped", name)


async def _trim_every(seconds: float) -> None:
    """Hand the C heap's free pages back every ``seconds`` (on a thread: the call releases the GIL)."""
    while True:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(memory.trim)


def run_from_cli(
    name: str, build: Callable[[Settings], Service], *, settings: Settings, log_level: str | None
) -> None:
    """The body of every ``draftstream run <name>``: logging, then :func:`run_service`.

    The command loads ``settings`` (``services.common.cli.settings_from``) and hands them over: this
    module sits below the CLI and never imports it. The metrics port is the ``[metrics]
    <name>_port`` setting, as the port-in-use error says.
    """
    from services.common.logs import setup_logging

    setup_logging(settings, log_level)
    port = int(getattr(settings.metrics, f"{name}_port"))
    collect_garbage_for_a_service()
    memory.tune_allocator()
    asyncio.run(
        run_service(
            lambda: build(settings), name=name, metrics_port=port, metrics_host=settings.metrics.host, trim_memory=True
        )
    )


# The cycle collector's thresholds for a service process: the young generation every 50,000
# allocations (CPython's default: 700), a full collection after 50 x 100 of those.
SERVICE_GC_THRESHOLDS = (50_000, 50, 100)

# A service that says when it is quiet (:class:`QuietCollector`): the young generation every
# 5,000 allocations or every YOUNG_EVERY_S, whichever comes first; the older ones never by count.
QUIET_GC_THRESHOLDS = (5_000, 1_000_000_000, 1_000_000_000)
YOUNG_EVERY_S = 0.025
"""How often :class:`QuietCollector` collects the young generation (and asks whether the service is quiet)."""
QUIET_FOR_S = 5.0
"""Quiet this long (an HTTP pool's idle connections closed meanwhile), a service is collected in full..."""
QUIET_AFTER_YOUNG = 100
"""...when this many young collections ran since the last full one."""
BUSY_COLLECT_AFTER = 6_000
"""Young collections since the last full one after which :class:`QuietCollector` collects
everything even while the service is busy (about 150 s: a bound on the memory cycles can hold)...
"""
CYCLES_SEEN = 10_000
"""...once the young collections since then found this many objects in cycles (a service making
cycles makes some that outlive a young collection, which only a full one frees)..."""
BUSY_COLLECT_MOST = 144_000
"""...or, whatever they found, after this many (about an hour)."""


def collect_garbage_for_a_service() -> None:
    """Set the cycle collector for a long-running service process.

    A worker holds thousands of requests alive for seconds each. With CPython's default
    thresholds their objects outlive the young collections, reach the oldest generation,
    and trigger a full collection every few seconds over everything alive: about a quarter
    of an inference worker's time at 10,000 in flight (docs/bench-history.md, 2026-12-01). Reference counting
    frees nearly all of them anyway; the collector is only for cycles. So the young
    generation is collected rarely, a full collection runs about once a minute at that
    load, and what start-up allocated (modules, settings) is frozen out of every scan.
    """
    global _FREEZE_AFTER_START
    gc.freeze()
    gc.set_threshold(*SERVICE_GC_THRESHOLDS)
    if _SLOW.on_phase not in gc.callbacks:
        gc.callbacks.append(_SLOW.on_phase)
    _FREEZE_AFTER_START = True


_FREEZE_AFTER_START = False


def freeze_after_start() -> None:
    """In a service process: collect once, then freeze what start-up built out of every later scan.

    Start-up allocates most of what a service keeps for good after the entry point froze the
    modules: tokenizers and profiles, clients and their pools, the response store's index.
    Left in the collector's generations, every full collection would scan them again.
    """
    if _FREEZE_AFTER_START:
        gc.collect()
        gc.freeze()
        log.info("froze %d objects built at start-up out of the cycle collector's scans", gc.get_freeze_count())


class QuietCollector:
    """Collects the young generation every :data:`YOUNG_EVERY_S`, the older ones when ``quiet()``.

    A worker with thousands of requests in flight keeps their objects alive for seconds.
    CPython starts a young collection when allocations outnumber deallocations by its
    threshold, and in a steady state the requests that end free about as many objects as
    the new ones allocate: the young generation then grows, uncounted, to most of what is
    in flight, and its collection scans all of it (hundreds of ms) while holding the
    interpreter lock, the halt follower's thread included. Collected on a clock, the young
    generation holds only what the last ``YOUNG_EVERY_S`` allocated. The clock is a thread
    of its own: an event loop saturated by thousands of requests runs a timer late, by
    as long as one of its iterations takes.

    What survives is freed by reference counting when its request ends; only cycles need
    an older collection, which scans everything alive (about a second at 10,000 in flight):
    it runs once in each spell of ``quiet()`` that lasts :data:`QUIET_FOR_S` (little alive,
    a shorter collection), or, busy (or idle) for long, after :data:`BUSY_COLLECT_AFTER`
    young collections if those found :data:`CYCLES_SEEN` objects in cycles, else after
    :data:`BUSY_COLLECT_MOST`: a service that makes no cycles is not stopped to look for them.
    """

    def __init__(self, quiet: Callable[[], bool]) -> None:
        self._quiet = quiet
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cycle-collector", daemon=True)
        self.cycles_seen = 0
        """Objects in cycles the young collections found since the last full collection."""

    def _count(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop":
            return
        if info["generation"] == 0:
            self.cycles_seen += info["collected"]
        elif info["generation"] == 2:
            self.cycles_seen = 0

    def start(self) -> None:
        """Take the collector's thresholds and start the clock."""
        gc.set_threshold(*QUIET_GC_THRESHOLDS)
        gc.callbacks.append(self._count)
        self._thread.start()

    def stop(self) -> None:
        """Stop the clock (blocks for up to one tick) and give the count-based thresholds back."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._count in gc.callbacks:
            gc.callbacks.remove(self._count)
        gc.set_threshold(*SERVICE_GC_THRESHOLDS)

    def _run(self) -> None:
        quiet_since: float | None = None
        collected = False  # this quiet spell had its full collection
        while not self._stopping.wait(YOUNG_EVERY_S):
            gc.collect(0)
            young = gc.get_count()[1]  # young collections since the last older one
            now = time.monotonic()
            if not self._quiet():
                quiet_since, collected = None, False
            elif quiet_since is None:
                quiet_since = now
            if (
                not collected
                and quiet_since is not None
                and now - quiet_since >= QUIET_FOR_S
                and young >= QUIET_AFTER_YOUNG
            ):
                gc.collect()
                collected = True
            elif young >= BUSY_COLLECT_MOST or (young >= BUSY_COLLECT_AFTER and self.cycles_seen >= CYCLES_SEEN):
                log.info(
                    "collecting every generation while busy (%d young collections since the last, "
                    "%d objects in cycles found by them)", young, self.cycles_seen,
                )
                gc.collect()


SLOW_COLLECTION_S = 0.05
"""A collection this long holds the interpreter lock long enough to delay a halt: it is logged."""


class _SlowCollections:
    """Logs each cycle collection that holds the interpreter lock for ``SLOW_COLLECTION_S`` or more.

    While it runs nothing else in the process runs (the control follower's thread included),
    so a slow one explains a late halt or a gap in a benchmark's rate.
    """

    def __init__(self) -> None:
        self._started = 0.0
        self._cpu = 0.0

    def on_phase(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started, self._cpu = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - self._started
        if took >= SLOW_COLLECTION_S:
            # On a shared machine the wall time is mostly waiting for a core; the CPU time
            # is what the collection itself cost.
            log.warning(
                "cycle collection of generation %d took %.0f ms (%.0f ms of CPU; %d collected)",
                info.get("generation", -1),
                took * 1000,
                (time.thread_time() - self._cpu) * 1000,
                info.get("collected", 0),
            )


_SLOW = _SlowCollections()


async def release(*things: Any) -> None:
    """Let go of background tasks and clients, in order: a task is cancelled and awaited, a
    client stopped (``stop()``, or ``aclose()`` for an HTTP client); ``None`` is skipped.
    A failure to let go is logged, never raised: releasing is what a shutdown does last."""
    for thing in things:
        if thing is None:
            continue
        if isinstance(thing, asyncio.Task):
            thing.cancel()
            await asyncio.gather(thing, return_exceptions=True)
            continue
        close = getattr(thing, "aclose", None) or thing.stop
        try:
            await close()
        except Exception:  # noqa: BLE001 - see the docstring
            log.warning("could not release %s", type(thing).__name__, exc_info=True)
