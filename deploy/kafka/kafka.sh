#!/usr/bin/env bash
# A real Apache Kafka broker, or a local cluster of them (KRaft), without Docker.
# The work is done in Python (the package services/local_kafka, standard
# library only); this entry point stays for the Makefile, deploy/own-broker.sh, CI and the
# tests. Same arguments, environment variables, output and exit codes:
#
#   deploy/kafka/kafka.sh fetch|start|stop|status|restart|config|quorum|cluster-id [--nodes N] [--node I]
#   deploy/kafka/kafka.sh help      every command and environment variable
#
# The repository's .venv interpreter when there is one, else python3 (3.11+); KAFKA_PYTHON overrides.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${KAFKA_PYTHON:-}
[[ -n $PYTHON ]] || { [[ -x $REPO_ROOT/.venv/bin/python ]] && PYTHON=$REPO_ROOT/.venv/bin/python; } || PYTHON=python3
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m services.local_kafka "$@"
