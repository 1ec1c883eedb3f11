"""Benchmark 7: how much of a cap is used at the seeds' answer lengths (admission by headroom).

The seeds' settings (Kimi-K2.5 in the real run): answers of 1,700-14,500 tokens,
``max_tokens`` 32,768 and so many requests allowed in flight that their worst case is far
above the cap. The budget service, the inference workers and the simulator (the default
profile's tokenizer; the lengths are what matter) run in this process on the test broker.
The figure is the simulator's own count of the completion tokens it served once the
dataset stands finished at its cap, as a fraction of the cap (target >= 0.95; never above
1.0: the cap is a ceiling).
"""

from __future__ import annotations

import asyncio
import time

from bench.common import Result, delete_topics, main, publish_seeds, result, seeds_settings, unique_prefix

MAX_TOKENS = 32_768
REASONING = (1_200, 11_500)
CONTENT = (500, 3_000)  # answers of 1,700-14,500 tokens


async def measure(quick: bool) -> list[Result]:
    """One capped dataset, run until the budget finishes it at its cap."""
    from schemas import Halt
    from services.budget.app import create_app as create_budget
    from services.budget.leases import CAPPED_PREFIX
    from services.control import read_control_state
    from services.inference.app import create_app as create_worker
    from services.simulator.app import start_simulator
    from services.simulator.options import SimulatorOptions

    cap, workers, concurrency, prompts = (600_000, 1, 64, 120) if quick else (3_000_000, 2, 256, 700)
    prefix = unique_prefix("headroom")
    sim = await start_simulator(SimulatorOptions(latency_s=0.5, reasoning_tokens=REASONING, content_tokens=CONTENT))
    settings = seeds_settings(
        prefix, sim.url, cap, MAX_TOKENS, provider={"concurrency": concurrency, "timeout_s": 120.0}
    )
    print(f"cap {cap:,} tokens; {workers} worker(s) x {concurrency} in flight x {MAX_TOKENS:,} max_tokens = "
          f"{workers * concurrency * MAX_TOKENS:,} worst case in flight", flush=True)
    await publish_seeds(settings, prompts)

    budget = create_budget(settings, checkpoint_interval_s=0.5)
    await budget.start()
    tasks = [asyncio.create_task(budget.run())]
    started = time.monotonic()
    halt: Halt | None = None
    pool = [create_worker(settings, worker_id=f"bench-w{i}") for i in range(workers)]
    try:
        for worker in pool:
            await worker.start()
            tasks.append(asyncio.create_task(worker.run()))
        while time.monotonic() - started < (120 if quick else 600):
            event = (await read_control_state(settings)).get("seeds")
            if isinstance(event, Halt) and event.reason.startswith(CAPPED_PREFIX):
                halt = event
                break
            await asyncio.sleep(0.5)
        stats = sim.stats()
    finally:
        for service in (*pool, budget):
            service.stop()
        await asyncio.wait(tasks, timeout=60)
        await asyncio.gather(*(worker.close() for worker in pool))
        await budget.close()
        await sim.close()
        await delete_topics(prefix)
    if halt is None:
        raise RuntimeError("the dataset was not finished at its cap in time")
    spent = stats["completion_tokens"]
    overshoot = max(0, spent - cap)
    print(f"{spent:,} of {cap:,} tokens served ({spent / cap:.3f}) in {stats['statuses'].get('200', 0)} answers, "
          f"{time.monotonic() - started:.0f} s; {halt.reason}", flush=True)
    return [
        result(f"cap used at seeds' answer lengths ({workers} worker(s))", float(spent), float(cap), spent / cap,
               ">= 0.95", "tokens"),
        # The row's ratio is its own value over its reference: tokens past the cap per token of cap.
        result("cap overshoot at seeds' answer lengths", float(overshoot), float(cap), overshoot / cap, "<= 0.0",
               "tokens"),
    ]


def run(quick: bool) -> list[Result]:
    """Entry point for bench.run."""
    return asyncio.run(measure(quick))


if __name__ == "__main__":
    main(run, __doc__ or "")
