"""The status screen's model and rendering (pure: the numbers come from services.status.app).

What came from the wire (scopes, halt reasons, dead-letter reasons) goes into the tables as
:class:`rich.text.Text`, so no console reads it as markup or emoji codes.

Six panels: the halts standing on ``control`` (scope, who, why: a pre-flight or outage
halt says what to fix), the inference worker's rate-limit window (read from its metrics
endpoint), the budget table (latest :class:`schemas.BudgetSnapshot` per
scope), records per stage topic (end offsets, with a rate between two snapshots under
``--watch``), consumer lag per stage group, and dead letters by stage and reason; then the
accepted answers that were truncated (``accept_truncated``), counted apart per dataset; and, when a
``turns = "all"`` dataset runs, its conversations in progress, finished and ended early by reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from schemas import BudgetSnapshot, ConversationProgressed, Halt, ProviderFactRecorded, provider_of_scope, topology
from services.budget.leases import capped_summary
from services.budget.lost import lost_attempt_lines
from services.budget.quality import yield_text

# Consumer groups of the stream stages and the logical topics they read (schemas.topology).
GROUP_INPUTS: Final[dict[str, tuple[str, ...]]] = topology.group_inputs()
# Each stage's main output topic in pipeline order, then the dead letters.
STAGE_TOPICS: Final[tuple[tuple[str, str], ...]] = (
    *((stage, topology.STAGE_OUTPUT[stage]) for stage in topology.STAGES if stage in topology.STAGE_OUTPUT),
    ("failed", topology.DEAD_LETTER),
)


@dataclass(frozen=True)
class GroupLag:
    """How far one consumer group is behind on one topic partition."""

    group: str
    topic: str
    partition: int
    end: int
    committed: int | None  # None: the group has committed nothing on this topic
    start: int = 0  # earliest offset still on the broker

    @property
    def lag(self) -> int:
        """Records written but not yet processed by the group."""
        return max(0, self.end - (self.start if self.committed is None else self.committed))


@dataclass(frozen=True)
class RateLimitRow:
    """One adaptive window of an inference worker: provider, upstream (or ``key``), size, 429s, pause."""

    provider: str
    upstream: str
    window: int
    refused: int = 0
    paused_s: float = 0.0


@dataclass
class StatusSnapshot:
    """Everything the status screen shows, read at one moment."""

    taken_at: float
    budgets: list[BudgetSnapshot] = field(default_factory=list)
    topic_records: dict[str, int] = field(default_factory=dict)  # physical topic -> records written
    lags: list[GroupLag] = field(default_factory=list)
    dead_letters: Counter[tuple[str, str]] = field(default_factory=Counter)
    unreadable_budget_records: int = 0
    halts: list[Halt] = field(default_factory=list)  # standing halts on the control topic
    # Accepted answers cut at the token limit (accept_truncated), per dataset: counted apart.
    accepted_truncated: Counter[str] = field(default_factory=Counter)
    topic_prefix: str = ""
    groups: tuple[str, ...] = tuple(GROUP_INPUTS)
    # The local inference worker's rate limits, from its metrics endpoint (None: not reachable).
    rate_limits: list[RateLimitRow] | None = None
    rate_limits_source: str = ""
    # Multi-turn regeneration: the latest state per conversation key.
    conversations: dict[str, ConversationProgressed] = field(default_factory=dict)
    # Conversations whose next turn (turn 0 included) stands as a dead letter: key -> "stage reason".
    stopped: dict[str, str] = field(default_factory=dict)
    # Upstreams declared (or defaulted) lossless whose answers showed they strip: strips_at_edges facts.
    strips: dict[str, ProviderFactRecorded] = field(default_factory=dict)

    def stage_records(self, logical: str) -> int:
        """Records written to a logical topic (summed over every dataset for ``prompts.*``)."""
        return sum(n for t, n in self.topic_records.items() if topology.belongs_to(t, logical, self.topic_prefix))


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def _tokens(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def budget_table(snapshot: StatusSnapshot) -> Table:
    """One row per budget scope: state, tokens and dollars against their caps."""
    table = Table(title="budget", title_justify="left")
    columns = ("scope", "state", "completion tokens", "cap", "spent", "cap $")
    for name in (*columns, "requests", "yield", "updated"):  # topology: not a topic
        table.add_column(name, justify="left" if name in ("scope", "state", "yield", "updated") else "right")
    for b in sorted(snapshot.budgets, key=lambda s: (s.scope != "global", s.scope)):
        if provider_of_scope(b.scope) is not None:
            continue  # providers_table's rows
        style = {"halted": "bold red", "soft-limit": "yellow"}.get(b.state, "green")
        updated = datetime.fromtimestamp(b.updated_at, tz=UTC).strftime("%H:%M:%SZ") if b.updated_at else "-"
        table.add_row(
            Text(b.scope),
            Text(capped_summary(b) or b.state, style=style),
            _tokens(b.completion_tokens),
            _tokens(b.cap_completion_tokens),
            _money(b.cost_usd),
            _money(b.cap_usd),
            f"{b.requests:,}",
            yield_text(b),
            updated,
        )
    if not snapshot.budgets:
        table.add_row("(no budget snapshots yet)", "", "", "", "", "", "", "", "")
    return table


def providers_table(snapshot: StatusSnapshot) -> Table | None:
    """One row per provider (``provider:<name>`` budget checkpoints): state, spend, rate, in flight, lost, workers.

    None when no checkpoint names a provider (a budget older than them).
    """
    providers = sorted((b for b in snapshot.budgets if provider_of_scope(b.scope) is not None), key=lambda b: b.scope)
    if not providers:
        return None
    halted = {h.scope: h for h in snapshot.halts}
    table = Table(title="providers", title_justify="left")
    for name in ("provider", "state", "completion tokens", "spent", "answers", "yield", "rate", "in flight", "lost",
                 "workers", "key"):
        table.add_column(name, justify="right" if name in ("completion tokens", "spent", "answers", "rate",
                                                             "in flight", "lost") else "left")
    for b in providers:
        halt = halted.get(b.scope)
        state = Text(f"halted by {halt.by}", style="bold red") if halt else Text("running", style="green")
        workers = sorted({held.worker or "unknown" for held in b.attempts.values()})
        rate = f"{b.rate_tokens_per_s:,.0f} tok/s" if b.rate_tokens_per_s else "-"
        if b.unreconciled:
            key = Text(b.unreconciled, style="yellow")
        else:
            key = Text("-" if b.key_unexplained_usd is None else f"{_money(b.key_unexplained_usd)} unexplained")
        table.add_row(Text(provider_of_scope(b.scope) or b.scope), state, _tokens(b.completion_tokens),
                      _money(b.cost_usd), f"{b.responses:,}", yield_text(b), rate, _tokens(b.inflight_tokens),
                      _tokens(b.lost_tokens), Text(", ".join(workers) or "-"), key)
    return table


def halts_table(snapshot: StatusSnapshot) -> Table:
    """The halts standing on the control topic: scope, who published it, since when, why."""
    table = Table(title=f"halts: {len(snapshot.halts)}", title_justify="left")
    for name in ("scope", "by", "since", "reason"):
        table.add_column(name)
    for halt in sorted(snapshot.halts, key=lambda h: (h.scope != "global", h.scope)):
        since = datetime.fromtimestamp(halt.at, tz=UTC).strftime("%H:%M:%SZ") if halt.at else "-"
        table.add_row(Text(halt.scope, style="bold red"), Text(halt.by or "-"), since, Text(halt.reason))
    if not snapshot.halts:
        table.add_row("(none)", "", "", "")
    return table


def strips_table(snapshot: StatusSnapshot) -> Table:
    """Upstreams caught losing edge whitespace their convention says they keep, with the evidence."""
    table = Table(title=f"upstreams caught stripping (strips_at_edges): {len(snapshot.strips)}", title_justify="left")
    for name in ("upstream", "evidence", "since", "why"):
        table.add_column(name)
    for upstream, fact in sorted(snapshot.strips.items()):
        since = datetime.fromtimestamp(fact.at, tz=UTC).strftime("%H:%M:%SZ") if fact.at else "-"
        table.add_row(Text(upstream, style="bold yellow"), fact.evidence, since, Text(fact.reason))
    return table


def rate_limit_table(snapshot: StatusSnapshot) -> Table:
    """The inference worker's rate-limit windows: requests admitted in flight, 429s, time paused."""
    table = Table(title="rate limits (inference worker)", title_justify="left")
    for name in ("provider", "upstream", "window", "429s", "paused by Retry-After"):
        table.add_column(name, justify="left" if name in ("provider", "upstream") else "right")
    if snapshot.rate_limits is None:
        table.add_row(f"(no inference metrics at {snapshot.rate_limits_source or '-'})", "", "", "", "")
        return table
    for row in sorted(snapshot.rate_limits, key=lambda r: (r.provider, r.upstream != "key", r.upstream)):
        table.add_row(row.provider, row.upstream, f"{row.window:,}", f"{row.refused:,}", f"{row.paused_s:,.1f} s")
    if not snapshot.rate_limits:
        table.add_row("(no provider requests yet)", "", "", "", "")
    return table


