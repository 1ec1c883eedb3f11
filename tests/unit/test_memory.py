"""The C allocator of a service: freed buffers go back to the system (measured as the OS sees it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common import memory

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter: free one 20 MiB buffer (glibc then raises its mmap threshold to that
# size), allocate 600 MB of 200 KiB buffers with small live objects between them, free the
# buffers; print the resident set before and after, in MiB.
SCRIPT = textwrap.dedent(
    """
    import sys
    from services.common import memory
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    if sys.argv[1] == "tune":
        memory.tune_allocator()
    big = bytearray(20 * 1024 * 1024)
    del big
    blocks, pins = [], []
    for _ in range(3000):
        blocks.append(bytearray(200 * 1024))
        pins.append(bytearray(1024))
    before = rss()
    del blocks
    if sys.argv[2] == "trim":
        memory.trim()
    print(before, rss())
    """
)


def _rss_before_after(tune: str, trim: str) -> tuple[int, int]:
    done = subprocess.run(  # noqa: S603 - our own interpreter and script
        [sys.executable, "-c", SCRIPT, tune, trim], cwd=REPO, capture_output=True, text=True, check=True
    )
    before, after = done.stdout.split()
    return int(before), int(after)


@pytest.mark.skipif(memory._glibc() is None, reason="glibc only: elsewhere both calls do nothing")  # noqa: SLF001
def test_freed_buffers_go_back_to_the_system_when_tuned_or_trimmed() -> None:
    untouched = _rss_before_after("-", "-")
    tuned = _rss_before_after("tune", "-")
    trimmed = _rss_before_after("-", "trim")
    assert all(before > 550 for before, _ in (untouched, tuned, trimmed))
    # Left alone, glibc keeps the 600 MB in its heap (what an inference worker's 2 GiB was).
    assert untouched[1] > 500, untouched
    assert tuned[1] < 100, tuned
    assert trimmed[1] < 100, trimmed
