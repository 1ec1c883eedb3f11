"""The faults the simulator injects, and the draws that decide them.

Content faults are decided by a hash of the prompt (:func:`prompt_digest`) and the seed, so a
retry of the same prompt meets the same ones; transient faults are drawn from an RNG the caller
owns. A request may also name its faults in the ``X-Simulator-Fault`` header.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from typing import Final

from services.simulator.request import ChatRequest, RequestError

TRANSIENT_FAULTS: Final = ("429", "5xx", "timeout", "drop", "malformed", "error_in_200")
CONTENT_FAULTS: Final = ("truncate", "empty_reasoning", "bad_usage", "noncanonical_len", "noncanonical_same")


def parse_fault_header(value: str | None) -> list[str]:
    """Names in an ``X-Simulator-Fault`` header; raises :class:`RequestError` on unknown ones."""
    if not value:
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSIENT_FAULTS and n not in CONTENT_FAULTS]
    if unknown:
        raise RequestError(f"unknown simulator fault(s) {unknown}; known: {list(TRANSIENT_FAULTS + CONTENT_FAULTS)}")
    return names


def prompt_digest(request: ChatRequest) -> bytes:
    """A stable hash of what the model sees: messages, tools and whether tools were sent."""
    canon = json.dumps(
        {"messages": request.messages, "tools": request.tools},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canon.encode("utf-8"), digest_size=16).digest()


def _unit(digest: bytes, seed: int, label: str) -> float:
    """A deterministic number in [0, 1) for (prompt, seed, label)."""
    h = hashlib.blake2b(digest + seed.to_bytes(8, "little", signed=True) + label.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") / 2**64


def choose_content_faults(digest: bytes, seed: int, rates: Mapping[str, float]) -> list[str]:
    """Content faults that hit this prompt: decided by its hash, so a retry reproduces them."""
    return [name for name in CONTENT_FAULTS if rates.get(name, 0.0) > 0 and _unit(digest, seed, name) < rates[name]]


def choose_transient_fault(rng: random.Random, rates: Mapping[str, float]) -> str | None:
    """At most one transient fault for this request, drawn from the caller's seeded RNG."""
    hit = None
    for name in TRANSIENT_FAULTS:
        # One draw per fault, always, so the sequence does not depend on earlier outcomes.
        if rng.random() < rates.get(name, 0.0) and hit is None:
            hit = name
    return hit