def throughput_table(snapshot: StatusSnapshot, previous: StatusSnapshot | None = None) -> Table:
    """Records written per stage output topic, and the rate since ``previous``."""
    table = Table(title="throughput", title_justify="left")
    table.add_column("stage")
    table.add_column("topic")
    table.add_column("records", justify="right")
    table.add_column("rate", justify="right")
    elapsed = snapshot.taken_at - previous.taken_at if previous is not None else 0.0
    for stage, logical in STAGE_TOPICS:
        count = snapshot.stage_records(logical)
        rate = "-"
        if previous is not None and elapsed > 0:
            rate = f"{(count - previous.stage_records(logical)) / elapsed:,.1f}/s"
        table.add_row(stage, logical, f"{count:,}", rate)
    return table


def lag_table(snapshot: StatusSnapshot) -> Table:
    """Consumer lag per stage group, summed over the topics it reads."""
    table = Table(title="consumer lag", title_justify="left")
    table.add_column("group")
    table.add_column("topics", justify="right")
    table.add_column("written", justify="right")
    table.add_column("lag", justify="right")
    for group in snapshot.groups:
        rows = [lag for lag in snapshot.lags if lag.group == group]
        if not rows:
            table.add_row(group, "0", "0", "-")
            continue
        written = sum(r.end for r in rows)
        lag = sum(r.lag for r in rows)
        started = any(r.committed is not None for r in rows)
        style = "green" if lag == 0 else "yellow"
        table.add_row(
            group,
            str(len({r.topic for r in rows})),
            f"{written:,}",
            Text.assemble((f"{lag:,}", style), "" if started else " (not started)"),
        )
    return table


