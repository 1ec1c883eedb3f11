"""`draftstream simulate-provider` serves its metrics where the config says, as a real process.

docker-compose and the Prometheus config expect the simulator's metrics on
``metrics.simulator_port`` (9406) without any ``--metrics-port`` on its command line; these
tests start the CLI with a config file, scrape ``/metrics`` over HTTP, and check that the
option still wins over the config when it is given.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import httpx

from services.demo.run import wait_http

EXE = os.path.join(os.path.dirname(sys.executable), "draftstream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def _start(tmp_path: Path, metrics_port: int, *extra: str) -> tuple[asyncio.subprocess.Process, int, Path]:
    """The simulator CLI with a config naming ``metrics_port``; returns once /health answers."""
    config = tmp_path / "draftstream.toml"
    config.write_text(f'[metrics]\nhost = "127.0.0.1"\nsimulator_port = {metrics_port}\n', encoding="utf-8")
    port = _free_port()
    log_path = tmp_path / "simulator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSTREAM_")}
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            EXE, "simulate-provider", "--config", str(config), "--port", str(port),
            "--reasoning-tokens", "4-8", "--content-tokens", "4-8", *extra,
            stdout=log, stderr=log, env=env,
        )
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", 90)
    except RuntimeError:
        await _stop(proc)
        raise AssertionError(f"simulator did not start: {log_path.read_text()}") from None
    return proc, port, log_path


async def _stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 30)


async def test_metrics_are_served_on_the_configured_port(tmp_path: Path) -> None:
    metrics_port = _free_port()
    proc, port, log_path = await _start(tmp_path, metrics_port)
    try:
        async with httpx.AsyncClient() as client:
            body = {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}]}
            answer = await client.post(f"http://127.0.0.1:{port}/api/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            scraped = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        # the request above was counted by this process: the exposition is the simulator's own
        ok_line = next(
            line for line in scraped.text.splitlines()
            if line.startswith("draftstream_simulator_requests_total{") and 'outcome="ok"' in line
        )
        assert float(ok_line.rsplit(" ", 1)[1]) >= 1.0
    finally:
        assert await _stop(proc) == 0, log_path.read_text()


async def test_the_option_overrides_the_configured_port(tmp_path: Path) -> None:
    configured, chosen = _free_port(), _free_port()
    proc, _, log_path = await _start(tmp_path, configured, "--metrics-port", str(chosen))
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{chosen}/metrics")).status_code == 200
        assert not _listening(configured)
    finally:
        assert await _stop(proc) == 0, log_path.read_text()


async def test_metrics_port_zero_serves_no_metrics(tmp_path: Path) -> None:
    configured = _free_port()
    proc, port, log_path = await _start(tmp_path, configured, "--metrics-port", "0")
    try:
        assert _listening(port)
        assert not _listening(configured)
    finally:
        assert await _stop(proc) == 0, log_path.read_text()
