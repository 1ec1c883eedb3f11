"""The topology, declared once: topics, the events on them, and who reads and writes what.

Every service, ``status``, ``dlq``, the budget, the settings, the AsyncAPI document
(``schemas/asyncapi.py``) and the docs derive topic and consumer-group names from here;
no other module spells them. Names are *logical*: a deployment's ``kafka.topic_prefix``
is prepended to topics and groups alike (``KafkaSettings.topic`` / ``KafkaSettings.group``).

The prompts topics are one entry, ``prompts.*``: a prefix pattern whose physical topics
are ``prompts.<dataset>`` (see :func:`prompts_topic`).

This module names events by their Struct names (strings), so it imports nothing from
``schemas`` and ``schemas/__init__.py`` can re-export its constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class Topic:
    """One logical topic: the events it carries, how it is keyed, whether it is compacted."""

    name: str
    messages: tuple[str, ...]  # Struct names in ``schemas`` (``DeadLetter``: any failed record)
    key: str  # what the record key holds
    compacted: bool
    description: str
    partitions: int | None = None  # None: the configured ``kafka.partitions``

    @property
    def is_pattern(self) -> bool:
        """True for ``prompts.*``: one physical topic per dataset under a prefix."""
        return self.name.endswith(".*")

    @property
    def prefix(self) -> str:
        """The physical-name prefix of a pattern topic (``prompts.``); the name otherwise."""
        return self.name[:-1] if self.is_pattern else self.name


@dataclass(frozen=True)
class Role:
    """A service identity: its consumer group and the logical topics it reads and writes.

    ``reads`` counts any consumption (with the group or a group-less assigned consumer);
    ``describes`` lists topics whose offsets or metadata it reads without consuming them;
    ``describes_groups`` the consumer groups whose committed offsets it reads; ``creates``
    the topics it may create (``ensure_topics``) before using them.
    """

    name: str
    group: str | None
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    description: str = ""
    describes: tuple[str, ...] = ()
    describes_groups: tuple[str, ...] = ()
    creates: tuple[str, ...] = ()


# --- topic names --------------------------------------------------------------------------
PROMPTS: Final = "prompts.*"
REQUESTS: Final = "requests"
RESPONSES: Final = "responses"
SAMPLES: Final = "samples"
ACCEPTED: Final = "accepted"
DEAD_LETTER: Final = "dead-letter"
CONTROL: Final = "control"
BUDGET_STATE: Final = "budget-state"
RESPONSE_STORE: Final = "response-store"
DLQ_REPLAYED: Final = "dlq-replayed"
# Multi-turn regeneration.
CONVERSATIONS: Final = "conversation-state"
CONVERSATION_KEY: Final = "<dataset>:<conversation_id>"
LEASES: Final = "leases"
RESPONSE_INDEX: Final = "response-index"
PROVIDER_FACTS: Final = "provider-facts"

PROMPTS_PREFIX: Final = PROMPTS.removesuffix("*")
"""The logical prefix of one dataset's prompts topic (``prompts.<dataset>``)."""

SAMPLE_KEY: Final = "<dataset>:<sample_id>"
REPAY_HEADER: Final = "draftstream.inference.repay"
"""A prompt record with this header set to ``1`` is sent to the provider again even if already paid for."""
TRUNCATED_HEADER: Final = "draftstream.audit.truncated"
"""Set to ``1`` on an ``accepted`` record whose answer was cut at the token limit (``accept_truncated``)."""
DEAD_LETTER_MESSAGE: Final = "DeadLetter"
"""A dead letter's value is the failed record's value, byte for byte: any event above."""

