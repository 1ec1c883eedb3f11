"""The AsyncAPI document: generated from the topology, fresh, complete, valid for @asyncapi/parser.

The validation runs the reference parser (npm ``@asyncapi/parser``, pinned by
``deploy/asyncapi/package-lock.json``), installed with ``npm ci`` on first use. Without
node/npm the validation tests skip, except under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import schemas as s
from schemas import asyncapi, topology

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "schemas" / "generated" / "asyncapi.yaml"
VALIDATOR = ROOT / "deploy" / "asyncapi"
IN_CI = os.environ.get("CI", "").lower() == "true"
SUMMARY = re.compile(r"^errors=(\d+) warnings=(\d+) infos=(\d+) hints=(\d+)$", re.MULTILINE)


def _missing(what: str) -> None:
    """Skip, or fail under CI=true, because a tool the test needs is absent."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing tool is a failure)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with deploy/asyncapi's pinned parser installed (``npm ci`` once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _missing("node/npm are not installed: cannot run @asyncapi/parser")
    assert node is not None and npm is not None
    lock = json.loads((VALIDATOR / "package-lock.json").read_text(encoding="utf-8"))
    pinned = lock["packages"]["node_modules/@asyncapi/parser"]["version"]
    installed = VALIDATOR / "node_modules" / "@asyncapi" / "parser" / "package.json"
    if not installed.exists() or json.loads(installed.read_text(encoding="utf-8"))["version"] != pinned:
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=VALIDATOR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode != 0:
            _missing(f"npm ci in deploy/asyncapi failed: {result.stderr.strip()[-500:]}")
    return node


def validate(node: str, path: Path) -> tuple[int, int, str]:
    """(errors, warnings, output) of the reference parser on the document at ``path``."""
    result = subprocess.run(
        [node, str(VALIDATOR / "validate.mjs"), str(path)], capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    match = SUMMARY.search(result.stdout)
    assert match, f"the validator printed no summary:\n{output}"
    errors, warnings = int(match[1]), int(match[2])
    assert (result.returncode != 0) == (errors > 0), output
    return errors, warnings, output


def test_generated_asyncapi_is_fresh() -> None:
    assert GENERATED.exists(), f"{GENERATED} missing: run `make schemas`"
    assert GENERATED.read_text(encoding="utf-8") == asyncapi.render(), f"{GENERATED} is stale: run `make schemas`"


def test_generated_asyncapi_has_no_parser_errors(node: str) -> None:
    errors, warnings, output = validate(node, GENERATED)
    print(f"@asyncapi/parser on {GENERATED.name}: {errors} error(s), {warnings} warning(s)")
    assert errors == 0, output
    assert warnings == 0, output


def test_the_parser_catches_a_broken_document(node: str, tmp_path: Path) -> None:
    doc = asyncapi.build()
    # an operation on a channel that does not exist, and a message without its payload schema
    doc["operations"]["inference-send-responses"]["channel"] = {"$ref": "#/channels/no-such-topic"}
    del doc["components"]["schemas"]["ResponseReceived"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    errors, _, output = validate(node, broken)
    print(f"@asyncapi/parser on a broken copy: {errors} error(s)")
    assert errors >= 1, output
    assert "no-such-topic" in output or "ResponseReceived" in output, output


def test_every_topic_message_header_and_group_is_named() -> None:
    doc = yaml.safe_load(GENERATED.read_text(encoding="utf-8"))
    channels = doc["channels"]
    assert {c["title"] for c in channels.values()} == set(topology.TOPICS)
    assert channels["prompts"]["address"] == "prompts.{dataset}"
    for topic in topology.TOPICS.values():
        channel = channels[asyncapi.channel_id(topic)]
        assert set(channel["messages"]) == set(topic.messages)
        binding = channel["bindings"]["kafka"]
        assert binding["topicConfiguration"]["cleanup.policy"] == (["compact"] if topic.compacted else ["delete"])
        assert binding.get("partitions") == topic.partitions
        for message in channel["messages"].values():
            assert message["bindings"]["kafka"]["key"]["description"] == f"Record key: {topic.key}."
    # payload schemas of every Struct on a topic, from msgspec (not written by hand)
    assert set(doc["components"]["schemas"]) >= set(asyncapi.message_types())
    assert doc["components"]["schemas"]["Halt"]["properties"]["action"] == {"enum": ["halt"]}
    # every dead-letter header, named as services.common.kafka.dead_letter writes it
    headers = channels["dead-letter"]["messages"]["DeadLetter"]["headers"]
    names = {v for k, v in vars(s.DeadLetterHeaders).items() if k.isupper()}
    assert set(headers["properties"]) == names and len(names) == 15
    assert set(headers["required"]) == names - {s.DLQ_HEADERS.HTTP_STATUS, s.DLQ_HEADERS.VALUE_NULL}
    assert topology.REPAY_HEADER in channels["prompts"]["messages"]["PromptPublished"]["headers"]["properties"]
    # every consumer group, on the operation that reads its stage's input
    groups = {
        g
        for op in doc["operations"].values()
        for g in op.get("bindings", {}).get("kafka", {}).get("groupId", {}).get("enum", [])
    }
    assert groups == set(topology.GROUPS.values()) and len(groups) == 5
    assert doc["operations"]["reconstruct-receive-responses"]["bindings"]["kafka"]["groupId"]["enum"] == [
        "draftstream-reconstruct"
    ]
    # every role's reads and writes are operations
    for role in topology.ROLES.values():
        for name in role.reads:
            assert f"{role.name}-receive-{asyncapi.channel_id(topology.TOPICS[name])}" in doc["operations"]
        for name in role.writes:
            assert f"{role.name}-send-{asyncapi.channel_id(topology.TOPICS[name])}" in doc["operations"]


def test_every_dead_letter_header_has_a_description() -> None:
    assert set(asyncapi.DLQ_HEADER_DOCS) == set(asyncapi.dlq_header_names())
