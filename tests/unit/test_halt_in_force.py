"""When a halt read by the follower thread is in force: the main loop's first read of the state after it.

The follower thread applies a halt at once, but a request whose ``may_send`` said yes on the
main loop just before is written by that loop after it, before the loop runs anything else.
The moment logged as "in force here" is therefore the loop's first read of the changed state
(a ``may_send`` asked, or the event delivered), never the thread's own clock: from then on no
request is written. No broker: the follower's thread step is driven by hand.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from types import SimpleNamespace

import pytest

from schemas import Halt, encode
from services.common.config import KafkaSettings
from services.common.halts import HaltFollower


def _halted_on_a_thread(caplog: pytest.LogCaptureFixture) -> tuple[HaltFollower, float]:
    """A follower whose thread step took a halt of ``ds``, joined without a turn of the loop (nothing delivered yet)."""
    caplog.set_level(logging.WARNING, logger="services.common.halts")
    follower = HaltFollower(KafkaSettings(), asyncio.Event())
    follower._loop = asyncio.get_running_loop()  # noqa: SLF001 - the thread step without a broker
    follower._live = True  # noqa: SLF001
    issued = time.time()
    halt = Halt(scope="ds", reason="test", by="test", at=issued)
    record = SimpleNamespace(value=encode(halt), topic="control", partition=0, offset=0)
    thread = threading.Thread(target=follower._take, args=(record,))  # noqa: SLF001
    thread.start()
    thread.join()
    return follower, issued


def _in_force_ms(caplog: pytest.LogCaptureFixture) -> float:
    found = re.findall(r"in force here (-?\d+) ms", caplog.text)
    assert len(found) == 1, caplog.text
    return float(found[0])


async def test_a_halt_is_in_force_from_the_loops_first_read_after_the_thread_applied_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    follower, issued = _halted_on_a_thread(caplog)
    # The state is changed at once (a request asking now is withheld)...
    assert follower.state.is_halted("ds")
    time.sleep(0.2)  # ...but the loop, busy, asks nothing for 200 ms (a request it cleared meanwhile goes out)
    assert not follower.may_go("ds")
    asked = time.time()
    time.sleep(0.1)  # and delivers the event later still
    await asyncio.sleep(0)
    in_force = _in_force_ms(caplog)
    assert 200 <= in_force <= (asked - issued) * 1000 + 1  # the first read, not the thread's nor the delivery's


async def test_with_no_request_asking_a_halt_is_in_force_when_the_loop_delivers_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    follower, issued = _halted_on_a_thread(caplog)
    time.sleep(0.15)
    await asyncio.sleep(0)
    assert _in_force_ms(caplog) >= 150
    # A later request sees the halt; nothing more is logged for it.
    assert not follower.may_go("ds") and follower.may_go("other")
    assert len(re.findall("in force here", caplog.text)) == 1
