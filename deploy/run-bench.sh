#!/usr/bin/env bash
# `make bench` / `make bench-quick` / `make bench-scale`: the benchmarks (arguments go to `python -m bench.run`)
# against a real Kafka broker, started and stopped here unless KAFKA_BOOTSTRAP_SERVERS
# names one (deploy/own-broker.sh, the same as `make test`).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
# shellcheck source=deploy/own-broker.sh
source deploy/own-broker.sh
own_broker_start || exit 1
echo "== benchmarks against ${KAFKA_BOOTSTRAP_SERVERS}"
# BENCH_ENTRY: another entry point (make bench-scale: bench.bench_scale, which bench.run leaves out).
python -m "${BENCH_ENTRY:-bench.run}" "$@"
