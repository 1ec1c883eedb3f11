"""Request accounting behind ``GET /_sim/stats``, for the simulator and the router alike."""

from __future__ import annotations

import bisect
import hashlib
import time
from collections import Counter, defaultdict, deque
from typing import Any

from services.simulator.billing import Billing
from services.simulator.limits import OverCap

_RECENT = 100


class Stats:
    """Request accounting for ``/_sim/stats`` and :meth:`RunningSimulator.requests_after`."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.total = 0
        self.times: list[float] = []
        self.keys: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.key_faults: defaultdict[str, list[str]] = defaultdict(list)
        self.statuses: Counter[str] = Counter()
        self.open = 0  # requests received and not yet answered (or abandoned)
        self.open_keys: Counter[str] = Counter()  # the same, per sample key (X-Draftstream-Key)
        self.billing = Billing()  # what the key was charged (answers served, or abandoned mid-generation)
        self.peak_open = 0  # the most of those at once
        # Seconds during which more requests were open than the rate limit's max_open.
        self.over_cap = OverCap(cap=None)
        self.rate_limited = 0  # requests refused by the rate limit (429)
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        # SHA-256 of each Authorization header seen (never the header itself), so a test can
        # prove a key reached the provider without the simulator ever storing the key.
        self.auth_sha256: Counter[str] = Counter()

    def record(self, key: str | None, at: float, authorization: str | None = None) -> None:
        self.total += 1
        if authorization:
            self.auth_sha256[hashlib.sha256(authorization.encode("utf-8")).hexdigest()] += 1
        self.times.append(at)
        if key is not None:
            self.keys[key] += 1

    def fault(self, key: str | None, name: str) -> None:
        self.faults[name] += 1
        if key is not None:
            self.key_faults[key].append(name)

    def requests_after(self, t: float) -> int:
        return len(self.times) - bisect.bisect_right(self.times, t)

    def snapshot(self, *, brief: bool = False) -> dict[str, Any]:
        """The counters; ``brief`` leaves out the tables that grow with every key served."""
        if brief:
            return {
                "started_at": self.started_at,
                "total_requests": self.total,
                "open_requests": self.open,
                "peak_open_requests": self.peak_open,
                "statuses": dict(self.statuses),
                "faults": dict(self.faults),
                "rate_limited": self.rate_limited,
                **self.billing.figures(),
                "last_request_at": self.times[-1] if self.times else None,
            }
        return {
            "started_at": self.started_at,
            "total_requests": self.total,
            "keys": dict(self.keys),
            "faults": dict(self.faults),
            "key_faults": dict(self.key_faults),
            "statuses": dict(self.statuses),
            "peak_open_requests": self.peak_open,
            "max_open_requests": self.over_cap.cap,
            "seconds_over_max_open": round(self.over_cap.over_s, 6),
            "rate_limited": self.rate_limited,
            **self.billing.figures(),
            "last_request_at": self.times[-1] if self.times else None,
            "last_request_times": self.times[-_RECENT:],
            "recent": list(self.recent),
            "auth_sha256": dict(self.auth_sha256),
        }
