"""What the cycle collector finds unreachable over a block: the census of the no-cycle tests."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def unreachable() -> Iterator[list[object]]:
    """Collect, then keep what the collector finds unreachable until the block ends
    (``gc.DEBUG_SAVEALL``); the yielded list holds it once the block has ended."""
    found: list[object] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
