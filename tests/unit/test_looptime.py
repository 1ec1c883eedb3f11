"""LoopLateness on a real event loop: a callback that holds the loop makes it behind, and it catches up."""

from __future__ import annotations

import asyncio
import time

from services.common.looptime import LATE_S, LoopLateness
from tests.kafka_fixture import wait_until


async def test_a_held_loop_is_behind_until_its_timers_run_on_time_again() -> None:
    lateness = LoopLateness()
    assert not lateness.behind() and lateness.late_by == 0.0  # not started: nothing known
    lateness.start()
    try:
        await wait_until(lambda: not lateness.behind(), timeout=5, interval=0.01, message="an idle loop on time")
        time.sleep(4 * LATE_S)  # a callback holding the loop, as a wave of answers does
        assert lateness.behind() and lateness.late_by >= 2 * LATE_S  # the next tick is overdue
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the overdue tick ran, late
        assert lateness.behind()
        await wait_until(lambda: not lateness.behind(), timeout=5, interval=0.01, message="the loop caught up")
    finally:
        await lateness.close()
    await lateness.close()  # twice is harmless
