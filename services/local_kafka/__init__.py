"""The local Kafka launcher: one node, or a local cluster of them (KRaft: broker and controller
in one JVM each), without Docker.

For one node (what ``deploy/kafka/kafka.sh`` calls): resolve the jars with
Maven once, render ``server.properties`` from ``deploy/kafka/server.properties`` (with the
SASL_SSL listener and the ACL settings when asked), make the local CA, decide whether the
storage must be (re-)formatted, start ``kafka.Kafka`` in the background, wait until a
Metadata request lists it, and stop it. The decisions are pure functions (``render_config``,
``new_cluster_id``, ``format_decision``, ``metadata_request``/``metadata_ready``) with unit
tests (``props``, ``readiness``); ``node.Node`` does the I/O, ``jvm`` and ``files`` what every node
shares, ``cluster`` builds the local cluster and the command line from these parts, and
``services.common.broker`` calls its commands in-process (``run``).

Only the standard library is used, so that ``kafka.sh`` runs with any Python 3.11 (no
virtualenv, no pydantic): that is why this module reads its environment itself, once, in
``Options.from_env``, instead of through ``services.common.config``.
"""

from services.local_kafka.cluster import COMMANDS, main, run
from services.local_kafka.options import KafkaScriptError

__all__ = ["COMMANDS", "KafkaScriptError", "main", "run"]
