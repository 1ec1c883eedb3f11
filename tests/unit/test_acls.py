"""The ACL set derived from the topology: least privilege, the committed file, the tool's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiokafka.errors import ClusterAuthorizationFailedError, GroupAuthorizationFailedError
from pydantic import SecretStr
from typer.testing import CliRunner

from schemas.topology import ROLES
from services.cli import app
from services.common.acls import (
    AclBinding,
    acl_bindings,
    format_json,
    format_kafka_acls,
    kafka_acls_arguments,
    role_bindings,
)
from services.common.acls_apply import admin_client_properties, apply_acls
from services.common.config import KafkaSettings
from services.common.errors import CommandError
from services.common.kafka import access_denied

ACLS_FILE = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "acls.txt"


def rules(role: str, prefix: str = "") -> set[tuple[str, str, str, str]]:
    """(resource type, pattern type, name, operation) of one role."""
    return {(b.resource_type, b.pattern_type, b.resource_name, b.operation)
            for b in role_bindings(ROLES[role], topic_prefix=prefix)}


def test_committed_acl_file_is_the_generated_set() -> None:
    """deploy/kafka/acls.txt is what `draftstream acls print` prints (regenerate it when this fails)."""
    assert ACLS_FILE.read_text(encoding="utf-8") == format_kafka_acls(acl_bindings())


def test_inference_and_budget_get_exactly_their_topics_and_group() -> None:
    """The pipeline's two money-critical roles, spelled out."""
    assert rules("inference", "p.") == {
        ("TOPIC", "PREFIXED", "p.prompts.", "READ"),
        ("TOPIC", "LITERAL", "p.control", "READ"),
        ("TOPIC", "LITERAL", "p.control", "WRITE"),
        ("TOPIC", "LITERAL", "p.response-store", "READ"),
        ("TOPIC", "LITERAL", "p.response-store", "WRITE"),
        ("TOPIC", "LITERAL", "p.leases", "READ"),
        ("TOPIC", "LITERAL", "p.leases", "WRITE"),
        ("TOPIC", "LITERAL", "p.response-index", "READ"),
        ("TOPIC", "LITERAL", "p.response-index", "WRITE"),
        ("TOPIC", "LITERAL", "p.requests", "WRITE"),
        ("TOPIC", "LITERAL", "p.responses", "WRITE"),
        ("TOPIC", "LITERAL", "p.dead-letter", "WRITE"),
        ("GROUP", "LITERAL", "p.draftstream-inference", "READ"),
    }
    budget = rules("budget")
    assert ("TOPIC", "LITERAL", "responses", "READ") in budget
    assert ("TOPIC", "LITERAL", "control", "WRITE") in budget
    assert ("TOPIC", "LITERAL", "leases", "WRITE") in budget
    assert ("TOPIC", "PREFIXED", "prompts.", "DESCRIBE") in budget
    # It reads by manual assignment (no group of its own); it describes the inference group's offsets
    # (the prompts still waiting, for its projection).
    assert {r for r in budget if r[0] == "GROUP"} == {("GROUP", "LITERAL", "draftstream-inference", "DESCRIBE")}


def test_no_service_may_create_the_pipelines_topics_or_touch_the_cluster() -> None:
    """CREATE only for the admin, and for the dlq's own replay ledger; no CLUSTER rule at all."""
    for binding in acl_bindings():
        assert binding.resource_type != "CLUSTER", binding
        if binding.operation == "CREATE" and binding.principal != "User:admin":
            assert (binding.principal, binding.resource_name) == ("User:dlq", "dlq-replayed"), binding


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_rule_of_a_role_comes_from_its_declaration(role: str) -> None:
    """Reads → READ, writes → WRITE, describes → DESCRIBE (unless implied), group → READ."""
    declared = ROLES[role]
    for kind, pattern, name, operation in rules(role):
        logical = name + "*" if pattern == "PREFIXED" else name
        if kind == "GROUP":
            assert (name == declared.group and operation == "READ") or (
                name in declared.describes_groups and operation == "DESCRIBE"), (kind, name, operation)
        elif operation == "READ":
            assert logical in declared.reads
        elif operation == "WRITE":
            assert logical in declared.writes
        elif operation == "DESCRIBE":
            assert logical in declared.describes and logical not in (*declared.reads, *declared.writes)
        else:
            assert operation == "CREATE" and logical in declared.creates


