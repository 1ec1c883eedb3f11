"""The topic contracts: every event that travels between draftstream's stages.

Evolution follows msgspec's rules: new fields get defaults, existing field types never
change, unknown fields are tolerated on the wire. Every event carries
``schema_version``; a record newer than this code (``schema_version`` above
``SCHEMA_VERSION``) is refused with :class:`SchemaError` rather than half-understood.

Keys on every topic are ``<dataset>:<sample_id>`` (see :func:`sample_key`), except
``control`` (keyed by scope) and ``budget-state`` (keyed by dataset).
"""

from __future__ import annotations

from typing import Final

from schemas import topology as _topology
from schemas.codec import (
    decode,
    decode_control,
    decode_lease,
    decode_store_index,
    encode,
    encode_forwarding,
)
from schemas.events import (
    BudgetSnapshot,
    CheckResult,
    ControlEvent,
    ConversationProgressed,
    Halt,
    HeldAttempt,
    LeaseEvent,
    LeaseGranted,
    LeasePolicy,
    LeaseReleased,
    LeaseRequested,
    LogprobToken,
    PromptPublished,
    ProviderFactRecorded,
    ReplayRecorded,
    RequestStarted,
    ResponseIndexed,
    ResponseReceived,
    Resume,
    SampleAudited,
    SampleReconstructed,
    StoreCheckpointed,
    StoreIndexEvent,
    Usage,
    YieldFigures,
    lease_key,
)
from schemas.fields import SCHEMA_VERSION, SchemaError
from schemas.keys import (
    DLQ_HEADERS,
    PROVIDER_SCOPE_PREFIX,
    DeadLetterHeaders,
    attempt_key,
    provider_of_scope,
    provider_scope,
    sample_key,
    split_key,
)
from schemas.messages import ConversationTurn, Message, ToolCall, ToolFunction, wire_messages

__all__ = [
    "ACCEPTED_TOPIC",
    "BUDGET_STATE_TOPIC",
    "CONTROL_TOPIC",
    "CONVERSATIONS_TOPIC",
    "DEAD_LETTER_TOPIC",
    "DLQ_HEADERS",
    "GLOBAL_SCOPE",
    "PROVIDER_SCOPE_PREFIX",
    "HeldAttempt",
    "LEASES_TOPIC",
    "PROMPTS_TOPIC_PREFIX",
    "PROVIDER_FACTS_TOPIC",
    "REQUESTS_TOPIC",
    "RESPONSES_TOPIC",
    "RESPONSE_INDEX_TOPIC",
    "RESPONSE_STORE_TOPIC",
    "SAMPLES_TOPIC",
    "SCHEMA_VERSION",
    "BudgetSnapshot",
    "CheckResult",
    "ControlEvent",
    "ConversationTurn",
    "ConversationProgressed",
    "DeadLetterHeaders",
    "Halt",
    "LeaseEvent",
    "LeaseGranted",
    "LeasePolicy",
    "LeaseReleased",
    "LeaseRequested",
    "LogprobToken",
    "Message",
    "PromptPublished",
    "ProviderFactRecorded",
    "ReplayRecorded",
    "RequestStarted",
    "ResponseIndexed",
    "ResponseReceived",
    "Resume",
    "SampleAudited",
    "SampleReconstructed",
    "SchemaError",
    "StoreCheckpointed",
    "StoreIndexEvent",
    "ToolCall",
    "ToolFunction",
    "Usage",
    "YieldFigures",
    "decode",
    "decode_control",
    "decode_lease",
    "lease_key",
    "attempt_key",
    "decode_store_index",
    "encode",
    "encode_forwarding",
    "provider_of_scope",
    "provider_scope",
    "sample_key",
    "split_key",
    "wire_messages",
]

# Logical topic names, declared in schemas.topology (a configured prefix is prepended by
# services.common.config).
PROMPTS_TOPIC_PREFIX: Final = _topology.PROMPTS_PREFIX
REQUESTS_TOPIC: Final = _topology.REQUESTS
RESPONSES_TOPIC: Final = _topology.RESPONSES
SAMPLES_TOPIC: Final = _topology.SAMPLES
ACCEPTED_TOPIC: Final = _topology.ACCEPTED
DEAD_LETTER_TOPIC: Final = _topology.DEAD_LETTER
CONTROL_TOPIC: Final = _topology.CONTROL
BUDGET_STATE_TOPIC: Final = _topology.BUDGET_STATE
RESPONSE_STORE_TOPIC: Final = _topology.RESPONSE_STORE
# Multi-turn regeneration.
CONVERSATIONS_TOPIC: Final = _topology.CONVERSATIONS
LEASES_TOPIC: Final = _topology.LEASES
RESPONSE_INDEX_TOPIC: Final = _topology.RESPONSE_INDEX
PROVIDER_FACTS_TOPIC: Final = _topology.PROVIDER_FACTS
GLOBAL_SCOPE: Final = "global"