_topics = (
    Topic(
        PROMPTS,
        ("PromptPublished",),
        SAMPLE_KEY,
        False,
        "Prompts of one dataset waiting for the target model (physical topic prompts.<dataset>).",
    ),
    Topic(
        REQUESTS,
        ("RequestStarted",),
        SAMPLE_KEY,
        False,
        "A request was sent to the provider: spend may follow (the budget counts it in flight).",
    ),
    Topic(
        RESPONSES,
        ("ResponseReceived",),
        SAMPLE_KEY,
        False,
        "The provider's answer with its usage, as text (and native ids or logprobs when given).",
    ),
    Topic(
        SAMPLES,
        ("SampleReconstructed",),
        SAMPLE_KEY,
        False,
        "Token ids of prompt and output rebuilt from a response, with the loss mask.",
    ),
    Topic(
        ACCEPTED,
        ("SampleAudited",),
        SAMPLE_KEY,
        False,
        "Samples that passed every audit check, ready for the sink.",
    ),
    Topic(
        DEAD_LETTER,
        (DEAD_LETTER_MESSAGE,),
        "the failed record's own key (usually <dataset>:<sample_id>)",
        False,
        "Failed records, value byte for byte, with draftstream.errors.* headers saying why and where from.",
    ),
    Topic(
        CONTROL,
        ("Halt", "Resume"),
        "scope: 'global' or a dataset name",
        True,
        "Halt and resume commands per scope; every inference worker reads it from the beginning.",
        partitions=1,
    ),
    Topic(
        BUDGET_STATE,
        ("BudgetSnapshot",),
        "scope: 'global' or a dataset name",
        True,
        "The budget's latest checkpoint per scope: spend, caps, state and consumed offsets.",
        partitions=1,
    ),
    Topic(
        LEASES,
        ("LeasePolicy", "LeaseRequested", "LeaseGranted", "LeaseReleased"),
        "'policy', or '<action>|<worker>|<dataset>'",
        True,
        "Headroom under the caps: the budget's leases per worker and dataset, and the workers' requests.",
        partitions=1,
    ),
    Topic(
        RESPONSE_STORE,
        ("ResponseReceived",),
        "<dataset>:<sample_id>|<request hash>",
        True,
        "The paid response per exact request, so a prompt seen again is not paid for twice.",
    ),
    Topic(
        PROVIDER_FACTS,
        ("ProviderFactRecorded",),
        "<upstream>|<place>",
        True,
        "Facts of each upstream proven by its answers (whitespace kept at a place); every reconstruct worker "
        "reads it to its end at start and follows it; a contradicted fact is withdrawn.",
        partitions=1,
    ),
    Topic(
        DLQ_REPLAYED,
        ("ReplayRecorded",),
        "<partition>:<offset> of the replayed dead letter",
        True,
        "The replay ledger: dead letters already re-sent, so a second replay sends nothing twice.",
        partitions=1,
    ),
    # Multi-turn regeneration.
    Topic(
        CONVERSATIONS,
        ("ConversationProgressed",),
        CONVERSATION_KEY,
        True,
        "Where each multi-turn conversation stands: in progress, finished, or ended early with its reason.",
    ),
    # Issue 27: a worker's start-up reads this (tens of bytes per paid response), not the store's values.
    Topic(
        RESPONSE_INDEX,
        ("ResponseIndexed", "StoreCheckpointed"),
        "the response-store key, or '#<partition>' for a checkpoint of the store's partition",
        True,
        "Where each paid response sits on response-store (partition, offset), and per store partition "
        "the offset below which every record is indexed: what an inference worker reads at start.",
    ),
)
TOPICS: Final[Mapping[str, Topic]] = MappingProxyType({t.name: t for t in _topics})

# --- the pipeline -------------------------------------------------------------------------
STAGES: Final[tuple[str, ...]] = ("publish", "inference", "reconstruct", "audit", "sink")
"""The pipeline's stages in order; each one's main output is the next one's input."""

STAGE_INPUT: Final[Mapping[str, str]] = MappingProxyType(
    {"inference": PROMPTS, "reconstruct": RESPONSES, "audit": SAMPLES, "sink": ACCEPTED, "continuation": ACCEPTED}
)
"""The topic each consuming stage reads (publish reads files)."""

STAGE_OUTPUT: Final[Mapping[str, str]] = MappingProxyType(
    {"publish": PROMPTS, "inference": RESPONSES, "reconstruct": SAMPLES, "audit": ACCEPTED, "continuation": PROMPTS}
)
"""The main output topic of each stage (sink writes files); dead letters aside.

``continuation`` is outside :data:`STAGES`: it closes the loop, from ``accepted`` back to
``prompts.<dataset>`` (the next turn of a multi-turn conversation).
"""