def test_kafka_acls_invocations_add_exactly_the_bindings() -> None:
    """kafka-acls adds the cross product of its principals, operations and resources: no more."""
    bindings = acl_bindings(topic_prefix="x.")
    added: set[AclBinding] = set()
    for args in kafka_acls_arguments(bindings):
        options = list(zip(args[1::2], args[2::2], strict=False)) if args[0] == "--add" else []
        principals = [v for k, v in options if k == "--allow-principal"]
        operations = [v for k, v in options if k == "--operation"]
        pattern = next(v for k, v in options if k == "--resource-pattern-type").upper()
        resources = [("TOPIC" if k == "--topic" else "GROUP", v) for k, v in options if k in ("--topic", "--group")]
        added |= {AclBinding(p, t, pattern, n, o) for p in principals for o in operations for t, n in resources}
    assert added == set(bindings)
    assert len(kafka_acls_arguments(bindings)) < len(bindings)


def test_print_command_json_and_a_bad_format() -> None:
    """The CLI prints the same set as JSON; an unknown format is one line and exit 2."""
    runner = CliRunner()
    done = runner.invoke(app, ["acls", "print", "--format", "json", "--prefix", "dep."])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == json.loads(format_json(acl_bindings(topic_prefix="dep.")))
    bad = runner.invoke(app, ["acls", "print", "--format", "yaml"])
    assert bad.exit_code == 2 and "--format 'yaml'" in bad.output


def test_admin_properties_quote_the_password_and_trust_the_ca() -> None:
    """SCRAM JAAS line with the password escaped; the CA as a PEM truststore."""
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="root",
                          sasl_password=SecretStr('p"w\\1'), ssl_cafile="/tls/ca.pem")
    text = admin_client_properties(kafka)
    assert 'ScramLoginModule required username="root" password="p\\"w\\\\1";' in text
    assert "ssl.truststore.type=PEM\nssl.truststore.location=/tls/ca.pem" in text
    with pytest.raises(CommandError, match="DRAFTSTREAM_KAFKA__SASL_PASSWORD"):
        admin_client_properties(KafkaSettings(security_protocol="SASL_SSL", sasl_username="root"))


def test_apply_runs_the_tool_with_a_private_config_and_reports_a_failure(tmp_path: Path) -> None:
    """The password lives in a 0600 file, never on the command line; a failing run names itself."""
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="root",
                          sasl_password=SecretStr("s3cret"))
    seen: list[list[str]] = []

    def runner(command: list[str]):  # noqa: ANN202 - a CompletedProcess stand-in
        import subprocess

        config = Path(command[command.index("--command-config") + 1])
        assert config.stat().st_mode & 0o077 == 0 and "s3cret" in config.read_text()
        seen.append(command)
        failed = "--group" in command
        return subprocess.CompletedProcess(command, 1 if failed else 0, "", "boom: not allowed" if failed else "")

    bindings = role_bindings(ROLES["sink"])
    with pytest.raises(CommandError, match="boom: not allowed"):
        apply_acls(bindings, kafka, tool=["kafka-acls.sh"], runner=runner)
    assert seen and all("s3cret" not in " ".join(c) for c in seen)
    ok = apply_acls(role_bindings(ROLES["demo"]), kafka, tool=["kafka-acls.sh"], runner=runner)
    assert ok == 1


def test_access_denied_names_principal_operation_and_resource() -> None:
    """One line with the SASL user, the operation and the group; the cluster case says why."""
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_username="sink")
    line = str(access_denied(GroupAuthorizationFailedError("p.draftstream-audit"), kafka, "READ"))
    assert line.startswith("Kafka refused User:sink READ on group p.draftstream-audit (")
    cluster = str(access_denied(ClusterAuthorizationFailedError(), kafka, "WRITE"))
    assert "IDEMPOTENT_WRITE" in cluster and "\n" not in cluster