def dead_letter_table(snapshot: StatusSnapshot) -> Table:
    """Dead-lettered prompts by stage and reason, largest first: each key once, by its latest dead letter."""
    total = sum(snapshot.dead_letters.values())
    table = Table(title=f"dead letters: {total:,} prompts (latest per key)", title_justify="left")
    table.add_column("stage")
    table.add_column("reason")
    table.add_column("count", justify="right")
    for (stage, reason), count in sorted(snapshot.dead_letters.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(Text(stage), Text(reason), f"{count:,}")
    return table


def stopped_conversations(
    conversations: Mapping[str, ConversationProgressed], standing: Mapping[str, tuple[str, str]], multi_turn: set[str]
) -> dict[str, str]:
    """Conversations (``dataset:conversation``) whose next turn stands as a dead letter, with its stage and reason.

    ``standing``: key -> (stage, reason) of the keys whose latest outcome is a dead letter. A turn's
    key is ``dataset:conversation:turn``; the conversation stopped there when it has no state yet
    and the turn is 0, or its state is in progress and that turn is the next one.
    """
    out: dict[str, str] = {}
    for key, (stage, reason) in standing.items():
        conversation, _, turn = key.rpartition(":")
        if conversation.split(":", 1)[0] not in multi_turn or not turn.isdigit():
            continue
        state = conversations.get(conversation)
        waiting = int(turn) == 0 if state is None else state.state == "in_progress" and state.next_turn == int(turn)
        if waiting:
            out[conversation] = f"{stage} {reason}"
    return out


def conversation_endings(snapshot: StatusSnapshot) -> dict[str, tuple[str, str]]:
    """Every conversation once, with how it stands: (dataset, in_progress | finished | ended_early |
    dead_letter) and why (the end reason, or the dead letter's stage and reason).

    A conversation whose next turn stands as a dead letter stopped there, whether or not a turn
    was ever accepted (one that died at turn 0 has no state record: it is listed from its dead letter).
    """
    out: dict[str, tuple[str, str]] = {}
    for key, state in snapshot.conversations.items():
        out[key] = (state.state, state.reason if state.state == "ended_early" else "")
    for key, why in snapshot.stopped.items():
        out[key] = ("dead_letter", why)
    return out


def conversation_table(snapshot: StatusSnapshot) -> Table:
    """Multi-turn conversations per dataset: in progress, finished, ended early and stopped by a dead letter, why."""
    counts: Counter[tuple[str, str]] = Counter()
    why: dict[str, Counter[str]] = {}
    endings = conversation_endings(snapshot)
    for key, (state, reason) in endings.items():
        dataset = key.split(":", 1)[0]
        counts[(dataset, state)] += 1
        if reason:
            why.setdefault(dataset, Counter())[reason] += 1
    table = Table(title=f"conversations: {len(endings):,}", title_justify="left")
    for name in ("dataset", "in progress", "finished", "ended early", "dead letter", "why"):
        table.add_column(name, justify="left" if name in ("dataset", "why") else "right", overflow="fold")
    for dataset in sorted({d for d, _ in counts}):
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(why.get(dataset, Counter()).items(), key=lambda kv: -kv[1]))
        table.add_row(
            dataset,
            f"{counts[(dataset, 'in_progress')]:,}",
            f"{counts[(dataset, 'finished')]:,}",
            f"{counts[(dataset, 'ended_early')]:,}",
            f"{counts[(dataset, 'dead_letter')]:,}",
            reasons or "-",
        )
    return table


