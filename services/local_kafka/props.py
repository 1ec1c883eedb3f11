"""The pure parts of one node's set-up: its server.properties, the cluster id, the SCRAM digest,
whether the storage must be (re-)formatted and the format tool's arguments, the state files."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.local_kafka.options import (
    Options,
)


def render_config(template: str, opts: Options, *, port: int, controller_port: int, data_dir: Path,
                  storepass: str = "") -> str:
    """The server.properties of one node: the template's placeholders, plus SASL_SSL and ACLs when asked."""
    extra = f",SASL_SSL://{opts.host}:{opts.sasl_ssl_port}" if opts.sasl_ssl_port else ""
    text = (template.replace("@HOST@", opts.host).replace("@PORT@", str(port))
            .replace("@CONTROLLER_PORT@", str(controller_port)).replace("@EXTRA_LISTENERS@", extra)
            .replace("@LOG_DIR@", str(data_dir)))
    authorizer = opts.authorizer == "on"
    if opts.sasl_ssl_port:
        self_login = f' username="{opts.sasl_user}" password="{opts.sasl_password}"' if authorizer else ""
        plain_users = "".join(f' user_{name}="{password}"' for name, password in opts.extra_users)
        tls = opts.tls_dir
        text += f"""
# --- SASL_SSL listener (added by kafka.sh because KAFKA_SASL_SSL_PORT is set) ---------
listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
# PLAIN users live in this JAAS config; SCRAM credentials were written into the cluster
# metadata at format time (kafka-storage format --add-scram).
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
required{self_login} user_{opts.sasl_user}="{opts.sasl_password}"{plain_users};
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location={tls}/broker.p12
listener.name.sasl_ssl.ssl.keystore.password={storepass}
listener.name.sasl_ssl.ssl.key.password={storepass}
"""
    if authorizer:
        user, password, tls = opts.sasl_user, opts.sasl_password, opts.tls_dir
        # Appended: its keys override the template's (the last one wins).
        text += f"""
# --- ACLs (added by kafka.sh because KAFKA_AUTHORIZER=on) ------------------------------
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:{user}
allow.everyone.if.no.acl.found=false
# The broker talks to its controller and to itself as User:{user} over SASL (PLAIN),
# so the PLAINTEXT listener's clients are User:ANONYMOUS, with no ACL: refused.
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.mechanism.inter.broker.protocol=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
required username="{user}" password="{password}" user_{user}="{password}";
listener.name.sasl_ssl.ssl.truststore.type=PKCS12
listener.name.sasl_ssl.ssl.truststore.location={tls}/broker.p12
listener.name.sasl_ssl.ssl.truststore.password={storepass}
"""
    return text


def new_cluster_id(random_bytes: Iterator[bytes] | None = None) -> str:
    """A random 16-byte UUID in URL-safe base64 without padding (22 chars), as ``kafka-storage random-uuid``.

    Like Kafka's ``Uuid.randomUuid()``, draw again while it starts with "-": kafka-storage
    would read such an id as an option (1 in 64 draws); ``--cluster-id=ID`` is a second guard.
    """
    while True:
        raw = next(random_bytes) if random_bytes is not None else os.urandom(16)
        cluster_id = base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def scram_digest(opts: Options) -> str:
    """What the SCRAM credentials of a format were (a digest, never the passwords); "" without SASL."""
    if not opts.sasl_ssl_port:
        return ""
    text = f"{opts.sasl_user}\n{opts.sasl_password}\n{' '.join(opts.sasl_users)}\n"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class FormatStamp:
    """What a node's storage was formatted for (``data/.draftstream-format``)."""

    controller: str
    scram: str
    cluster_id: str

    def dumps(self) -> str:
        """The stamp file's text."""
        return f"controller={self.controller}\nscram={self.scram}\ncluster_id={self.cluster_id}\n"

    @classmethod
    def loads(cls, text: str) -> FormatStamp:
        """Parse a stamp file (missing keys are empty)."""
        values = parse_state(text)
        return cls(values.get("controller", ""), values.get("scram", ""), values.get("cluster_id", ""))


def format_decision(have: FormatStamp | None, data_exists: bool, *, controller: str, scram: str,
                    cluster_id: str) -> str | None:
    """None when the storage may be kept, else why it must be (re-)formatted ("" for a fresh one).

    Storage is formatted when it is not formatted yet, or was formatted for another controller
    endpoint (the quorum remembers its voter's endpoint), other SCRAM credentials (``scram``
    not empty), or another cluster (``cluster_id`` not empty); then the old data goes.
    """
    if have is None:
        return "" if not data_exists else "no complete format stamp"
    if (have.controller == controller and (not scram or have.scram == scram)
            and (not cluster_id or have.cluster_id == cluster_id)):
        return None
    if have.controller != controller:
        return f"storage was formatted for controller {have.controller}, not {controller}"
    if scram and have.scram != scram:
        return "storage lacks the SCRAM credentials of the SASL user"
    return "storage belongs to another cluster"


def cds_archive_of(partial: str) -> str:
    """The archive a recording run writes: ``x.jsa.PID[.nodeI].partial`` -> ``x.jsa``."""
    head, sep, _ = partial.rpartition(".jsa.")
    return head + ".jsa" if sep else partial


def format_args(opts: Options, props: Path, cluster_id: str, *, static_quorum: bool) -> list[str]:
    """The kafka-storage format command line (main class first) for one node's storage.

    ``--cluster-id=ID`` keeps even an id starting with "-" one argument. Static voters
    (controller.quorum.voters) need no quorum option; one node formats a dynamic quorum of
    itself (``--standalone``). With SASL_SSL, every user's SCRAM credentials are written.
    """
    args = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "--config", str(props)]
    if not static_quorum:
        args.append("--standalone")
    if opts.sasl_ssl_port:
        for name, password in [(opts.sasl_user, opts.sasl_password), *opts.extra_users]:
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                args += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
    return args


def parse_state(text: str) -> dict[str, str]:
    """key=value lines (cluster.state, kafka.state, the format stamp)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key not in out:
            out[key] = value
    return out
