#!/usr/bin/env bash
# `make test`: start a real Kafka broker (unless KAFKA_BOOTSTRAP_SERVERS names one), run
# every test tier and the quick benchmarks against it, stop what was started, say how long.
set -uo pipefail
cd "$(dirname "$0")/.."
started_at=$(date +%s)
export PATH="$PWD/.venv/bin:$PATH"
export CI="${CI:-false}"

own_broker=0
if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  export KAFKA_PORT="${KAFKA_PORT:-19092}"
  export KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-19093}"
  bash deploy/kafka/kafka.sh start || { echo "could not start the local Kafka broker"; exit 1; }
  own_broker=1
  export KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:${KAFKA_PORT}"
fi
cleanup() { [ "$own_broker" = 1 ] && bash deploy/kafka/kafka.sh stop >/dev/null 2>&1; }
trap cleanup EXIT

status=0
echo "== pytest (unit, integration, e2e) against ${KAFKA_BOOTSTRAP_SERVERS}"
python -m pytest -q -p no:cacheprovider || status=$?

if [ -d bench ] && [ -f bench/run.py ]; then
  echo "== quick benchmarks"
  python -m bench.run --quick || status=$((status ? status : 1))
fi

elapsed=$(( $(date +%s) - started_at ))
printf 'make test took %dm%02ds (status %d)\n' $((elapsed / 60)) $((elapsed % 60)) "$status"
exit "$status"