def render(snapshot: StatusSnapshot, previous: StatusSnapshot | None = None) -> RenderableType:
    """The whole status screen."""
    when = datetime.fromtimestamp(snapshot.taken_at, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    header = Text.assemble(("draftstream status", "bold"), f" at {when}")
    if snapshot.topic_prefix:
        header.append(f"  (topic prefix {snapshot.topic_prefix})")
    parts: list[RenderableType] = [
        header,
        halts_table(snapshot),
        rate_limit_table(snapshot),
        budget_table(snapshot),
        *filter(None, [providers_table(snapshot)]),
        throughput_table(snapshot, previous),
        lag_table(snapshot),
        dead_letter_table(snapshot),
    ]
    lost = lost_attempt_lines(snapshot.budgets)
    if lost:
        parts.append(Text("\n".join(lost), style="yellow"))
    if snapshot.accepted_truncated:
        per_dataset = ", ".join(f"{d} {n:,}" for d, n in sorted(snapshot.accepted_truncated.items()))
        total = sum(snapshot.accepted_truncated.values())
        parts.append(Text(f"accepted truncated (finish_reason length, accept_truncated): {total:,} ({per_dataset})"))
    if snapshot.conversations or snapshot.stopped:
        parts.append(conversation_table(snapshot))
    if snapshot.strips:
        parts.append(strips_table(snapshot))
    if snapshot.unreadable_budget_records:
        parts.append(Text(f"{snapshot.unreadable_budget_records} unreadable budget-state record(s)", style="yellow"))
    return Group(*parts)


__all__ = [
    "GROUP_INPUTS",
    "STAGE_TOPICS",
    "GroupLag",
    "RateLimitRow",
    "StatusSnapshot",
    "budget_table",
    "conversation_endings",
    "conversation_table",
    "dead_letter_table",
    "halts_table",
    "lag_table",
    "providers_table",
    "rate_limit_table",
    "rate_limits_from_metrics",
    "render",
    "stopped_conversations",
    "strips_table",
    "throughput_table",
]


def rate_limits_from_metrics(text: str) -> list[RateLimitRow]:
    """The rate-limit rows in a Prometheus text exposition (an inference worker's ``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    windows: dict[tuple[str, str], float] = {}
    refused: dict[tuple[str, str], float] = {}
    paused: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            provider, upstream = sample.labels.get("provider", ""), sample.labels.get("upstream", "")
            if sample.name == "draftstream_provider_window_requests":
                windows[(provider, upstream)] = sample.value
            elif sample.name == "draftstream_provider_rate_limited_total":
                refused[(provider, upstream)] = sample.value
            elif sample.name == "draftstream_provider_rate_limit_paused_seconds_total":
                paused[provider] = sample.value
    return [
        RateLimitRow(
            provider=provider,
            upstream=upstream,
            window=int(window),
            refused=int(refused.get((provider, upstream), 0)),
            paused_s=paused.get(provider, 0.0) if upstream == "key" else 0.0,
        )
        for (provider, upstream), window in windows.items()
    ]
