"""Every Prometheus metric draftstream exposes, defined once so names never drift.

Naming follows Prometheus conventions: base units (seconds, bytes, dollars), ``_total``
on counters, and only bounded labels (dataset, stage, reason code, provider, outcome,
check, kind): never a sample id. Each service serves the default registry on its own
port with :func:`serve`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# publish
PROMPTS_PUBLISHED = Counter(
    "draftstream_prompts_published_total", "Prompts published to prompts.<dataset>", ["dataset"]
)
PROMPTS_REJECTED = Counter(
    "draftstream_prompts_rejected_total", "Input rows the publisher rejected", ["dataset", "reason"]
)

# inference
REQUESTS = Counter(
    "draftstream_provider_requests_total",
    "Provider HTTP requests by outcome (ok, retry, http_4xx, http_5xx, timeout, ...)",
    ["provider", "outcome"],
)
REQUEST_LATENCY = Histogram(
    "draftstream_provider_request_duration_seconds",
    "Provider request latency",
    ["provider"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300),
)
INFLIGHT = Gauge("draftstream_inflight_requests", "Provider requests in flight", ["dataset"])
RETRIES = Counter("draftstream_provider_retries_total", "Provider retries", ["provider", "reason"])
RESPONSES = Counter("draftstream_responses_total", "Responses published", ["dataset"])
HALTED = Gauge("draftstream_inference_halted", "1 while a halt stands for the scope", ["scope"])
RESPONSES_REUSED = Counter(
    "draftstream_responses_reused_total",
    "Responses answered from the response store instead of a new (paid) provider request",
    ["dataset"],
)
PROVIDER_OUTAGES = Counter(
    "draftstream_provider_outages_total", "Outage halts published by inference workers", ["reason"]
)
PROVIDER_WINDOW = Gauge(
    "draftstream_provider_window_requests",
    "Requests the adaptive rate-limit window admits in flight (upstream: an OpenRouter upstream, or key)",
    ["provider", "upstream"],
)
RATE_LIMITED = Counter(
    "draftstream_provider_rate_limited_total",
    "HTTP 429 answers (rate limits), by upstream or key",
    ["provider", "upstream"],
)
RATE_LIMIT_PAUSED = Counter(
    "draftstream_provider_rate_limit_paused_seconds_total",
    "Seconds new requests were paused by Retry-After",
    ["provider"],
)

# budget
TOKENS = Counter(
    "draftstream_tokens_total", "Tokens spent by kind (prompt, completion, reasoning)", ["dataset", "kind"]
)
DOLLARS = Counter("draftstream_spend_dollars_total", "Dollars spent", ["dataset"])
BUDGET_CAP = Gauge("draftstream_budget_cap", "Budget cap by unit (completion_tokens, dollars)", ["dataset", "unit"])
BUDGET_SPENT = Gauge("draftstream_budget_spent", "Budget spent by unit", ["dataset", "unit"])
BUDGET_REMAINING = Gauge("draftstream_budget_remaining", "Budget remaining by unit", ["dataset", "unit"])
BUDGET_STATE = Gauge("draftstream_budget_state", "Budget state: 0 running, 1 soft limit, 2 halted", ["dataset"])
BUDGET_SOFT_LIMIT = Gauge(
    "draftstream_budget_soft_limit_reached", "1 when spend is past the soft threshold", ["dataset"]
)
BUDGET_PROJECTED = Gauge("draftstream_budget_projected_dollars", "Projected total dollars for the dataset", ["dataset"])
BUDGET_RATE = Gauge("draftstream_budget_burn_rate_dollars_per_second", "Moving spend rate", ["dataset"])
RESPONSES_WITHOUT_USAGE = Counter(
    "draftstream_responses_without_usage_total", "Responses counted by estimated tokens", ["dataset"]
)
HALTS = Counter("draftstream_halts_total", "Halt events published", ["scope", "by"])
# budget: the quality halt (services/budget/quality.py); upstream "all" is the whole dataset.
QUALITY_VERDICTS = Counter(
    "draftstream_quality_verdicts_total",
    "Verdicts on paid answers (accepted, or a reconstruct/audit dead letter)",
    ["dataset", "upstream", "outcome"],
)
QUALITY_DEAD_LETTERS = Counter(
    "draftstream_quality_dead_letters_total", "Paid answers thrown away, by primary reason", ["dataset", "reason"]
)
QUALITY_YIELD = Gauge(
    "draftstream_quality_yield_ratio", "Accepted share over the quality window", ["dataset", "upstream"]
)
QUALITY_HALTED = Gauge("draftstream_quality_halted", "1 while a quality halt stands for the dataset", ["dataset"])
DOLLARS_PER_ACCEPTED = Gauge(
    "draftstream_dollars_per_accepted_sample", "Dollars spent over samples accepted", ["dataset"]
)
TOKENS_KEPT = Counter(
    "draftstream_tokens_kept_total", "Paid completion tokens of accepted samples (tokens kept)", ["dataset"]
)

# reconstruct / audit / sink
RECONSTRUCTED = Counter("draftstream_reconstructed_total", "Samples rebuilt, by method", ["dataset", "method"])
AUDIT_CHECKS = Counter("draftstream_audit_checks_total", "Audit check results", ["dataset", "check", "result"])
ACCEPTED = Counter("draftstream_accepted_samples_total", "Samples that passed the audit", ["dataset"])
SINK_BYTES = Counter("draftstream_sink_bytes_total", "Bytes written to training shards", ["dataset"])
SINK_FILES = Counter("draftstream_sink_files_total", "Training shard files opened", ["dataset"])
SINK_ROWS = Counter("draftstream_sink_rows_total", "Rows written to training shards", ["dataset"])
SINK_DUPLICATES = Counter(
    "draftstream_sink_duplicates_skipped_total", "Rows skipped because the key was written", ["dataset"]
)

# provider simulator
SIMULATOR_REQUESTS = Counter(
    "draftstream_simulator_requests_total",
    "Chat requests the provider simulator answered, by outcome (ok, bad_request, or a transient fault)",
    ["outcome"],
)
SIMULATOR_CONTENT_FAULTS = Counter(
    "draftstream_simulator_content_faults_total", "Content faults the simulator injected", ["fault"]
)

# every stage
DEAD_LETTERS = Counter("draftstream_dead_letters_total", "Records sent to dead-letter", ["stage", "reason"])
REPLAYS = Counter("draftstream_replays_total", "Dead letters replayed", ["stage", "reason"])
STAGE_RECORDS = Counter("draftstream_stage_records_total", "Records consumed by a stage", ["stage"])
CONSUMER_LAG = Gauge("draftstream_consumer_lag_records", "Records not yet consumed", ["group", "topic"])


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose the default registry over HTTP (no-op for port 0)."""
    if port:
        start_http_server(port, addr=host)
