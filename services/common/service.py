"""The lifecycle every long-running service shares, and how the CLI runs one."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from services.common.metrics import serve

log = logging.getLogger(__name__)


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


async def run_service(service: Service, *, name: str, metrics_port: int = 0, metrics_host: str = "127.0.0.1") -> None:
    """Run a service until SIGINT/SIGTERM, serving its metrics on ``metrics_port``."""
    serve(metrics_port, metrics_host)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stop)
    await service.start()
    log.info("%s started%s", name, f" (metrics on :{metrics_port})" if metrics_port else "")
    try:
        await service.run()
    finally:
        await service.close()
        log.info("%s stopped", name)
