#!/usr/bin/env bash
# `make test` / `make test-fast`: start a real Kafka broker (unless KAFKA_BOOTSTRAP_SERVERS names
# one), run the test tiers against it, stop what was started, say how long each piece took.
#
#   deploy/run-tests.sh          every tier: unit (in parallel, pytest-xdist), then integration,
#                                e2e and conformance in one pytest run on the one broker
#   deploy/run-tests.sh --fast   unit (in parallel) and integration: the inner loop
#
# The benchmarks are not part of this (make bench-quick; .ci/run runs it as its own step).
# PYTEST_WORKERS sets the unit tier's -n (default auto: one per core).
set -uo pipefail
cd "$(dirname "$0")/.."
started_at=$(date +%s)
export PATH="$PWD/.venv/bin:$PATH"
export CI="${CI:-false}"

tiers=(tests/integration tests/e2e tests/conformance)
label="make test"
if [ "${1:-}" = "--fast" ]; then
  tiers=(tests/integration)
  label="make test-fast"
fi

# shellcheck source=deploy/own-broker.sh
source deploy/own-broker.sh
own_broker_start || exit 1

status=0
timings=()
run_piece() {  # run_piece NAME COMMAND...: run it, keep the worst status, note how long it took
  local name=$1 piece_start piece_status=0
  shift
  piece_start=$(date +%s)
  echo "== ${name}"
  "$@" || piece_status=$?
  [ "$status" = 0 ] && status=$piece_status
  timings+=("$(printf '%-40s %dm%02ds (status %d)' "$name" $(( ($(date +%s) - piece_start) / 60 )) \
    $(( ($(date +%s) - piece_start) % 60 )) "$piece_status")")
}

run_piece "unit and fuzz regressions (pytest -n ${PYTEST_WORKERS:-auto})" \
  python -m pytest tests/unit tests/fuzz -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}"
run_piece "${tiers[*]} against ${KAFKA_BOOTSTRAP_SERVERS}" \
  python -m pytest "${tiers[@]}" -q -p no:cacheprovider

elapsed=$(( $(date +%s) - started_at ))
printf '%s\n' "${timings[@]}"
printf '%s took %dm%02ds (status %d)\n' "$label" $((elapsed / 60)) $((elapsed % 60)) "$status"
exit "$status"
