"""Generates the AsyncAPI 3.0 document of draftstream from the topology and the Structs.

Channels are the topics of :mod:`schemas.topology` (``prompts.*`` is the parameterised
address ``prompts.{dataset}``), operations are each role's reads (``receive``) and writes
(``send``), payload schemas are ``msgspec.json.schema_components`` of the Structs (as
``schemas/export.py`` does for the JSON Schemas). Kafka bindings (version 0.5.0 of the
AsyncAPI Kafka bindings, https://www.asyncapi.com/docs/reference/bindings/kafka) carry the
topic's partitions and ``cleanup.policy`` where the topology fixes them, the consumer group
of each group read (operation ``groupId``) and the record key (message ``key``). The
dead-letter message documents its ``draftstream.errors.*`` headers.

``make schemas`` writes it to ``schemas/generated/asyncapi.yaml``; ``deploy/asyncapi``
validates it with the reference parser, ``@asyncapi/parser``.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import yaml

import schemas as s
from schemas import topology
from schemas.wire_rules import apply_wire_rules

ASYNCAPI_VERSION: Final = "3.0.0"
KAFKA_BINDING_VERSION: Final = "0.5.0"

# What each dead-letter header says (services.common.kafka.dead_letter writes them).
DLQ_HEADER_DOCS: Final[dict[str, str]] = {
    "STAGE": "The stage that failed the record (inference, reconstruct, audit, sink, budget).",
    "REASON": "The primary reason code, e.g. usage_mismatch or provider_http_400.",
    "REASONS": "Every failing reason code, comma-separated, the primary first.",
    "MESSAGE": "A human-readable error message (cut at 4000 characters).",
    "HTTP_STATUS": "The provider's HTTP status, when an HTTP answer caused the failure.",
    "TOPIC": "The physical topic the failed record was read from.",
    "PARTITION": "Its partition there.",
    "OFFSET": "Its offset there.",
    "DATASET": "The dataset of the record (from the key when the value did not decode).",
    "KEY": "The record's key as text.",
    "ATTEMPT": "How many attempts were made before giving up.",
    "REPLAY_COUNT": "How often the record was replayed from the dead-letter topic before this failure.",
    "FIRST_FAILURE": "Epoch milliseconds of the record's first failure (kept across replays).",
    "FAILED_AT": "Epoch milliseconds of this failure.",
    "VALUE_NULL": "\"true\" when the failed record was a tombstone (null value): the dead letter's value "
    "is null too and a replay sends a tombstone again. Absent otherwise.",
}
_OPTIONAL_DLQ_HEADERS: Final = frozenset({"HTTP_STATUS", "VALUE_NULL"})
# A replayed record carries these two on the topic it is re-sent to (services.dlq.core).
_REPLAY_HEADERS: Final = ("REPLAY_COUNT", "FIRST_FAILURE")


def dlq_header_names() -> dict[str, str]:
    """Attribute to header name of every :class:`schemas.DeadLetterHeaders` constant."""
    return {k: v for k, v in vars(s.DeadLetterHeaders).items() if k.isupper() and isinstance(v, str)}


def message_types() -> dict[str, type[msgspec.Struct]]:
    """Struct name to Struct of every message the topology names (the dead letter aside)."""
    out: dict[str, type[msgspec.Struct]] = {}
    for topic in topology.TOPICS.values():
        for name in topic.messages:
            if name == topology.DEAD_LETTER_MESSAGE:
                continue
            found = getattr(s, name, None)
            if not (isinstance(found, type) and issubclass(found, msgspec.Struct)):
                raise LookupError(f"topic {topic.name} names message {name}, which is no Struct in schemas")
            out[name] = found
    return out


def channel_id(topic: topology.Topic) -> str:
    """The channel key of a topic: its name, ``prompts`` for the ``prompts.*`` pattern."""
    return topic.prefix.rstrip(".") if topic.is_pattern else topic.name


def _headers_schema(
    attrs: tuple[str, ...], required: tuple[str, ...], title: str, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    names = dlq_header_names()
    properties = {names[a]: {"type": "string", "description": DLQ_HEADER_DOCS[a]} for a in attrs}
    properties.update({name: {"type": "string", "description": doc} for name, doc in (extra or {}).items()})
    schema: dict[str, Any] = {
        "type": "object",
        "title": title,
        "description": "Kafka record headers; values are UTF-8 text.",
        "properties": properties,
    }
    if required:
        schema["required"] = [names[a] for a in required]
    return schema


def _summary(type_: type) -> str:
    return (type_.__doc__ or "").strip().splitlines()[0]


def _message(topic: topology.Topic, name: str, replayable: bool) -> dict[str, Any]:
    key = {"type": "string", "description": f"Record key: {topic.key}."}
    message: dict[str, Any] = {"name": name, "title": name, "contentType": "application/json"}
    if name == topology.DEAD_LETTER_MESSAGE:
        events = [n for t in topology.TOPICS.values() if t.name != topic.name for n in t.messages]
        message["contentType"] = "application/octet-stream"
        message["summary"] = "A failed record: its value byte for byte, with headers saying why and where from."
        message["payload"] = {
            "description": "The failed record's value as it was read: usually one of the events, "
            "or bytes that did not decode as one.",
            "anyOf": [
                *({"$ref": f"#/components/schemas/{n}"} for n in dict.fromkeys(events)),
                {"type": "string", "description": "A value that is no event (kept as it was)."},
                {"type": "null", "description": "A tombstone (see the value.null header)."},
            ],
        }
        attrs = tuple(dlq_header_names())
        required = tuple(a for a in attrs if a not in _OPTIONAL_DLQ_HEADERS)
        message["headers"] = _headers_schema(attrs, required, "DeadLetterHeaders")
    else:
        message["summary"] = _summary(message_types()[name])
        message["payload"] = {"$ref": f"#/components/schemas/{name}"}
        extra = {}
        if topic.name == topology.PROMPTS:
            extra[topology.REPAY_HEADER] = "Set to 1: send the prompt to the provider again even if already paid for."
        if topic.name == topology.ACCEPTED:
            extra[topology.TRUNCATED_HEADER] = "1: the answer was cut at the token limit, accepted (accept_truncated)."
        if replayable or extra:
            message["headers"] = _headers_schema(_REPLAY_HEADERS if replayable else (), (), "RecordHeaders", extra)
    message["bindings"] = {"kafka": {"key": key, "bindingVersion": KAFKA_BINDING_VERSION}}
    return message


def _channel(topic: topology.Topic) -> dict[str, Any]:
    replayable = topic.name in topology.ROLES["dlq"].writes
    binding: dict[str, Any] = {"topic": topic.prefix + "{dataset}" if topic.is_pattern else topic.name}
    if topic.partitions is not None:
        binding["partitions"] = topic.partitions
    binding["topicConfiguration"] = {"cleanup.policy": ["compact" if topic.compacted else "delete"]}
    binding["bindingVersion"] = KAFKA_BINDING_VERSION
    description = topic.description
    if topic.partitions is None:
        description += " Partitions: the configured kafka.partitions."
    channel: dict[str, Any] = {
        "address": binding["topic"],
        "title": topic.name,
        "description": description,
        "messages": {name: _message(topic, name, replayable) for name in topic.messages},
        "bindings": {"kafka": binding},
    }
    if topic.is_pattern:
        channel["parameters"] = {"dataset": {"description": "The dataset name, as configured under [datasets]."}}
    return channel


def _operations() -> dict[str, Any]:
    operations: dict[str, Any] = {}
    for role in topology.ROLES.values():
        for action, topics in (("receive", role.reads), ("send", role.writes)):
            for name in topics:
                topic = topology.TOPICS[name]
                cid = channel_id(topic)
                operation: dict[str, Any] = {
                    "action": action,
                    "channel": {"$ref": f"#/channels/{cid}"},
                    "title": f"{role.name} {action}s {topic.name}",
                    "summary": role.description,
                    "messages": [{"$ref": f"#/channels/{cid}/messages/{m}"} for m in topic.messages],
                }
                if action == "receive":
                    grouped = role.group is not None and topology.STAGE_INPUT.get(role.name) == name
                    if grouped:
                        operation["bindings"] = {
                            "kafka": {
                                "groupId": {"type": "string", "enum": [role.group]},
                                "bindingVersion": KAFKA_BINDING_VERSION,
                            }
                        }
                    else:
                        operation["description"] = "Read without a consumer group (assigned partitions, no commits)."
                operations[f"{role.name}-{action}-{cid}"] = operation
    return operations


def build() -> dict[str, Any]:
    """The AsyncAPI document as plain data."""
    types = message_types()
    _, components = msgspec.json.schema_components(
        [types[n] for n in sorted(types)], ref_template="#/components/schemas/{name}"
    )
    apply_wire_rules(components, components)
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "draftstream",
            "version": str(s.SCHEMA_VERSION),
            "description": (
                "Topics, events and services of draftstream, generated from schemas/topology.py and the "
                "msgspec Structs in schemas/ (never edited by hand). Topic and consumer-group names are "
                "logical: a deployment's kafka.topic_prefix is prepended to both. info.version is the "
                "events' schema_version. Pipeline: " + " -> ".join(topology.STAGES) + "."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "kafka": {
                "host": "127.0.0.1:9092",
                "protocol": "kafka",
                "description": "The configured kafka.bootstrap_servers (PLAINTEXT, SASL and/or TLS).",
            }
        },
        "channels": {channel_id(t): _channel(t) for t in topology.TOPICS.values()},
        "operations": _operations(),
        "components": {"schemas": dict(sorted(components.items()))},
    }


def render() -> str:
    """The AsyncAPI document as YAML text (stable: same topology and Structs, same bytes)."""
    text: str = yaml.safe_dump(build(), sort_keys=False, allow_unicode=True, width=100)
    return "# Generated by `make schemas` from schemas/topology.py and the Structs: do not edit.\n" + text


__all__ = ["ASYNCAPI_VERSION", "KAFKA_BINDING_VERSION", "build", "channel_id", "message_types", "render"]