# --- consumer groups ----------------------------------------------------------------------
INFERENCE_GROUP: Final = "draftstream-inference"
RECONSTRUCT_GROUP: Final = "draftstream-reconstruct"
AUDIT_GROUP: Final = "draftstream-audit"
SINK_GROUP: Final = "draftstream-sink"
CONTINUATION_GROUP: Final = "draftstream-continuation"

_FIXED = tuple(t.name for t in _topics if not t.is_pattern and t.name != DLQ_REPLAYED)
_ALL_CREATED = (*_FIXED, PROMPTS)  # what ensure_topics creates

_roles = (
    Role(
        "publish",
        None,
        reads=(PROMPTS,),
        writes=(PROMPTS,),
        description="Normalises dataset files into prompts; reads the topic's keys first to skip those present.",
        creates=_ALL_CREATED,
    ),
    Role(
        "inference",
        INFERENCE_GROUP,
        reads=(PROMPTS, CONTROL, RESPONSE_STORE, LEASES, RESPONSE_INDEX),
        writes=(REQUESTS, RESPONSES, DEAD_LETTER, RESPONSE_STORE, CONTROL, LEASES, RESPONSE_INDEX),
        description="Calls the provider per prompt; pauses on halts; halts all on an outage or a failed pre-flight.",
        creates=_ALL_CREATED,
    ),
    Role(
        "reconstruct",
        RECONSTRUCT_GROUP,
        reads=(RESPONSES, PROVIDER_FACTS),
        writes=(SAMPLES, DEAD_LETTER, PROVIDER_FACTS),
        description="Rebuilds the token ids of each response; records and follows the upstreams' facts.",
        creates=(PROVIDER_FACTS,),
    ),
    Role(
        "audit",
        AUDIT_GROUP,
        reads=(SAMPLES,),
        writes=(ACCEPTED, DEAD_LETTER),
        description="Runs the named checks; passing samples are accepted.",
    ),
    Role(
        "sink",
        SINK_GROUP,
        reads=(ACCEPTED,),
        writes=(DEAD_LETTER,),
        description="Writes accepted samples to training shards, each key once.",
    ),
    Role(
        "budget",
        None,
        reads=(REQUESTS, RESPONSES, CONTROL, DEAD_LETTER, BUDGET_STATE, ACCEPTED, LEASES),
        writes=(CONTROL, BUDGET_STATE, DEAD_LETTER, LEASES),
        description=(
            "Counts spend per dataset and in total from every partition (manual assignment); leases headroom "
            "under the caps; finishes a dataset at its cap; halts on the audit verdicts (accepted, dead letters) "
            "when the accepted share falls below min_yield."
        ),
        describes=(PROMPTS,),
        # The projection counts the prompts the inference group has not consumed yet.
        describes_groups=(INFERENCE_GROUP,),
        creates=_ALL_CREATED,
    ),
    Role(
        "dlq",
        None,
        reads=(DEAD_LETTER, DLQ_REPLAYED),
        # A replay goes to the record's original topic or to a stage's input topic.
        writes=(PROMPTS, REQUESTS, RESPONSES, SAMPLES, ACCEPTED, DLQ_REPLAYED),
        description="Lists, filters and replays dead letters; remembers replays in its ledger.",
        describes=(PROMPTS, REQUESTS, RESPONSES, SAMPLES, ACCEPTED),
        creates=(DLQ_REPLAYED,),
    ),
    Role(
        "status",
        None,
        reads=(BUDGET_STATE, DEAD_LETTER, CONTROL, CONVERSATIONS),
        writes=(),
        description="The status screen: end offsets, group lag, budget, halts, dead letters; commits nothing.",
        describes=(PROMPTS, RESPONSES, SAMPLES, ACCEPTED, DEAD_LETTER),
        describes_groups=(INFERENCE_GROUP, RECONSTRUCT_GROUP, AUDIT_GROUP, SINK_GROUP, CONTINUATION_GROUP),
    ),
    Role(
        "operator",
        None,
        reads=(CONTROL, BUDGET_STATE),
        writes=(CONTROL,),
        description="A person's commands: halt, resume, the budget report, the estimate.",
        creates=_ALL_CREATED,
    ),
    Role(
        "demo",
        None,
        reads=(DEAD_LETTER, CONVERSATIONS),
        writes=(),
        description="The demo runs every other role as its own process and reads the dead letters to report.",
    ),
    # Multi-turn regeneration.
    Role(
        "continuation",
        CONTINUATION_GROUP,
        reads=(ACCEPTED,),
        writes=(PROMPTS, CONVERSATIONS, DEAD_LETTER),
        description="Turns an accepted turn of a multi-turn dataset into the next turn's prompt (regenerated history).",
    ),
    Role(
        "admin",
        None,
        reads=(),
        writes=(),
        description="draftstream topics create: creates every fixed topic and prompts.<dataset>.",
        creates=_ALL_CREATED,
    ),
)
ROLES: Final[Mapping[str, Role]] = MappingProxyType({r.name: r for r in _roles})

