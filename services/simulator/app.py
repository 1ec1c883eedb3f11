"""Starting the simulator: in-process (:func:`start_simulator`) or as a long-lived service (:func:`create_app`).

Tests, benchmarks and the demo start one in-process on a free port and read its counters and
its truth through :class:`RunningSimulator`; ``draftstream simulate-provider`` runs the service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from services.common.config import Settings
from services.profiles import ProfileLike
from services.simulator.options import SimulatorOptions, get_profile
from services.simulator.server import SimulatorServer
from services.simulator.serving import RunningServer, serve_app

__all__ = ["RunningSimulator", "SimulatorService", "create_app", "start_simulator"]

log = logging.getLogger(__name__)


class RunningSimulator(RunningServer):
    """A simulator serving on a port, for tests, benchmarks and the demo."""

    def __init__(self, server: SimulatorServer, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner, host, port)
        self.server = server

    def stats(self) -> dict[str, Any]:
        """The same counters ``GET /_sim/stats`` returns."""
        return self.server.stats.snapshot()

    def requests_after(self, t: float) -> int:
        """How many chat requests arrived after unix time ``t``."""
        return self.server.stats.requests_after(t)

    def truth(self) -> dict[str, list[int]]:
        """What ``GET /_sim/truth`` serves: sample key -> true output ids of its last full answer."""
        if self.server.truth is None:
            raise RuntimeError("this simulator keeps no truth: start it with SimulatorOptions(keep_truth=True)")
        return dict(self.server.truth)


async def start_simulator(
    options: SimulatorOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    profile: ProfileLike | None = None,
) -> RunningSimulator:
    """Start a simulator on ``host:port`` (0: any free port) and return once it accepts requests."""
    options = options or SimulatorOptions()
    if profile is None:
        profile = await asyncio.to_thread(get_profile, options.profile)
    server = SimulatorServer(options, profile)
    runner, bound = await serve_app(server.web_app(), host, port)
    log.info("simulator (%s) listening: set [provider] base_url = \"http://%s:%d/api/v1\"", profile.name, host, bound)
    return RunningSimulator(server, runner, host, bound)


QUIET_OPEN = 100
"""At most this many requests open, the simulator counts as quiet (:meth:`SimulatorService.quiet`)."""


class SimulatorService:
    """The simulator as a long-lived :class:`services.common.service.Service`."""

    def __init__(self, options: SimulatorOptions, host: str, port: int, profile: ProfileLike | None) -> None:
        self.options = options
        self.host = host
        self.port = port
        self._profile = profile
        self._running: RunningSimulator | None = None
        self._stopped = asyncio.Event()

    @property
    def running(self) -> RunningSimulator | None:
        """The live server once started."""
        return self._running

    async def start(self) -> None:
        """Load the profile and start listening."""
        self._running = await start_simulator(self.options, self.host, self.port, profile=self._profile)

    def quiet(self) -> bool:
        """Whether few requests are open: a full cycle collection is short now.

        At thousands of requests open, CPython's own thresholds ran full collections of
        everything alive (0.1–0.6 s at 8,000 open), during which the simulator answers and
        stamps nothing; with this, :class:`services.common.service.QuietCollector` keeps
        them to its quiet spells.
        """
        return self._running is None or self._running.server.stats.open <= QUIET_OPEN

    async def run(self) -> None:
        """Serve until :meth:`stop`."""
        await self._stopped.wait()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stopped.set()

    async def close(self) -> None:
        """Stop listening."""
        if self._running is not None:
            await self._running.close()
            self._running = None


def create_app(
    settings: Settings,
    *,
    options: SimulatorOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 8099,
    profile: ProfileLike | None = None,
) -> SimulatorService:
    """Composition root: a simulator service (``settings`` reserved for metrics and defaults)."""
    del settings  # the simulator needs nothing from the pipeline's settings yet
    return SimulatorService(options or SimulatorOptions(), host, port, profile)
