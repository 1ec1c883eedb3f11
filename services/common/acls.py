"""Least-privilege Kafka ACLs, derived from the topology's roles (pure: no I/O).

Each role of :data:`schemas.topology.ROLES` is one SASL user, principal ``User:<role>``
(with an optional user prefix). It is allowed exactly what the role declares:

- ``reads``: READ on the topic (a consumer fetches, lists offsets, commits);
- ``writes``: WRITE on the topic. Since Kafka 2.8 WRITE on any topic also lets an
  idempotent producer get its producer id, so no IDEMPOTENT_WRITE on the cluster
  (a principal with no WRITE at all gets ``ClusterAuthorizationFailedError`` there);
- ``describes``: DESCRIBE (end offsets, metadata) where it neither reads nor writes;
- ``group``: READ on its consumer group; ``describes_groups``: DESCRIBE (lag);
- CREATE only for the ``admin`` role (``draftstream topics create``) and on a role's own
  topics that ``topics create`` does not make (the dlq's replay ledger): the services
  never create the pipeline's topics under ACLs.

READ, WRITE and CREATE imply DESCRIBE in Kafka, so DESCRIBE is granted only where it is
the whole need. ``prompts.*`` becomes one PREFIXED pattern, ``<prefix>prompts.``; every
other topic and group is LITERAL, with the deployment's ``kafka.topic_prefix`` in front
(groups carry it too, as the services name them).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from schemas.topology import ROLES, TOPICS, Role, fixed_topics

TOPIC = "TOPIC"
GROUP = "GROUP"
CLUSTER = "CLUSTER"
LITERAL = "LITERAL"
PREFIXED = "PREFIXED"
READ = "READ"
WRITE = "WRITE"
DESCRIBE = "DESCRIBE"
CREATE = "CREATE"
ALLOW = "ALLOW"

ADMIN_ROLE = "admin"
"""The role that creates topics; in deploy/kafka it is the broker's super user."""

_OPERATION_ORDER = {READ: 0, WRITE: 1, CREATE: 2, DESCRIBE: 3}
_AS_OPTION = {TOPIC: "--topic", GROUP: "--group", CLUSTER: "--cluster"}


@dataclass(frozen=True, order=True)
class AclBinding:
    """One ALLOW rule: a principal may do an operation on a resource pattern, from any host."""

    principal: str
    resource_type: str
    pattern_type: str
    resource_name: str
    operation: str
    permission: str = ALLOW
    host: str = "*"


def principal_of(role: str, user_prefix: str = "") -> str:
    """The principal a role's SASL user authenticates as: ``User:<user_prefix><role>``."""
    return f"User:{user_prefix}{role}"


def _topic_pattern(name: str, topic_prefix: str) -> tuple[str, str]:
    """(pattern type, physical name) of a logical topic; ``prompts.*`` is a prefix."""
    if name.endswith(".*"):  # as schemas.topology.Topic.is_pattern
        return PREFIXED, f"{topic_prefix}{name[:-1]}"
    return LITERAL, f"{topic_prefix}{name}"


def _creatable(role: Role) -> tuple[str, ...]:
    """The topics a role may create: all it lists for the admin, else only its own ones."""
    if role.name == ADMIN_ROLE:
        return role.creates
    made_by_admin = {*fixed_topics(), *(t.name for t in TOPICS.values() if t.is_pattern)}
    return tuple(t for t in role.creates if t not in made_by_admin)


def used_topics(role: str) -> tuple[str, ...]:
    """The logical topics a role reads, writes or describes (``prompts.*`` for the prompts)."""
    found = ROLES[role]
    return tuple(dict.fromkeys((*found.reads, *found.writes, *found.describes)))


