# Sourced by deploy/run-tests.sh and deploy/run-bench.sh: a real Kafka broker for the run.
#
#   own_broker_start   unless KAFKA_BOOTSTRAP_SERVERS names a broker already, start the
#                      local one (deploy/kafka/kafka.sh on KAFKA_PORT / KAFKA_CONTROLLER_PORT,
#                      default 19092 / 19093), export KAFKA_BOOTSTRAP_SERVERS, and stop it
#                      when the script exits. A broker of the same run dir that is already
#                      running (another session's) is used as it is and left running.
#                      The run dir is the runs' own (KAFKA_RUN_DIR, default .run/test-kafka,
#                      apart from `make kafka-up`'s .run/kafka), emptied before each start:
#                      a run's topics are thrown away, and a broker holding every earlier
#                      run's (thousands of partitions after a few) gets slower at everything.
#
# Expects the repository root as the working directory.

own_broker=0

own_broker_stop() {
    if [ "$own_broker" = 1 ]; then
        bash deploy/kafka/kafka.sh stop >/dev/null 2>&1
        own_broker=0
    fi
}

own_broker_start() {
    [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] && return 0
    export KAFKA_PORT="${KAFKA_PORT:-19092}"
    export KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-19093}"
    export KAFKA_RUN_DIR="${KAFKA_RUN_DIR:-$PWD/.run/test-kafka}"
    local running
    if running=$(bash deploy/kafka/kafka.sh status 2>/dev/null); then
        # "running pid=.. bootstrap=HOST:PORT ...": someone else's broker; use it, keep it
        KAFKA_BOOTSTRAP_SERVERS=$(sed -n 's/.* bootstrap=\([^ ]*\).*/\1/p' <<<"$running")
        export KAFKA_BOOTSTRAP_SERVERS
        echo "using the local Kafka broker that is already running at ${KAFKA_BOOTSTRAP_SERVERS}"
        return 0
    fi
    rm -rf "${KAFKA_RUN_DIR:?}/data"
    bash deploy/kafka/kafka.sh start || { echo "could not start the local Kafka broker"; return 1; }
    own_broker=1
    trap own_broker_stop EXIT
    export KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:${KAFKA_PORT}"
}
