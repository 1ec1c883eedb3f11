#!/usr/bin/env bash
# `make test`: start a real Kafka broker (unless KAFKA_BOOTSTRAP_SERVERS names one), run
# every test tier and the quick benchmarks against it, stop what was started, say how long.
set -uo pipefail
cd "$(dirname "$0")/.."
started_at=$(date +%s)
export PATH="$PWD/.venv/bin:$PATH"
export CI="${CI:-false}"

# shellcheck source=deploy/own-broker.sh
source deploy/own-broker.sh
own_broker_start || exit 1

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
