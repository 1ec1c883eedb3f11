"""The local cluster's configuration as deploy/kafka/kafka.sh renders it (`kafka.sh config`,
no JVM), the status and quorum lines as services.common.broker reads them, and the
replication and layout arithmetic of services.common.kafka."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from services.common import broker
from services.common.config import load_settings
from services.common.kafka import ClusterLayout, PartitionState, replication_for

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    # make test exports KAFKA_PORT and friends for its own broker: none of them leak in here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    return {**env, "KAFKA_RUN_DIR": str(run_dir), **extra}


def _script(run_dir: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=_env(run_dir, **extra),
                          capture_output=True, text=True, timeout=60, check=False)


def _props(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            assert key not in out, f"{key} set twice"
            out[key] = value
    return out


def _per_node(text: str) -> dict[int, dict[str, str]]:
    parts = re.split(r"^# ==> node-(\d+)/server.properties <==$", text, flags=re.M)
    return {int(parts[i]): _props(parts[i + 1]) for i in range(1, len(parts), 2)}


def test_three_nodes_get_their_own_ids_ports_dirs_and_one_quorum(tmp_path: Path) -> None:
    done = _script(tmp_path, "config", "--nodes", "3", KAFKA_PORT="41000")
    assert done.returncode == 0, done.stderr
    nodes = _per_node(done.stdout)
    assert sorted(nodes) == [1, 2, 3]
    voters = "1@127.0.0.1:41003,2@127.0.0.1:41004,3@127.0.0.1:41005"
    for i, props in nodes.items():
        assert props["node.id"] == str(i)
        assert props["process.roles"] == "broker,controller"
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{41000 + i - 1},CONTROLLER://127.0.0.1:{41003 + i - 1}"
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{41000 + i - 1}"
        assert props["controller.quorum.voters"] == voters
        assert "controller.quorum.bootstrap.servers" not in props  # a static quorum: voters only
        assert props["log.dirs"] == str(tmp_path / f"node-{i}" / "data")
        assert props["default.replication.factor"] == "3"
        assert props["offsets.topic.replication.factor"] == "3"
        assert props["transaction.state.log.replication.factor"] == "3"
        assert props["share.coordinator.state.topic.replication.factor"] == "3"
        assert props["min.insync.replicas"] == "2"
        assert props["transaction.state.log.min.isr"] == "2"
        assert props["share.coordinator.state.topic.min.isr"] == "2"
        assert props["message.max.bytes"] == "16777216"  # the template's other settings stay
    assert list(tmp_path.iterdir()) == [], "config must not write anything"


def test_explicit_controller_ports_and_kafka_nodes_from_the_environment(tmp_path: Path) -> None:
    done = _script(tmp_path, "config", KAFKA_NODES="2", KAFKA_PORT="42010", KAFKA_CONTROLLER_PORT="42100")
    assert done.returncode == 0, done.stderr
    nodes = _per_node(done.stdout)
    assert nodes[2]["listeners"] == "PLAINTEXT://127.0.0.1:42011,CONTROLLER://127.0.0.1:42101"
    assert nodes[1]["controller.quorum.voters"] == "1@127.0.0.1:42100,2@127.0.0.1:42101"
    # Two nodes: two copies, and a write needs only one of them in sync (else losing one stops writes).
    assert nodes[1]["default.replication.factor"] == "2"
    assert nodes[1]["min.insync.replicas"] == "1"


def test_one_node_of_the_cluster(tmp_path: Path) -> None:
    done = _script(tmp_path, "config", "--nodes", "3", "--node", "2", KAFKA_PORT="41000")
    assert done.returncode == 0, done.stderr
    assert list(_per_node(done.stdout)) == [2]


def test_single_node_config_is_the_template_as_before(tmp_path: Path) -> None:
    done = _script(tmp_path, "config", KAFKA_PORT="43000", KAFKA_CONTROLLER_PORT="43001")
    assert done.returncode == 0, done.stderr
    template = (SCRIPT.parent / "server.properties").read_text(encoding="utf-8")
    expected = (template.replace("@HOST@", "127.0.0.1").replace("@PORT@", "43000")
                .replace("@CONTROLLER_PORT@", "43001").replace("@EXTRA_LISTENERS@", "")
                .replace("@LOG_DIR@", str(tmp_path / "data")))
    assert done.stdout == expected
    props = _props(done.stdout)
    assert props["node.id"] == "1" and props["default.replication.factor"] == "1"
    assert "controller.quorum.voters" not in props


@pytest.mark.parametrize(
    ("args", "extra", "message"),
    [
        (("--nodes", "3"), {"KAFKA_PORT": "41000", "KAFKA_CONTROLLER_PORT": "41002"}, "overlap"),
        (("--nodes", "3", "--node", "4"), {}, "--node must be one of 1..3, got '4'"),
        (("--nodes", "0"), {}, "the number of nodes must be 1..9, got '0'"),
        (("--nodes", "x"), {}, "the number of nodes must be 1..9, got 'x'"),
        (("--node", "2"), {}, "--node needs a cluster"),
        (("--nodes", "3"), {"KAFKA_PORT": "65534"}, "must be a TCP port"),
        (("--bogus",), {}, "unknown option '--bogus'"),
    ],
)
def test_bad_cluster_arguments_are_named(tmp_path: Path, args: tuple[str, ...], extra: dict[str, str],
                                        message: str) -> None:
    done = _script(tmp_path, "config", *args, **extra)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def _write_cluster_state(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "cluster.state").write_text(
        "nodes=3\nhost=127.0.0.1\nport=44000\ncontroller_port=44100\n"
        "voters=1@127.0.0.1:44100,2@127.0.0.1:44101,3@127.0.0.1:44102\ncluster_id=AAAAAAAAAAAAAAAAAAAAAA\n"
    )


def test_a_run_dir_remembers_its_cluster(tmp_path: Path) -> None:
    """Later commands on the run dir need no --nodes, and take the cluster's ports."""
    _write_cluster_state(tmp_path)
    done = _script(tmp_path, "config")
    assert done.returncode == 0, done.stderr
    nodes = _per_node(done.stdout)
    assert sorted(nodes) == [1, 2, 3]
    assert nodes[3]["listeners"] == "PLAINTEXT://127.0.0.1:44002,CONTROLLER://127.0.0.1:44102"

    status = _script(tmp_path, "status")
    assert status.returncode == 1  # nothing runs
    assert status.stdout.splitlines() == [
        "node=1 stopped port=44000 controller_port=44100",
        "node=2 stopped port=44001 controller_port=44101",
        "node=3 stopped port=44002 controller_port=44102",
        "cluster nodes=3 running=0 bootstrap=127.0.0.1:44000,127.0.0.1:44001,127.0.0.1:44002 "
        "voters=1@127.0.0.1:44100,2@127.0.0.1:44101,3@127.0.0.1:44102",
    ]
    parsed = broker._parse_status(status.stdout)
    assert not parsed.running
    assert [(n.node_id, n.port, n.controller_port, n.running) for n in parsed.nodes] == [
        (1, 44000, 44100, False), (2, 44001, 44101, False), (3, 44002, 44102, False)]

    single = _script(tmp_path, "status", KAFKA_NODES="1")
    assert single.returncode != 0
    assert "holds a 3-node cluster" in single.stderr


