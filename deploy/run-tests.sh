#!/usr/bin/env bash
# `make test` / `make test-fast`: start a real Kafka broker (unless KAFKA_BOOTSTRAP_SERVERS names
# one), run the test tiers against it, stop what was started, say how long each piece took.
#
#   deploy/run-tests.sh          every tier: unit, integration, e2e and conformance, in parallel
#                                (pytest-xdist) on the one broker; beside them, the tests marked
#                                `serial` one at a time, at a higher CPU priority
#   deploy/run-tests.sh --fast   unit and integration the same way: the inner loop
#
# A test marked `serial` checks timing that a busy CPU beside it would spoil (a halt within a
# second, a pace against a small burst); the parallel piece runs at idle CPU priority
# (SCHED_IDLE, chrt --idle 0), so the kernel gives the serial test the CPU whenever it wants
# it, and the rest of the time the parallel piece has it all.
# The benchmarks are not part of this (make bench-quick; .ci/run runs it as its own step).
# PYTEST_WORKERS sets -n for the parallel piece (default 4, 6 with --fast: most of a broker
# test's time is waiting on the broker and on the other processes it starts, so more workers
# than cores pay).
set -uo pipefail
cd "$(dirname "$0")/.."
started_at=$(date +%s)
export PATH="$PWD/.venv/bin:$PATH"
# Bytecode caches (__pycache__, ignored by git) even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE): without them each of the run's processes (workers, the services
# and CLIs the tests start) compiles every module it imports, and pytest rewrites every test
# module again. Compiled once here, before the workers start side by side.
unset PYTHONDONTWRITEBYTECODE
python -m compileall -q -j 0 services schemas tests >/dev/null || echo "compileall failed: the run compiles as it goes"
export CI="${CI:-false}"

tiers=(tests/unit tests/fuzz tests/integration tests/e2e tests/conformance)
label="make test"
default_workers=4
if [ "${1:-}" = "--fast" ]; then
  tiers=(tests/unit tests/fuzz tests/integration)
  label="make test-fast"
  # Two minutes of tests: the broker's JIT compiling to C2 costs more CPU than it saves in
  # so short a run, and these tiers wait on the broker and the processes they start more
  # than the e2e tier does, so 6 workers (docs/testing.md has the runs).
  export KAFKA_JVM_OPTS="${KAFKA_JVM_OPTS:--XX:TieredStopAtLevel=1}"
  default_workers=6
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
  [ "$piece_status" = 5 ] && piece_status=0  # pytest: no test selected (no test is marked serial)
  [ "$status" = 0 ] && status=$piece_status
  timings+=("$(printf '%-40s %dm%02ds (status %d)' "$name" $(( ($(date +%s) - piece_start) / 60 )) \
    $(( ($(date +%s) - piece_start) % 60 )) "$piece_status")")
}

# pyproject's addopts deselect chaos and fuzz with -m; a second -m replaces it, so both pieces repeat that.
workers=${PYTEST_WORKERS:-$default_workers}
serial_out=$(mktemp -d)
# In a subshell of its own: it hands its status and timing line back through a file.
(
  run_piece "the tests marked serial, one at a time" \
    python -m pytest "${tiers[@]}" -q -p no:cacheprovider -m "serial and not chaos and not fuzz"
  printf '%s\n%s\n' "$status" "${timings[0]}" >"$serial_out/result"
) >"$serial_out/log" 2>&1 &
serial_pid=$!
run_piece "${tiers[*]} (pytest -n ${workers}, SCHED_IDLE)" \
  chrt --idle 0 python -m pytest "${tiers[@]}" -q -p no:cacheprovider -n "${workers}" --dist worksteal --durations=15 \
  -m "not chaos and not fuzz and not serial"
wait "$serial_pid"
cat "$serial_out/log"
{ read -r serial_status && read -r serial_timing; } <"$serial_out/result" || serial_status=1 serial_timing="serial piece: no result"
[ "$status" = 0 ] && status=$serial_status
timings+=("$serial_timing")
rm -rf "$serial_out"

elapsed=$(( $(date +%s) - started_at ))
printf '%s\n' "${timings[@]}"
printf '%s took %dm%02ds (status %d)\n' "$label" $((elapsed / 60)) $((elapsed % 60)) "$status"
exit "$status"