def role_bindings(role: Role, *, topic_prefix: str = "", user_prefix: str = "") -> list[AclBinding]:
    """The ALLOW rules of one role, without duplicates, in a stable order."""
    principal = principal_of(role.name, user_prefix)
    wanted: dict[tuple[str, str, str], set[str]] = {}

    def allow(resource_type: str, pattern: tuple[str, str], operation: str) -> None:
        wanted.setdefault((resource_type, *pattern), set()).add(operation)

    for name in role.reads:
        allow(TOPIC, _topic_pattern(name, topic_prefix), READ)
    for name in role.writes:
        allow(TOPIC, _topic_pattern(name, topic_prefix), WRITE)
    for name in _creatable(role):
        allow(TOPIC, _topic_pattern(name, topic_prefix), CREATE)
    for name in role.describes:
        allow(TOPIC, _topic_pattern(name, topic_prefix), DESCRIBE)
    if role.group is not None:
        allow(GROUP, (LITERAL, f"{topic_prefix}{role.group}"), READ)
    for group in role.describes_groups:
        allow(GROUP, (LITERAL, f"{topic_prefix}{group}"), DESCRIBE)
    out: list[AclBinding] = []
    for (resource_type, pattern_type, name), operations in sorted(wanted.items()):
        if len(operations) > 1:
            operations = operations - {DESCRIBE}  # implied by any of the others
        for operation in sorted(operations, key=_OPERATION_ORDER.__getitem__):
            out.append(AclBinding(principal, resource_type, pattern_type, name, operation))
    return out


def acl_bindings(
    roles: Mapping[str, Role] | None = None, *, topic_prefix: str = "", user_prefix: str = ""
) -> list[AclBinding]:
    """Every role's ALLOW rules, role by role in the topology's order."""
    chosen = ROLES if roles is None else roles
    return [b for role in chosen.values() for b in role_bindings(role, topic_prefix=topic_prefix,
                                                                  user_prefix=user_prefix)]


def kafka_acls_arguments(bindings: Iterable[AclBinding]) -> list[list[str]]:
    """``kafka-acls --add`` arguments that create exactly ``bindings``, few invocations.

    kafka-acls adds every listed operation on every listed resource (a cross product), so
    one invocation holds one principal, one pattern type and one operation, with all the
    resources that share them.
    """
    grouped: dict[tuple[str, str, str], list[AclBinding]] = {}
    for b in bindings:
        grouped.setdefault((b.principal, b.pattern_type, b.operation), []).append(b)
    commands: list[list[str]] = []
    for (principal, pattern_type, operation), members in grouped.items():
        args = ["--add", "--allow-principal", principal, "--allow-host", "*", "--operation", operation,
                "--resource-pattern-type", pattern_type.lower()]
        for b in members:
            args.append(_AS_OPTION[b.resource_type])
            if b.resource_type != CLUSTER:  # the cluster has one name, kafka-cluster
                args.append(b.resource_name)
        commands.append(args)
    return commands


def format_kafka_acls(bindings: Sequence[AclBinding], *, topic_prefix: str = "") -> str:
    """The set as a shell script of ``kafka-acls.sh`` command lines, with a header."""
    lines = [
        "# draftstream: least-privilege ACLs per service, generated from schemas/topology.py",
        f"# by `draftstream acls print --format kafka-acls --prefix '{topic_prefix}'`. Do not edit.",
        "# Run as the admin (a super user): BOOTSTRAP is a SASL listener, ADMIN_CONFIG a client",
        "# properties file with the admin's SASL and TLS settings. `draftstream acls apply` does this.",
        f"# {len(bindings)} ACLs for {len({b.principal for b in bindings})} principals.",
    ]
    current = None
    for args in kafka_acls_arguments(bindings):
        principal = args[args.index("--allow-principal") + 1]
        if principal != current:
            lines.append(f"\n# {principal}")
            current = principal
        lines.append(
            'kafka-acls.sh --bootstrap-server "$BOOTSTRAP" --command-config "$ADMIN_CONFIG" '
            + shlex.join(args)
        )
    return "\n".join(lines) + "\n"


def format_json(bindings: Sequence[AclBinding]) -> str:
    """The set as a JSON array of bindings (one object per ACL)."""
    return json.dumps([asdict(b) for b in bindings], indent=2) + "\n"


__all__ = [
    "ADMIN_ROLE",
    "AclBinding",
    "acl_bindings",
    "format_json",
    "format_kafka_acls",
    "kafka_acls_arguments",
    "principal_of",
    "role_bindings",
    "used_topics",
]
