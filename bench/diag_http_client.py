"""Diagnostic (not in the table): can one process keep N requests in flight with httpx vs aiohttp?

Same simulator (own process, fixed latency), same request body, no Kafka: each client
keeps ``--inflight`` requests going for ``--seconds`` and reports completed req/s
against the ideal in-flight / latency. Used to locate benchmark 3's bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import httpx

from bench.common import free_port, processes, simulator_proc, wait_simulator, workdir

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":256}'


async def drive(post: object, inflight: int, seconds: float) -> float:
    """Keep ``inflight`` requests going until ``seconds`` pass; completed per second."""
    done = 0
    stop = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await post()  # type: ignore[operator]
            done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(inflight)))
    return done / (time.monotonic() - t0)


async def main(inflight: int, latency: float, seconds: float) -> None:
    """Run both clients against one simulator."""
    with workdir("diag") as work, processes() as procs:
        port = free_port()
        sim = simulator_proc(work, port, latency=latency, reasoning="20-60", content="5-20")
        procs.append(sim)
        base = f"http://127.0.0.1:{port}"
        await wait_simulator(base, sim)
        url = f"{base}/api/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        limits = httpx.Limits(max_connections=inflight, max_keepalive_connections=inflight)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def hx() -> None:
                (await client.post(url, content=BODY, headers=headers)).raise_for_status()

            print(
                f"httpx   {inflight} in flight: {await drive(hx, inflight, seconds):.1f} req/s "
                f"(ideal {inflight / latency:.0f})",
                flush=True,
            )
        import importlib.util

        if importlib.util.find_spec("httpx2") is not None:
            import httpx2  # type: ignore[import-not-found,unused-ignore]

            # httpx's fork with the linear-time pool (installed via huggingface_hub)
            limits2 = httpx2.Limits(max_connections=inflight, max_keepalive_connections=inflight)
            async with httpx2.AsyncClient(timeout=60, limits=limits2) as client2:

                async def hx2() -> None:
                    (await client2.post(url, content=BODY, headers=headers)).raise_for_status()

                print(
                    f"httpx2  {inflight} in flight: {await drive(hx2, inflight, seconds):.1f} req/s "
                    f"(ideal {inflight / latency:.0f})",
                    flush=True,
                )
        connector = aiohttp.TCPConnector(limit=inflight)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def ah() -> None:
                async with session.post(url, data=BODY, headers=headers) as response:
                    response.raise_for_status()
                    await response.read()

            print(
                f"aiohttp {inflight} in flight: {await drive(ah, inflight, seconds):.1f} req/s "
                f"(ideal {inflight / latency:.0f})",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--latency", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    a = parser.parse_args()
    asyncio.run(main(a.inflight, a.latency, a.seconds))
