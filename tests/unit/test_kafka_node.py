"""services.local_kafka (what deploy/kafka/kafka.sh runs): config rendering,
cluster ids, formatting decisions and readiness, without a JVM or a broker.

Outside truth: the server.properties template, Kafka's own wire format as aiokafka encodes it,
and base64 as the standard library decodes it."""

from __future__ import annotations

import base64
import hashlib
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from aiokafka.protocol.api import RequestHeader_v1
from aiokafka.protocol.metadata import MetadataRequest_v1, MetadataResponse_v1

from services.local_kafka import cluster as kc
from services.local_kafka import jvm as kjvm
from services.local_kafka import options as kopts
from services.local_kafka import props as kprops
from services.local_kafka import readiness as kready

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"
TEMPLATE = (kopts.DEPLOY_DIR / "server.properties").read_text(encoding="utf-8")


def _opts(tmp_path: Path, **env: str) -> kopts.Options:
    return kopts.Options.from_env({"KAFKA_RUN_DIR": str(tmp_path), **env})


def _props_last_wins(text: str) -> dict[str, str]:
    """Properties as java.util.Properties reads them: the last line of a key wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


# --- config rendering -------------------------------------------------------------------


def test_sasl_ssl_listener_users_and_keystore(tmp_path: Path) -> None:
    opts = _opts(tmp_path, KAFKA_SASL_SSL_PORT="29194", KAFKA_SASL_USERS="alice:a-1 bob:b.2")
    text = kprops.render_config(TEMPLATE, opts, port=29192, controller_port=29193, data_dir=tmp_path / "data",
                            storepass="sp")
    props = _props_last_wins(text)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29192,CONTROLLER://127.0.0.1:29193,SASL_SSL://127.0.0.1:29194"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29192,SASL_SSL://127.0.0.1:29194"
    jaas = props["listener.name.sasl_ssl.plain.sasl.jaas.config"]
    assert jaas == ("org.apache.kafka.common.security.plain.PlainLoginModule required "
                    'user_draftstream="draftstream-secret" user_alice="a-1" user_bob="b.2";')
    assert props["listener.name.sasl_ssl.ssl.keystore.location"] == str(tmp_path / "tls" / "broker.p12")
    assert props["listener.name.sasl_ssl.ssl.keystore.password"] == "sp"
    assert props["sasl.enabled.mechanisms"] == "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"
    assert "authorizer.class.name" not in props
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # the template's, untouched


def test_authorizer_overrides_the_template_and_logs_the_broker_in(tmp_path: Path) -> None:
    opts = _opts(tmp_path, KAFKA_SASL_SSL_PORT="29194", KAFKA_AUTHORIZER="on", KAFKA_SASL_USER="admin",
                 KAFKA_SASL_PASSWORD="pw")
    props = _props_last_wins(kprops.render_config(TEMPLATE, opts, port=1, controller_port=2, data_dir=tmp_path,
                                              storepass="sp"))
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["super.users"] == "User:admin"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["listener.security.protocol.map"] == "PLAINTEXT:PLAINTEXT,CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert props["listener.name.sasl_ssl.plain.sasl.jaas.config"].startswith(
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="pw" '
        'user_admin="pw"')
    assert props["listener.name.sasl_ssl.ssl.truststore.password"] == "sp"


def test_kafka_sh_config_renders_sasl_through_the_entry_point(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KAFKA_RUN_DIR": str(tmp_path), "KAFKA_PORT": "29192",
           "KAFKA_CONTROLLER_PORT": "29193", "KAFKA_SASL_SSL_PORT": "29194"}
    done = subprocess.run(["bash", str(SCRIPT), "config"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    listeners = "PLAINTEXT://127.0.0.1:29192,CONTROLLER://127.0.0.1:29193,SASL_SSL://127.0.0.1:29194"
    assert f"\nlisteners={listeners}\n" in done.stdout
    assert list(tmp_path.iterdir()) == [], "config must not write anything"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KAFKA_AUTHORIZER": "yes"}, "KAFKA_AUTHORIZER must be on or off, got 'yes'"),
        ({"KAFKA_AUTHORIZER": "on"}, "KAFKA_AUTHORIZER=on needs KAFKA_SASL_SSL_PORT"),
        ({"KAFKA_SASL_SSL_PORT": "1", "KAFKA_SASL_USER": "a b"}, "KAFKA_SASL_USER may only use"),
        ({"KAFKA_SASL_SSL_PORT": "1", "KAFKA_SASL_PASSWORD": 'p"w'}, "KAFKA_SASL_PASSWORD may only use"),
        ({"KAFKA_SASL_USERS": "carol"}, "'carol' is not name:password"),
        ({"KAFKA_SASL_USERS": 'alice:ok dave:p"w'}, "'dave' is not name:password"),
    ],
)
def test_values_that_would_break_jaas_or_scram_are_refused(tmp_path: Path, env: dict[str, str],
                                                         message: str) -> None:
    with pytest.raises(kopts.KafkaScriptError, match=message):
        _opts(tmp_path, **env).check_sasl()


def test_edit_props_replaces_removes_appends_and_keeps_comments() -> None:
    text = "# a=comment\na=1\nb=2\nc=3\n"
    out = kc.edit_props(text, ["a=9", "-b", "d=4"], header="# head")
    assert out == "# head\n# a=comment\na=9\nc=3\n\n# --- cluster (added by kafka.sh for a local cluster) ---\nd=4\n"


def test_cluster_shape_from_state_and_from_the_environment(tmp_path: Path) -> None:
    state = {"nodes": "3", "host": "127.0.0.1", "port": "29200", "controller_port": "29210"}
    opts = _opts(tmp_path, KAFKA_PORT="29250")
    # start --node I and status: the cluster's own ports, whatever KAFKA_PORT says
    assert kc.resolve_shape(3, opts, state, from_env=False) == kc.ClusterShape(3, "127.0.0.1", 29200, 29210)
    # a whole-cluster start: KAFKA_PORT, and controller ports right after the client ports
    assert kc.resolve_shape(3, opts, state, from_env=True) == kc.ClusterShape(3, "127.0.0.1", 29250, 29253)
    shape = kc.resolve_shape(3, _opts(tmp_path), state, from_env=True)
    assert shape.voters == "1@127.0.0.1:29210,2@127.0.0.1:29211,3@127.0.0.1:29212"
    assert shape.bootstrap == "127.0.0.1:29200,127.0.0.1:29201,127.0.0.1:29202"


def test_two_nodes_keep_one_copy_in_sync() -> None:
    props = dict(p.split("=", 1) for p in kc.cluster_props(2, kc.ClusterShape(2, "h", 1, 10)) if "=" in p)
    assert props["node.id"] == "2" and props["default.replication.factor"] == "2"
    assert props["min.insync.replicas"] == "1"


# --- cluster ids ------------------------------------------------------------------------


def test_an_id_starting_with_a_dash_is_drawn_again() -> None:
    dash = bytes([0xF8]) + bytes(15)  # 111110 00...: base64url '-' first
    plain = bytes(range(16))
    assert base64.urlsafe_b64encode(dash).startswith(b"-")
    cluster_id = kprops.new_cluster_id(iter([dash, dash, plain]))
    assert base64.urlsafe_b64decode(cluster_id + "==") == plain
    assert len(cluster_id) == 22


def test_format_passes_the_id_as_one_argument_and_the_quorum_option(tmp_path: Path) -> None:
    opts = _opts(tmp_path)
    single = kprops.format_args(opts, tmp_path / "p", "-dashed", static_quorum=False)
    assert single == ["kafka.tools.StorageTool", "format", "--cluster-id=-dashed", "--config", str(tmp_path / "p"),
                      "--standalone"]
    assert "--standalone" not in kprops.format_args(opts, tmp_path / "p", "x", static_quorum=True)
    sasl = kprops.format_args(_opts(tmp_path, KAFKA_SASL_SSL_PORT="1", KAFKA_SASL_USERS="alice:a"), tmp_path / "p", "x",
                          static_quorum=False)
    scram = [sasl[i + 1] for i, arg in enumerate(sasl) if arg == "--add-scram"]
    assert scram == ["SCRAM-SHA-256=[name=draftstream,password=draftstream-secret]",
                     "SCRAM-SHA-512=[name=draftstream,password=draftstream-secret]",
                     "SCRAM-SHA-256=[name=alice,password=a]", "SCRAM-SHA-512=[name=alice,password=a]"]


# --- formatting decisions ---------------------------------------------------------------

STAMP = kprops.FormatStamp(controller="127.0.0.1:29193", scram="s1", cluster_id="C1")


@pytest.mark.parametrize(
    ("have", "exists", "want", "expected"),
    [
        (None, False, {}, ""),  # fresh: format, nothing to say
        (None, True, {}, "no complete format stamp"),
        (STAMP, True, {}, None),  # same controller, no SASL wanted, no cluster id asked: keep
        (STAMP, True, {"scram": "s1", "cluster_id": "C1"}, None),
        (STAMP, True, {"controller": "127.0.0.1:29999"},
         "formatted for controller 127.0.0.1:29193, not 127.0.0.1:29999"),
        (STAMP, True, {"scram": "s2"}, "lacks the SCRAM credentials"),
        (STAMP, True, {"cluster_id": "C2"}, "belongs to another cluster"),
    ],
)
def test_format_decision(have: kprops.FormatStamp | None, exists: bool, want: dict[str, str],
                         expected: str | None) -> None:
    args = {"controller": "127.0.0.1:29193", "scram": "", "cluster_id": "", **want}
    reason = kprops.format_decision(have, exists, **args)
    if expected is None or expected == "":
        assert reason == expected
    else:
        assert reason is not None and expected in reason


def test_format_stamp_round_trips_and_scram_digest_hides_the_password(tmp_path: Path) -> None:
    assert kprops.FormatStamp.loads(STAMP.dumps()) == STAMP
    assert kprops.scram_digest(_opts(tmp_path)) == ""
    digest = kprops.scram_digest(_opts(tmp_path, KAFKA_SASL_SSL_PORT="1", KAFKA_SASL_PASSWORD="hunter2"))
    assert len(digest) == 64 and "hunter2" not in digest
    assert digest != kprops.scram_digest(_opts(tmp_path, KAFKA_SASL_SSL_PORT="1", KAFKA_SASL_PASSWORD="hunter3"))


def test_cds_archive_of_a_recording() -> None:
    assert kprops.cds_archive_of("/l/.cds/kafka-21.0.2_13.jsa.4242.partial") == "/l/.cds/kafka-21.0.2_13.jsa"
    assert kprops.cds_archive_of("/l/.cds/kafka-21.0.2_13.jsa.4242.node2.partial") == "/l/.cds/kafka-21.0.2_13.jsa"


# --- readiness --------------------------------------------------------------------------


def _framed(response: MetadataResponse_v1, correlation_id: int = 1) -> bytes:
    body = correlation_id.to_bytes(4, "big") + response.encode()
    return len(body).to_bytes(4, "big") + body


def test_metadata_request_is_what_kafka_reads() -> None:
    frame = kready.metadata_request()
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    request = MetadataRequest_v1(topics=[])  # an empty list: no topics, just brokers and controller
    header = RequestHeader_v1(request, correlation_id=1, client_id="draftstream-kafka-sh")
    assert frame[4:] == header.encode() + request.encode()


@pytest.mark.parametrize(
    ("brokers", "controller", "ready"),
    [
        ([(1, "127.0.0.1", 29192, None)], 1, True),
        ([(2, "127.0.0.1", 29193, "rack-a"), (1, "127.0.0.1", 29192, None)], 2, True),
        ([(1, "127.0.0.1", 29192, None)], -1, False),  # no controller yet
        ([(2, "127.0.0.1", 29193, None)], 2, False),  # metadata without this broker
        ([], -1, False),
    ],
)
def test_metadata_ready(brokers: list[tuple[int, str, int, str | None]], controller: int, ready: bool) -> None:
    response = MetadataResponse_v1(brokers=brokers, controller_id=controller, topics=[])
    assert kready.metadata_ready(_framed(response), 29192) is ready


def test_a_truncated_answer_is_an_error() -> None:
    frame = _framed(MetadataResponse_v1(brokers=[(1, "127.0.0.1", 29192, None)], controller_id=1, topics=[]))
    with pytest.raises(Exception, match="unpack"):
        kready.metadata_ready(frame[:14], 29192)


class _FakeMetadataServer:
    """A TCP server on a free port that answers each request with a Metadata v1 frame aiokafka built."""

    def __init__(self, *, controller: int = 1, listed: bool = True, answer: bool = True) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        brokers = [(1, "127.0.0.1", self.port if listed else self.port + 1, None)]
        self.frame = _framed(MetadataResponse_v1(brokers=brokers, controller_id=controller, topics=[]))
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.answer and conn.recv(65536):
                    conn.sendall(self.frame[:10])  # in two pieces: the probe reads until the frame is whole
                    conn.sendall(self.frame[10:])


@pytest.mark.parametrize(
    ("kwargs", "ready"),
    [({}, True), ({"controller": -1}, False), ({"listed": False}, False), ({"answer": False}, False)],
)
def test_probe_ready_over_a_real_socket(kwargs: dict[str, object], ready: bool) -> None:
    server = _FakeMetadataServer(**kwargs)  # type: ignore[arg-type]
    try:
        assert kready.port_open("127.0.0.1", server.port)
        assert kready.probe_ready("127.0.0.1", server.port) is ready
    finally:
        server.sock.close()


def test_nothing_listening_is_not_ready() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    assert not kready.port_open("127.0.0.1", port)
    assert not kready.probe_ready("127.0.0.1", port)


# --- jars and the class-data archive ----------------------------------------------------


def test_libs_are_ready_when_filled_from_this_pom_or_by_hand(tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    jvm = kjvm.Jvm(_opts(tmp_path, DRAFTSTREAM_HOME=str(tmp_path)))
    assert jvm.opts.libs_dir == tmp_path / ".run" / "kafka" / "libs"
    assert not jvm.libs_ready()  # nothing fetched there yet
    ours = kjvm.Jvm(_opts(tmp_path, KAFKA_LIBS_DIR=str(libs)))
    (libs / "kafka_2.13-4.4.0.jar").write_bytes(b"")
    assert ours.libs_ready()  # filled by hand: no marker of ours
    pom_sha = hashlib.sha256((kopts.DEPLOY_DIR / "pom.xml").read_bytes()).hexdigest()
    (libs / kopts.LIBS_MARKER).write_text("0" * 64 + "\n")
    assert not ours.libs_ready()  # fetched for another pom: fetch again
    (libs / kopts.LIBS_MARKER).write_text(pom_sha + "\n")
    assert ours.libs_ready()


def test_cds_uses_the_archive_records_it_or_stays_off(tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    jvm = kjvm.Jvm(_opts(tmp_path, KAFKA_LIBS_DIR=str(libs)))
    jvm.vm_id = "17.0.15_6"
    flags, partial = jvm.cds_opts(".node2")
    assert partial.startswith(f"{libs}/.cds/kafka-17.0.15_6.jsa.") and partial.endswith(".node2.partial")
    assert flags[0] == f"-XX:ArchiveClassesAtExit={partial}"
    assert kprops.cds_archive_of(partial) == str(jvm.cds_archive)
    jvm.cds_archive.write_bytes(b"archive")
    assert jvm.cds_opts("") == ([f"-XX:SharedArchiveFile={jvm.cds_archive}", "-Xlog:cds=off",
                                 "-Xlog:cds+dynamic=off"], "")
    jvm.cds_archive.unlink()
    assert kjvm.Jvm(_opts(tmp_path, KAFKA_LIBS_DIR=str(libs), KAFKA_CDS="reuse")).cds_opts("") == ([], "")
    off = kjvm.Jvm(_opts(tmp_path, KAFKA_LIBS_DIR=str(libs), KAFKA_CDS="off"))
    off.vm_id = "17.0.15_6"
    assert off.cds_opts("") == ([], "")