def test_stopping_a_cluster_that_does_not_run(tmp_path: Path) -> None:
    _write_cluster_state(tmp_path)
    done = _script(tmp_path, "stop", "--node", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "node=2 stopped (was not running)"


def test_status_lines_of_a_running_cluster_parse() -> None:
    output = (
        "node=1 running pid=101 bootstrap=127.0.0.1:35000 port=35000 controller_port=35003 version=4.4.0\n"
        "node=2 stopped port=35001 controller_port=35004\n"
        "node=3 running pid=103 bootstrap=127.0.0.1:35002 port=35002 controller_port=35005 version=4.4.0\n"
        "cluster nodes=3 running=2 bootstrap=127.0.0.1:35000,127.0.0.1:35001,127.0.0.1:35002 voters=1@x:1\n"
    )
    status = broker._parse_status(output)
    assert status.running and status.version == "4.4.0"
    assert status.bootstrap == "127.0.0.1:35000,127.0.0.1:35001,127.0.0.1:35002"
    assert [n.node_id for n in status.running_nodes] == [1, 3]
    assert status.node(3).pid == 103 and status.node(2).pid is None
    with pytest.raises(broker.BrokerError, match="no node 4"):
        status.node(4)


def test_quorum_line_parses_and_garbage_is_an_error() -> None:
    quorum = broker._parse_quorum("some tool noise\nquorum leader=2 epoch=7 voters=1,2,3\n")
    assert (quorum.leader, quorum.epoch, quorum.voters) == (2, 7, (1, 2, 3))
    with pytest.raises(broker.BrokerError, match="unexpected output"):
        broker._parse_quorum("LeaderId: 2\n")


def test_replication_follows_the_broker_count() -> None:
    assert [replication_for(n) for n in (0, 1, 2, 3, 5)] == [1, 1, 2, 3, 3]


def test_replication_factor_is_an_override_only_when_configured(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRAFTSTREAM_KAFKA__REPLICATION_FACTOR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_settings(None).kafka.explicit_replication_factor is None
    config = tmp_path / "one.toml"
    config.write_text("[kafka]\nreplication_factor = 1\n")
    assert load_settings(config).kafka.explicit_replication_factor == 1
    monkeypatch.setenv("DRAFTSTREAM_KAFKA__REPLICATION_FACTOR", "2")
    assert load_settings(None).kafka.explicit_replication_factor == 2


def test_layout_counts_leaders_per_broker_and_under_replicated_partitions() -> None:
    parts = (
        PartitionState("responses", 0, 1, (1, 2, 3), (1, 2, 3)),
        PartitionState("responses", 1, 1, (2, 1, 3), (1, 3)),
        PartitionState("accepted", 0, 3, (3, 1, 2), (3, 1, 2)),
        PartitionState("accepted", 1, -1, (2, 3, 1), (2,)),
    )
    layout = ClusterLayout(brokers=(1, 2, 3), partitions=parts)
    assert layout.leaders_per_broker() == {1: 2, 2: 0, 3: 1, -1: 1}
    assert layout.leaders_per_broker(["accepted"]) == {1: 0, 2: 0, 3: 1, -1: 1}
    assert [(p.topic, p.partition) for p in layout.under_replicated] == [("responses", 1), ("accepted", 1)]
