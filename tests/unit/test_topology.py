"""The topology is declared once (schemas.topology): checks on the declaration and its readers."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import schemas as s
from schemas import topology

ROOT = Path(__file__).resolve().parents[2]
DECLARATION = ROOT / "schemas" / "topology.py"
SCANNED = ("services", "bench", "schemas")
# A line that needs one of the names for another meaning (a table heading) says so.
PRAGMA = "# topology: not a topic"


def forbidden_names() -> set[str]:
    """Every logical topic name, the prompts prefix and every consumer-group id."""
    return {*topology.TOPICS, topology.PROMPTS_PREFIX, *topology.GROUPS.values()}


def literals(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant and the leading text of every f-string."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def spelled_names(source: str) -> list[tuple[int, str]]:
    """Topic or group names spelled as literals in ``source`` (a physical ``prompts.x`` too)."""
    names = forbidden_names()
    lines = source.splitlines()
    found = []
    for line, text in literals(source):
        if PRAGMA in lines[line - 1]:
            continue
        if text in names or text.startswith(topology.PROMPTS_PREFIX):
            found.append((line, text))
    return sorted(set(found))


def test_the_scanner_finds_literals_and_respects_the_pragma() -> None:
    source = (
        'GROUP = "draftstream-audit"\n'
        "topic = kafka.topic('dead-letter')\n"
        'name = f"prompts.{dataset}"\n'
        'other = "responses-per-second"\n'
        f'heading = "accepted"  {PRAGMA}\n'
        '"""A docstring may speak of the control topic."""\n'
    )
    assert spelled_names(source) == [(1, "draftstream-audit"), (2, "dead-letter"), (3, "prompts.")]


def test_no_module_spells_a_topic_or_group_name_outside_the_topology() -> None:
    offenders = []
    files = sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py") if p != DECLARATION)
    assert len(files) > 50  # the scan really walked the code
    for path in files:
        for line, text in spelled_names(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not offenders, "spell these through schemas.topology:\n" + "\n".join(offenders)


def test_every_role_reads_and_writes_declared_topics() -> None:
    for role in topology.ROLES.values():
        for name in (*role.reads, *role.writes, *role.describes, *role.creates):
            assert name in topology.TOPICS, f"role {role.name} names unknown topic {name}"
        for group in role.describes_groups:
            assert group in topology.GROUPS.values(), f"role {role.name} describes unknown group {group}"
    for name in topology.TOPICS:
        assert topology.writers_of(name), f"nobody writes {name}"
        assert topology.readers_of(name), f"nobody reads {name}"


def test_the_pipeline_chains_each_stage_output_into_the_next_input() -> None:
    stages = topology.STAGES
    for before, after in zip(stages, stages[1:], strict=False):
        assert topology.STAGE_OUTPUT[before] == topology.STAGE_INPUT[after]
        assert topology.STAGE_INPUT[after] in topology.ROLES[after].reads
        assert topology.STAGE_OUTPUT[before] in topology.ROLES[before].writes
    assert set(topology.group_inputs()) == {topology.GROUPS[st] for st in topology.STAGE_INPUT}
    assert len(set(topology.GROUPS.values())) == len(topology.GROUPS)


def test_every_message_is_a_struct_of_the_schemas() -> None:
    for topic in topology.TOPICS.values():
        for message in topic.messages:
            if message == topology.DEAD_LETTER_MESSAGE:
                continue
            assert isinstance(getattr(s, message, None), type), f"{topic.name}: no schemas.{message}"


def test_topic_for_resolves_a_dataset_to_the_prompts_pattern_and_names_an_unknown_topic() -> None:
    assert topology.topic_for("prompts.math") is topology.TOPICS[topology.PROMPTS]
    assert topology.topic_for(topology.CONTROL).compacted
    with pytest.raises(KeyError, match="'prompt' is not a topic"):
        topology.topic_for("prompt")
    with pytest.raises(KeyError, match="'prompts.' is not a topic"):
        topology.topic_for(topology.PROMPTS_PREFIX)
    assert topology.belongs_to("p.prompts.math", topology.PROMPTS, "p.")
    assert not topology.belongs_to("p.prompts.", topology.PROMPTS, "p.")
    assert not topology.belongs_to("p.responses", topology.PROMPTS, "p.")
    assert topology.belongs_to("p.responses", topology.RESPONSES, "p.")
    assert not topology.belongs_to("p.responses-x", topology.RESPONSES, "p.")


def test_services_take_their_topics_and_groups_from_the_topology(settings_factory) -> None:
    from services.audit.app import AuditService
    from services.budget.app import CONSUMED
    from services.common.kafka import topic_configs
    from services.reconstruct.app import ReconstructService
    from services.status.core import GROUP_INPUTS, STAGE_TOPICS

    settings = settings_factory()
    kafka = settings.kafka
    for service, stage in ((ReconstructService(settings), "reconstruct"), (AuditService(settings), "audit")):
        assert list(service.runner.topics) == [kafka.topic(topology.STAGE_INPUT[stage])]
        expected_group = kafka.topic_prefix + f"draftstream-{stage}"
        assert service.runner.group_id == kafka.group(topology.GROUPS[stage]) == expected_group
    assert set(CONSUMED) <= set(topology.ROLES["budget"].reads)
    assert set(kafka.topics) == {n for n, t in topology.TOPICS.items() if not t.is_pattern} - {topology.DLQ_REPLAYED}
    for name, topic in topology.TOPICS.items():
        logical = topology.prompts_topic("math") if topic.is_pattern else name
        assert (topic_configs(kafka, logical).get("cleanup.policy") == "compact") is topic.compacted
    assert GROUP_INPUTS["draftstream-inference"] == (topology.PROMPTS,)
    status = topology.ROLES["status"]
    shown = {logical for _, logical in STAGE_TOPICS} | {t for inputs in GROUP_INPUTS.values() for t in inputs}
    assert shown <= set(status.describes) and set(GROUP_INPUTS) <= set(status.describes_groups)
    assert [stage for stage, _ in STAGE_TOPICS] == ["publish", "inference", "reconstruct", "audit", "failed"]
