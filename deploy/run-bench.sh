#!/usr/bin/env bash
# `make bench` / `make bench-quick`: the benchmarks (arguments go to `python -m bench.run`)
# against a real Kafka broker, started and stopped here unless KAFKA_BOOTSTRAP_SERVERS
# names one (deploy/own-broker.sh, the same as `make test`).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
# shellcheck source=deploy/own-broker.sh
source deploy/own-broker.sh
own_broker_start || exit 1
echo "== benchmarks against ${KAFKA_BOOTSTRAP_SERVERS}"
python -m bench.run "$@"
