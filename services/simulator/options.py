"""Everything the simulator can be told (:class:`SimulatorOptions`), and the profile it answers as."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from services.common.config import Settings
from services.profiles import ProfileLike
from services.simulator.core import (
    GenerationParams,
)
from services.simulator.faults import (
    CONTENT_FAULTS,
    TRANSIENT_FAULTS,
)
from services.simulator.formats import PARSERS
from services.simulator.limits import RequestLimiter
from services.simulator.shapes import shaped

LIMIT_HEADERS = ("x-ratelimit", "none")
"""What a 429 may say of the limit: the ``X-RateLimit-*`` headers, or nothing."""


@dataclass(frozen=True)
class SimulatorOptions:
    """Everything the simulator can be told: profile, latency, lengths, fault rates, flags.

    ``parser`` is the inference server whose parse of the raw output is emulated (``vllm``:
    no whitespace stripped; ``sglang-legacy``: reasoning and content stripped).
    ``chat_template_file``: render prompts (prompt_tokens, whether the prompt opens the think
    block, ``prompt_token_ids``) from this Hugging Face chat template instead of the
    profile's own, e.g. a model's official template as independent truth.
    ``keep_truth``: remember the true output ids per sample key and serve them on
    ``GET /_sim/truth`` (off by default: a long run would hold every answer's ids).
    """

    profile: str = "qwen3"
    seed: int = 0
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    reasoning_tokens: tuple[int, int] = (40, 200)
    content_tokens: tuple[int, int] = (20, 120)
    rate_429: float = 0.0
    retry_after_s: float = 0.1
    rate_5xx: float = 0.0
    rate_timeout: float = 0.0
    timeout_sleep_s: float = 30.0
    rate_drop: float = 0.0
    rate_malformed: float = 0.0
    rate_error_in_200: float = 0.0
    rate_truncate: float = 0.0
    rate_empty_reasoning: float = 0.0
    rate_bad_usage: float = 0.0
    rate_noncanonical_len: float = 0.0
    rate_noncanonical_same: float = 0.0
    count_end_of_turn: bool = True
    count_think_end: bool = True
    logprobs: bool = False
    keep_truth: bool = False
    price_per_token: float = 2e-6
    prompt_price_per_token: float = 0.0
    provider_name: str = "SimProvider"  # the upstream named in each answer's ``provider``
    free: bool = False  # answers carry no usage.cost and the key is charged nothing (a local server)
    parser: str = "vllm"
    chat_template_file: str | None = None
    # A key's limit: requests per second (token bucket of ``rate_limit_burst``, default the
    # rate rounded up) and requests open at once; None: unlimited.
    rate_limit_rps: float | None = None
    rate_limit_burst: float | None = None
    max_open: int | None = None
    # Other shapes (services.simulator.shapes): a fixed window of requests, a rate that changes.
    rate_limit_window: int | None = None
    rate_limit_window_s: float = 60.0
    rate_limit_schedule: str | None = None
    # What a refusal says of the limit: "x-ratelimit" (X-RateLimit-* headers, Retry-After to the
    # millisecond) or "none" (a silent front: a whole-second Retry-After and the error body only).
    limit_headers: str = "x-ratelimit"
    # Answers wait (after their latency) until this many requests have been open at once, for at
    # most HOLD_TIMEOUT_S: a client's concurrency shows at the provider without a race against the latency.
    hold_until_open: int | None = None
    answer_tokens: tuple[int, int] | None = None  # log-uniform answer length (see GenerationParams)
    reasoning_share: tuple[float, float] = (0.80, 0.95)
    parallel_tool_calls: bool = False  # every offered tool called once, in order (see GenerationParams)

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"unknown parser {self.parser!r}; known: {', '.join(PARSERS)}")
        if self.limit_headers not in LIMIT_HEADERS:
            raise ValueError(f"unknown limit headers {self.limit_headers!r}; known: {', '.join(LIMIT_HEADERS)}")
        self.limiter()  # refuses a bad limit now

    def limiter(self) -> RequestLimiter:
        """The request limiter these options set (inactive without a limit)."""
        rps = self.rate_limit_rps
        burst = self.rate_limit_burst if self.rate_limit_burst is not None else float(math.ceil(rps or 0))
        base = RequestLimiter(
            rps=rps, burst=burst, max_open=self.max_open, open_retry_after_s=self.retry_after_s,
            headers=self.limit_headers != "none",
        )
        return shaped(
            base, per_window=self.rate_limit_window, window_s=self.rate_limit_window_s,
            schedule=self.rate_limit_schedule,
        )

    def fault_rates(self) -> dict[str, float]:
        """Rate of every fault by its name (``429``, ``5xx``, ..., ``noncanonical_same``)."""
        return {name: float(getattr(self, f"rate_{name}")) for name in TRANSIENT_FAULTS + CONTENT_FAULTS}

    def with_fault_rates(self, rates: dict[str, float]) -> SimulatorOptions:
        """A copy with some fault rates replaced; raises ValueError on unknown names or bad rates."""
        changes: dict[str, Any] = {}
        for name, rate in rates.items():
            if name not in TRANSIENT_FAULTS and name not in CONTENT_FAULTS:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join(TRANSIENT_FAULTS + CONTENT_FAULTS)}")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate for {name!r} must be within 0..1, got {rate}")
            changes[f"rate_{name}"] = rate
        return dataclasses.replace(self, **changes)

    def params(self) -> GenerationParams:
        """The generation parameters these options imply."""
        return GenerationParams(
            seed=self.seed,
            reasoning_tokens=self.reasoning_tokens,
            content_tokens=self.content_tokens,
            count_end_of_turn=self.count_end_of_turn,
            count_think_end=self.count_think_end,
            price_per_token=self.price_per_token,
            prompt_price_per_token=self.prompt_price_per_token,
            free=self.free,
            parser=self.parser,
            answer_tokens=self.answer_tokens,
            reasoning_share=self.reasoning_share,
            parallel_tool_calls=self.parallel_tool_calls,
        )


def get_profile(name: str, settings: Settings | None = None) -> ProfileLike:
    """Load a model profile (``services.profiles`` caches it per process: about a second once)."""
    from services.profiles import load_profile

    return load_profile(name, settings)