GROUPS: Final[Mapping[str, str]] = MappingProxyType({r.name: r.group for r in _roles if r.group is not None})
"""Role name to logical consumer-group id, for the roles that consume in a group."""


def prompts_topic(dataset: str) -> str:
    """The logical prompts topic of one dataset (``prompts.<dataset>``)."""
    return f"{PROMPTS_PREFIX}{dataset}"


def topic_for(name: str) -> Topic:
    """The declared topic of a logical name; ``prompts.<dataset>`` resolves to ``prompts.*``.

    Raises:
        KeyError: the name is no topic of the topology (the message names it).
    """
    if name in TOPICS:
        return TOPICS[name]
    for topic in _topics:
        if topic.is_pattern and name.startswith(topic.prefix) and len(name) > len(topic.prefix):
            return topic
    raise KeyError(f"{name!r} is not a topic of the topology (known: {', '.join(TOPICS)})")


def belongs_to(physical: str, logical: str, topic_prefix: str = "") -> bool:
    """Whether a physical topic name is (one of) the logical topic's under a deployment prefix."""
    declared = TOPICS[logical]
    wanted = f"{topic_prefix}{declared.prefix}"
    return physical.startswith(wanted) and len(physical) > len(wanted) if declared.is_pattern else physical == wanted


def fixed_topics() -> tuple[str, ...]:
    """Logical names of the topics every deployment has (not ``prompts.*``, not the replay ledger)."""
    return _FIXED


def group_inputs() -> dict[str, tuple[str, ...]]:
    """Logical consumer group to the topics it consumes as a group (the stages' inputs).

    A role's other reads (inference's ``control``, ``response-store`` and ``response-index``) are group-less.
    """
    return {GROUPS[stage]: (topic,) for stage, topic in STAGE_INPUT.items()}


def writers_of(topic: str) -> tuple[str, ...]:
    """Names of the roles that produce to ``topic``."""
    return tuple(r.name for r in _roles if topic in r.writes)


def readers_of(topic: str) -> tuple[str, ...]:
    """Names of the roles that consume ``topic``."""
    return tuple(r.name for r in _roles if topic in r.reads)


__all__ = [
    "ACCEPTED",
    "AUDIT_GROUP",
    "BUDGET_STATE",
    "CONTINUATION_GROUP",
    "CONTROL",
    "CONVERSATIONS",
    "CONVERSATION_KEY",
    "DEAD_LETTER",
    "DEAD_LETTER_MESSAGE",
    "DLQ_REPLAYED",
    "GROUPS",
    "INFERENCE_GROUP",
    "LEASES",
    "PROMPTS",
    "PROMPTS_PREFIX",
    "PROVIDER_FACTS",
    "RECONSTRUCT_GROUP",
    "REPAY_HEADER",
    "TRUNCATED_HEADER",
    "REQUESTS",
    "RESPONSES",
    "RESPONSE_INDEX",
    "RESPONSE_STORE",
    "ROLES",
    "SAMPLES",
    "SAMPLE_KEY",
    "SINK_GROUP",
    "STAGES",
    "STAGE_INPUT",
    "STAGE_OUTPUT",
    "TOPICS",
    "Role",
    "Topic",
    "belongs_to",
    "fixed_topics",
    "prompts_topic",
    "group_inputs",
    "readers_of",
    "topic_for",
    "writers_of",
]
