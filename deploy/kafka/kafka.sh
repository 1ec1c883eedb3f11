#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft: broker and controller in one JVM),
# without Docker: the jars come from Maven Central (deploy/kafka/pom.xml), the JVM is
# the host's (Java 17+).
#
#   deploy/kafka/kafka.sh fetch     resolve the jars once (skipped when already complete)
#   deploy/kafka/kafka.sh start     fetch, format storage if needed, start, wait until ready
#   deploy/kafka/kafka.sh stop      SIGTERM, up to 30 s (90 s while recording the CDS
#                                   archive, see KAFKA_CDS), then SIGKILL
#   deploy/kafka/kafka.sh status    "running pid=.. port=.." (exit 0) or "stopped" (exit 1)
#   deploy/kafka/kafka.sh restart
#   deploy/kafka/kafka.sh config    print the server.properties a start would write
#   deploy/kafka/kafka.sh quorum    the KRaft quorum: "quorum leader=ID epoch=N voters=1,2,3"
#
# A local cluster (KAFKA_NODES=3, or --nodes 3 after the command): N combined
# broker+controller nodes on $KAFKA_HOST, a static quorum of N voters, replication
# factor min(N,3) and min.insync.replicas 2 (1 below three nodes). Node i (1..N) listens
# for clients on KAFKA_PORT+i-1 and for the quorum on KAFKA_CONTROLLER_PORT+i-1 (when
# KAFKA_CONTROLLER_PORT is unset: KAFKA_PORT+N+i-1), keeps its files in
# $KAFKA_RUN_DIR/node-i/ and its heap at KAFKA_HEAP_OPTS (default -Xmx384m -Xms128m).
# The cluster's shape is remembered in $KAFKA_RUN_DIR/cluster.state, so later commands
# on that run dir need no --nodes. One node at a time: --node I (start, stop, config).
#
#   deploy/kafka/kafka.sh start --nodes 3     start (or complete) a three-node cluster
#   deploy/kafka/kafka.sh stop --node 2       stop node 2 only; start --node 2 brings it back
#   deploy/kafka/kafka.sh status              one line per node, then the cluster line
#
# Environment (all optional):
#   DRAFTSTREAM_HOME       root of the run state (default: the repository root)
#   KAFKA_RUN_DIR          pid, log, config and data (default: $DRAFTSTREAM_HOME/.run/kafka)
#   KAFKA_LIBS_DIR         the jars (default: $DRAFTSTREAM_HOME/.run/kafka/libs)
#   KAFKA_HOST             address to listen on and advertise (default: 127.0.0.1)
#   KAFKA_PORT             PLAINTEXT client port (default: 9092)
#   KAFKA_CONTROLLER_PORT  KRaft controller port (default: 9093)
#   KAFKA_SASL_SSL_PORT    when set, also open a SASL_SSL listener there (PLAIN and
#                          SCRAM-SHA-256/512, self-signed TLS under $KAFKA_RUN_DIR/tls)
#   KAFKA_SASL_USER        SASL user (default: draftstream)
#   KAFKA_SASL_PASSWORD    SASL password (default: draftstream-secret)
#   KAFKA_SASL_USERS       more SASL users, "name:password name:password ..." (SCRAM
#                          credentials written at format time, and PLAIN users)
#   KAFKA_AUTHORIZER       "on": ACLs are enforced (StandardAuthorizer, nothing allowed
#                          without an ACL); KAFKA_SASL_USER is the only super user, and
#                          the broker reaches itself and its controller as that user
#                          over SASL, so the PLAINTEXT listener's anonymous clients get
#                          nothing. Needs KAFKA_SASL_SSL_PORT. Default: off
#   KAFKA_NODES            nodes of a local cluster (default: 1, or what cluster.state says)
#   KAFKA_START_TIMEOUT    seconds to wait for readiness (default: 60; 180 for a cluster)
#   KAFKA_HEAP_OPTS        JVM heap flags (default: -Xmx512m -Xms256m; per cluster node
#                          -Xmx384m -Xms128m)
#   KAFKA_JVM_OPTS         extra JVM flags, e.g. -XX:TieredStopAtLevel=1 (starts ~1 s
#                          faster on 2 cores, runs slower: fine for tests, not for bench)
#   KAFKA_CDS              class-data sharing archive of the Kafka classes, kept in
#                          $KAFKA_LIBS_DIR/.cds: "on" (default: use it, or record it
#                          during the first run; that run starts ~1.5 s and stops ~5 s
#                          slower, later starts ~2 s faster), "reuse" (use it only if it
#                          exists), "off"
#   JAVA_HOME              which JVM to use (default: `java` on PATH)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
DRAFTSTREAM_HOME=${DRAFTSTREAM_HOME:-$REPO_ROOT}
RUN_DIR=${KAFKA_RUN_DIR:-$DRAFTSTREAM_HOME/.run/kafka}
LIBS_DIR=${KAFKA_LIBS_DIR:-$DRAFTSTREAM_HOME/.run/kafka/libs}
HOST=${KAFKA_HOST:-127.0.0.1}
PORT=${KAFKA_PORT:-9092}
CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-9093}
SASL_SSL_PORT=${KAFKA_SASL_SSL_PORT:-}
SASL_USER=${KAFKA_SASL_USER:-draftstream}
SASL_PASSWORD=${KAFKA_SASL_PASSWORD:-draftstream-secret}
read -r -a SASL_USERS <<<"${KAFKA_SASL_USERS:-}"
AUTHORIZER=${KAFKA_AUTHORIZER:-off}
START_TIMEOUT=${KAFKA_START_TIMEOUT:-60}
STOP_TIMEOUT=30
read -r -a HEAP_OPTS <<<"${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m}"
read -r -a EXTRA_JVM_OPTS <<<"${KAFKA_JVM_OPTS:-}"
CDS=${KAFKA_CDS:-on}
JVM_ID=""   # java.vm.version, set by check_java
PYTHON=""   # resolved by probe_ready
JAVA=${JAVA_HOME:+$JAVA_HOME/bin/}java
KEYTOOL=${JAVA_HOME:+$JAVA_HOME/bin/}keytool

POM=$SCRIPT_DIR/pom.xml
TEMPLATE=$SCRIPT_DIR/server.properties
LOG4J_CONFIG=$SCRIPT_DIR/log4j2.properties

DATA_DIR=$RUN_DIR/data
TLS_DIR=$RUN_DIR/tls
PROPS=$RUN_DIR/server.properties
PID_FILE=$RUN_DIR/kafka.pid
STATE_FILE=$RUN_DIR/kafka.state   # ports of the running broker, written at start
LOG_FILE=$RUN_DIR/kafka.log
FORMAT_LOG=$RUN_DIR/format.log
FORMAT_STAMP=$DATA_DIR/.draftstream-format   # what the storage was formatted for
NODE_RUN_DIR=$RUN_DIR   # where the broker runs: $RUN_DIR, or $RUN_DIR/node-I in a cluster
LIBS_MARKER=.draftstream-complete            # in $LIBS_DIR: sha256 of the pom it came from

log() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------------------
# jars
# ---------------------------------------------------------------------------------------

pom_hash() { sha256sum "$POM" | cut -d' ' -f1; }

libs_ready() {
    [[ -f $LIBS_DIR/$LIBS_MARKER && $(<"$LIBS_DIR/$LIBS_MARKER") == "$(pom_hash)" ]] && return 0
    # A directory the user filled by hand (KAFKA_LIBS_DIR set, no marker of ours): use it.
    [[ -n ${KAFKA_LIBS_DIR:-} && ! -f $LIBS_DIR/$LIBS_MARKER ]] &&
        compgen -G "$LIBS_DIR/kafka_2.13-*.jar" >/dev/null
}

cmd_fetch() {
    if libs_ready; then
        return 0
    fi
    command -v mvn >/dev/null || die "mvn (Apache Maven) is needed once to download the Kafka jars"
    mkdir -p "$(dirname "$LIBS_DIR")"
    # Resolve into a fresh sibling directory and swap it in, so that a failed or
    # interrupted download never leaves a half-filled libs dir, and jars of an older
    # pom (say, a second slf4j-api) never linger next to the new ones.
    local tmp
    tmp=$(mktemp -d "${LIBS_DIR%/}.fetch.XXXXXX")
    log "resolving Kafka jars with Maven into $LIBS_DIR (once) ..."
    # (sed: Maven prints stray colour codes even in batch mode)
    if ! mvn -q -B -Dstyle.color=never -f "$POM" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$tmp" 2>&1 | sed -e $'s/\x1b\\[[0-9;]*m//g' >&2; then
        rm -rf "$tmp"
        die "mvn dependency:copy-dependencies failed (see the output above)"
    fi
    compgen -G "$tmp/kafka_2.13-*.jar" >/dev/null || { rm -rf "$tmp"; die "no kafka_2.13 jar was resolved"; }
    pom_hash >"$tmp/$LIBS_MARKER"
    if [[ -d $LIBS_DIR ]]; then
        [[ -f $LIBS_DIR/$LIBS_MARKER || -z $(ls -A "$LIBS_DIR") ]] ||
            { rm -rf "$tmp"; die "$LIBS_DIR exists and was not filled by kafka.sh; refusing to replace it"; }
        rm -rf "$LIBS_DIR"
    fi
    mv "$tmp" "$LIBS_DIR"
    # `mvn -f` may leave deploy/kafka/target behind; nothing in it is needed.
    rm -rf "$SCRIPT_DIR/target"
    log "jars ready: $(find "$LIBS_DIR" -name '*.jar' | wc -l) files"
}

# ---------------------------------------------------------------------------------------
# process helpers
# ---------------------------------------------------------------------------------------

# True when process $1 exists and is not a zombie.
is_alive() {
    local stat
    stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ $stat != Z* ]]
}

# True when $1 is a live process whose command line is our broker (not a recycled pid).
is_our_broker() {
    local pid=$1 args
    is_alive "$pid" || return 1
    args=$(ps -ww -o args= -p "$pid" 2>/dev/null) || return 1
    [[ $args == *kafka.Kafka*"$PROPS"* ]]
}

running_pid() {
    [[ -f $PID_FILE ]] || return 1
    local pid
    pid=$(<"$PID_FILE")
    [[ $pid =~ ^[0-9]+$ ]] && is_our_broker "$pid" && printf '%s\n' "$pid"
}

# A bare TCP connect with bash's /dev/tcp (the address is local: no hang to fear).
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# Readiness: the port answers AND a Metadata request lists this broker and a controller.
# A dozen lines of stdlib Python speak the protocol here so that the script needs no
# virtualenv; kcat is the fallback where there is no python3.
resolve_python() {
    if [[ -z $PYTHON ]] && command -v python3 >/dev/null; then
        # The real interpreter, not a pyenv/asdf shim, which costs 0.2 s of CPU per call.
        PYTHON=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null) || PYTHON=python3
    fi
}

probe_ready() {
    local host=$1 port=$2
    resolve_python
    if [[ -n $PYTHON ]]; then
        "$PYTHON" - "$host" "$port" <<'PY'
import socket, struct, sys

host, port = sys.argv[1], int(sys.argv[2])
try:
    client = b"draftstream-kafka-sh"
    # Metadata v1 (api key 3), correlation id 1, an empty topic list (= no topics).
    req = struct.pack(">hhih", 3, 1, 1, len(client)) + client + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=2) as sock:
        sock.settimeout(5)
        sock.sendall(struct.pack(">i", len(req)) + req)
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                sys.exit(2)
            buf += chunk
    off = 8  # size, correlation id
    (n,) = struct.unpack_from(">i", buf, off)
    off += 4
    ports = []
    for _ in range(n):
        (hlen,) = struct.unpack_from(">h", buf, off + 4)
        off += 6 + hlen
        ports.append(struct.unpack_from(">i", buf, off)[0])
        (rlen,) = struct.unpack_from(">h", buf, off + 4)
        off += 6 + max(rlen, 0)
    (controller,) = struct.unpack_from(">i", buf, off)
    sys.exit(0 if controller >= 0 and port in ports else 1)
except (OSError, struct.error):
    sys.exit(2)
PY
    elif command -v kcat >/dev/null; then
        kcat -b "$host:$port" -L -m 3 2>/dev/null | grep -q "at $host:$port"
    else
        port_open "$host" "$port"
    fi
}

kafka_version() { grep -o -m1 'Kafka version: [^ ]*' "$LOG_FILE" 2>/dev/null | cut -d' ' -f3; }

# ---------------------------------------------------------------------------------------
# configuration, TLS, storage
# ---------------------------------------------------------------------------------------

sed_escape() { printf '%s' "$1" | sed -e 's/[\\|&]/\\&/g'; }

check_port() {
    if ! [[ $2 =~ ^[0-9]+$ ]] || ((10#$2 < 1 || 10#$2 > 65535)); then
        die "$1 must be a TCP port, got '$2'"
    fi
}

render_config() {
    local extra="" tmp
    [[ -n $SASL_SSL_PORT ]] && extra=",SASL_SSL://$HOST:$SASL_SSL_PORT"
    tmp=$(mktemp "$PROPS.XXXXXX")
    chmod 600 "$tmp"
    sed -e "s|@HOST@|$(sed_escape "$HOST")|g" \
        -e "s|@PORT@|$PORT|g" \
        -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g" \
        -e "s|@EXTRA_LISTENERS@|$(sed_escape "$extra")|g" \
        -e "s|@LOG_DIR@|$(sed_escape "$DATA_DIR")|g" \
        "$TEMPLATE" >"$tmp"
    if [[ -n $SASL_SSL_PORT ]]; then
        local storepass
        storepass=$(<"$TLS_DIR/storepass")
        cat >>"$tmp" <<EOF

# --- SASL_SSL listener (added by kafka.sh because KAFKA_SASL_SSL_PORT is set) ---------
listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
# PLAIN users live in this JAAS config; SCRAM credentials were written into the cluster
# metadata at format time (kafka-storage format --add-scram).
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required$(authorizer_jaas_self) user_$SASL_USER="$SASL_PASSWORD"$(plain_users);
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location=$TLS_DIR/broker.p12
listener.name.sasl_ssl.ssl.keystore.password=$storepass
listener.name.sasl_ssl.ssl.key.password=$storepass
EOF
    fi
    [[ $AUTHORIZER != on ]] || render_authorizer >>"$tmp"
    mv "$tmp" "$PROPS"
}

# --- ACLs (KAFKA_AUTHORIZER=on, KAFKA_SASL_USERS) ---------------------------------------

# The extra SASL users as JAAS PLAIN entries: ' user_NAME="PASSWORD"' each.
plain_users() {
    local entry
    for entry in ${SASL_USERS[@]+"${SASL_USERS[@]}"}; do
        printf ' user_%s="%s"' "${entry%%:*}" "${entry#*:}"
    done
}

# With the authorizer on, the broker logs in to its own SASL_SSL listener as the admin.
authorizer_jaas_self() {
    [[ $AUTHORIZER == on ]] || return 0
    printf ' username="%s" password="%s"' "$SASL_USER" "$SASL_PASSWORD"
}

check_sasl_users() {
    [[ $AUTHORIZER == on || $AUTHORIZER == off ]] || die "KAFKA_AUTHORIZER must be on or off, got '$AUTHORIZER'"
    if [[ $AUTHORIZER == on && -z $SASL_SSL_PORT ]]; then
        die "KAFKA_AUTHORIZER=on needs KAFKA_SASL_SSL_PORT (clients authenticate there)"
    fi
    local entry
    for entry in ${SASL_USERS[@]+"${SASL_USERS[@]}"}; do
        [[ $entry =~ ^[A-Za-z0-9._-]+:[A-Za-z0-9._~@%+:-]+$ ]] ||
            die "KAFKA_SASL_USERS: '${entry%%:*}' is not name:password (name: A-Z a-z 0-9 . _ -;" \
                "password: A-Z a-z 0-9 and . _ ~ @ % + : -)"
    done
}

# Appended to server.properties: its keys override the template's (the last one wins).
render_authorizer() {
    local storepass
    storepass=$(<"$TLS_DIR/storepass")
    cat <<EOF

# --- ACLs (added by kafka.sh because KAFKA_AUTHORIZER=on) ------------------------------
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:$SASL_USER
allow.everyone.if.no.acl.found=false
# The broker talks to its controller and to itself as User:$SASL_USER over SASL (PLAIN),
# so the PLAINTEXT listener's clients are User:ANONYMOUS, with no ACL: refused.
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.mechanism.inter.broker.protocol=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="$SASL_USER" password="$SASL_PASSWORD" user_$SASL_USER="$SASL_PASSWORD";
listener.name.sasl_ssl.ssl.truststore.type=PKCS12
listener.name.sasl_ssl.ssl.truststore.location=$TLS_DIR/broker.p12
listener.name.sasl_ssl.ssl.truststore.password=$storepass
EOF
}

# A local CA and a broker certificate it signs (CN=localhost, SAN DNS:localhost and
# IP:127.0.0.1), made once with the JDK's keytool. Clients trust $TLS_DIR/ca.pem.
ensure_tls() {
    if [[ -f $TLS_DIR/broker.p12 && -f $TLS_DIR/ca.pem && -f $TLS_DIR/storepass ]]; then
        return 0
    fi
    command -v "$KEYTOOL" >/dev/null || die "keytool (from the JDK) is needed for the SASL_SSL listener"
    log "creating a local CA and broker certificate in $TLS_DIR ..."
    rm -rf "$TLS_DIR"
    mkdir -p "$TLS_DIR"
    chmod 700 "$TLS_DIR"
    local pass kt
    pass=$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
    kt=("$KEYTOOL" -noprompt -storetype PKCS12 -storepass "$pass")
    (
        cd "$TLS_DIR"
        "${kt[@]}" -genkeypair -keystore ca.p12 -alias ca -keyalg EC -groupname secp256r1 \
            -dname "CN=draftstream local CA" -validity 3650 \
            -ext BasicConstraints:critical=ca:true -ext KeyUsage:critical=keyCertSign,cRLSign
        "${kt[@]}" -exportcert -rfc -keystore ca.p12 -alias ca -file ca.pem
        "${kt[@]}" -genkeypair -keystore broker.p12 -alias broker -keyalg EC -groupname secp256r1 \
            -dname "CN=localhost" -validity 3650
        "${kt[@]}" -certreq -keystore broker.p12 -alias broker -file broker.csr
        "${kt[@]}" -gencert -keystore ca.p12 -alias ca -infile broker.csr -outfile broker.pem -rfc \
            -validity 3650 -ext SubjectAlternativeName=DNS:localhost,IP:127.0.0.1 \
            -ext KeyUsage:critical=digitalSignature -ext ExtendedKeyUsage=serverAuth
        "${kt[@]}" -importcert -keystore broker.p12 -alias ca -file ca.pem
        "${kt[@]}" -importcert -keystore broker.p12 -alias broker -file broker.pem
        rm -f broker.csr
    ) >"$RUN_DIR/keytool.log" 2>&1 || die "keytool failed, see $RUN_DIR/keytool.log"
    (umask 077 && printf '%s\n' "$pass" >"$TLS_DIR/storepass")
}

# A cluster id is a random 16-byte UUID in URL-safe base64 without padding (22 chars), the
# same as `kafka-storage random-uuid` prints, without paying for a JVM start. Like Kafka's
# Uuid.randomUuid(), draw again while it starts with "-": kafka-storage would read such an
# id as an option (1 in 64 draws); the "--cluster-id=ID" form below is a second guard.
new_cluster_id() {
    local id
    while :; do
        id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
        [[ $id == -* ]] || break
    done
    printf '%s\n' "$id"
}

# Format the storage (cluster id, a standalone KRaft quorum of one, SCRAM users) only when
# it is not formatted yet, or was formatted for another controller endpoint (the quorum
# remembers its voter's endpoint) or other SCRAM credentials; then the old data goes.
# A cluster node (QUORUM_VOTERS set) is formatted for the static voters and the cluster's
# CLUSTER_ID instead, and re-formatted when either differs.
ensure_formatted() {
    local want_controller=${QUORUM_VOTERS:-$HOST:$CONTROLLER_PORT} want_scram=""
    if [[ -n $SASL_SSL_PORT ]]; then
        want_scram=$(printf '%s\n%s\n%s' "$SASL_USER" "$SASL_PASSWORD" "${SASL_USERS[*]-}" | sha256sum | cut -d' ' -f1)
    fi
    if [[ -f $DATA_DIR/meta.properties && -f $FORMAT_STAMP ]]; then
        local have_controller have_scram
        have_controller=$(sed -n 's/^controller=//p' "$FORMAT_STAMP")
        have_scram=$(sed -n 's/^scram=//p' "$FORMAT_STAMP")
        if [[ $have_controller == "$want_controller" && (-z $want_scram || $have_scram == "$want_scram") &&
            (-z $CLUSTER_ID || $(sed -n 's/^cluster_id=//p' "$FORMAT_STAMP") == "$CLUSTER_ID") ]]; then
            return 0
        fi
        if [[ $have_controller != "$want_controller" ]]; then
            log "storage was formatted for controller $have_controller, not $want_controller;" \
                "re-formatting $DATA_DIR (its topics are deleted)"
        elif [[ -n $want_scram && $have_scram != "$want_scram" ]]; then
            log "storage lacks the SCRAM credentials of $SASL_USER;" \
                "re-formatting $DATA_DIR (its topics are deleted)"
        else
            log "storage of $DATA_DIR belongs to another cluster; re-formatting it (its topics are deleted)"
        fi
    elif [[ -e $DATA_DIR ]]; then
        log "re-formatting $DATA_DIR (no complete format stamp)"
    fi
    rm -rf "$DATA_DIR"
    mkdir -p "$DATA_DIR"
    local cluster_id=$CLUSTER_ID args
    [[ -n $cluster_id ]] || cluster_id=$(new_cluster_id)
    args=(format "--cluster-id=$cluster_id" --config "$PROPS")
    # Static voters (controller.quorum.voters) need no quorum option; one node formats a
    # dynamic quorum of itself.
    [[ -n $QUORUM_VOTERS ]] || args+=(--standalone)
    if [[ -n $SASL_SSL_PORT ]]; then
        args+=(--add-scram "SCRAM-SHA-256=[name=$SASL_USER,password=$SASL_PASSWORD]"
            --add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$SASL_PASSWORD]")
        local entry
        for entry in ${SASL_USERS[@]+"${SASL_USERS[@]}"}; do
            args+=(--add-scram "SCRAM-SHA-256=[name=${entry%%:*},password=${entry#*:}]"
                --add-scram "SCRAM-SHA-512=[name=${entry%%:*},password=${entry#*:}]")
        done
    fi
    rm -f "$FORMAT_LOG"
    if ! run_tool kafka.tools.StorageTool "${args[@]}" 2>&1 | (umask 077 && cat >"$FORMAT_LOG"); then
        cat "$FORMAT_LOG" >&2
        die "formatting the storage failed (see above)"
    fi
    printf 'controller=%s\nscram=%s\ncluster_id=%s\n' "$want_controller" "$want_scram" "$cluster_id" >"$FORMAT_STAMP"
}

# Run one of Kafka's command-line tools (a main class) in a small, quick JVM.
run_tool() {
    local opts=(-Xmx256m -XX:TieredStopAtLevel=1)
    # The broker's class-data archive holds the tools' classes too.
    if [[ $CDS != off && $CDS != 0 && -n $JVM_ID && -s $(cds_archive) ]]; then
        opts+=(-XX:SharedArchiveFile="$(cds_archive)" -Xlog:cds=off -Xlog:cds+dynamic=off)
    fi
    "$JAVA" "${opts[@]}" -cp "$LIBS_DIR/*" -Dlog4j2.configurationFile="$LOG4J_CONFIG" "$@"
}

check_java() {
    command -v "$JAVA" >/dev/null || die "java not found (Kafka 4 needs Java 17 or newer)"
    local settings v
    settings=$("$JAVA" -XshowSettings:properties -version 2>&1)
    v=$(sed -n 's/^ *java.specification.version = //p' <<<"$settings")
    [[ ${v%%.*} =~ ^[0-9]+$ && ${v%%.*} -ge 17 ]] || die "Kafka 4 needs Java 17 or newer; $JAVA is $v"
    JVM_ID=$(sed -n 's/^ *java.vm.version = //p' <<<"$settings" | tr -c 'A-Za-z0-9._\n-' '_')
}

# Class-data sharing: an archive of the ~6000 Kafka/Scala classes, mapped at start
# instead of loaded and verified one by one (start 5 s -> 3 s on 2 cores). It is tied to
# the exact JVM build and jars, so it lives in the libs dir (a new fetch drops it) and is
# named after the JVM build. Recorded by the JVM itself when a broker exits cleanly.
CDS_PARTIAL=""
cds_archive() { printf '%s/.cds/kafka-%s.jsa' "$LIBS_DIR" "$JVM_ID"; }
cds_archive_of() { local p=${1%.partial}; printf '%s' "${p%.*}"; }   # x.jsa.123.partial -> x.jsa
cds_opts() {
    CDS_OPTS=()
    [[ $CDS == off || $CDS == 0 || -z $JVM_ID ]] && return 0
    local dir=$LIBS_DIR/.cds
    local jsa
    jsa=$(cds_archive)
    if [[ -s $jsa ]]; then
        CDS_OPTS=(-XX:SharedArchiveFile="$jsa" -Xlog:cds=off -Xlog:cds+dynamic=off)
    elif [[ $CDS == on || $CDS == 1 ]] && mkdir -p "$dir" 2>/dev/null && [[ -w $dir ]]; then
        # Unique per run and node: several brokers may record at the same time.
        CDS_PARTIAL=$jsa.$$${NODE_ID:+.node$NODE_ID}.partial
        rm -f "$CDS_PARTIAL"
        CDS_OPTS=(-XX:ArchiveClassesAtExit="$CDS_PARTIAL" -Xlog:cds=off -Xlog:cds+dynamic=off)
    fi
}

# ---------------------------------------------------------------------------------------
# a local cluster: several combined broker+controller nodes, each in $RUN_DIR/node-I
# ---------------------------------------------------------------------------------------

CLUSTER_FILE=$RUN_DIR/cluster.state   # nodes, host, ports, voters and cluster id
OPT_NODES=""         # --nodes N
ONLY_NODE=""         # --node I: one node of the cluster
NODES=1              # nodes of the run dir (resolve_nodes); 1 is the single broker
NODE_ID=""           # the node the per-broker variables point at (select_node)
QUORUM_VOTERS=""     # controller.quorum.voters of the cluster
CLUSTER_ID=""        # the cluster's id, shared by every node's storage
BASE_PORT=""         # client port of node 1; node I has BASE_PORT+I-1
BASE_CONTROLLER_PORT=""

cluster_get() { sed -n "s/^$1=//p" "$CLUSTER_FILE" 2>/dev/null || true; }

# NODES from --nodes, KAFKA_NODES or the run dir's cluster.state (else 1).
resolve_nodes() {
    local have want
    have=$(cluster_get nodes)
    want=${OPT_NODES:-${KAFKA_NODES:-${have:-1}}}
    [[ $want =~ ^[1-9]$ ]] || die "the number of nodes must be 1..9, got '$want'"
    NODES=$want
    if ((NODES == 1)); then
        [[ -z $have ]] || die "$RUN_DIR holds a $have-node cluster ($CLUSTER_FILE): use another" \
            "KAFKA_RUN_DIR for a single broker, or stop the cluster and remove $RUN_DIR"
        [[ -z $ONLY_NODE ]] || die "--node needs a cluster (--nodes N or KAFKA_NODES=N, N > 1)"
        return 0
    fi
    if [[ -n $ONLY_NODE ]] && ! [[ $ONLY_NODE =~ ^[1-9]$ && $ONLY_NODE -le $NODES ]]; then
        die "--node must be one of 1..$NODES, got '$ONLY_NODE'"
    fi
    [[ -n ${KAFKA_HEAP_OPTS:-} ]] || HEAP_OPTS=(-Xmx384m -Xms128m)
    [[ -n ${KAFKA_START_TIMEOUT:-} ]] || START_TIMEOUT=180
}

# Host and ports of the cluster: "start" (of the whole cluster) and "config" take
# KAFKA_HOST/KAFKA_PORT/KAFKA_CONTROLLER_PORT when set; everything else, and whatever is unset, comes from
# cluster.state, then from the defaults (controller ports right after the client ports).
resolve_cluster_ports() {
    local from_env=$1 state_port
    state_port=$(cluster_get port)
    if [[ $from_env == env && -n ${KAFKA_PORT:-} || -z $state_port ]]; then
        BASE_PORT=$PORT
    else
        BASE_PORT=$state_port
    fi
    if [[ $from_env == env && -n ${KAFKA_CONTROLLER_PORT:-} ]]; then
        BASE_CONTROLLER_PORT=$KAFKA_CONTROLLER_PORT
    elif [[ $BASE_PORT == "$state_port" && $(cluster_get nodes) == "$NODES" ]]; then
        BASE_CONTROLLER_PORT=$(cluster_get controller_port)
    else
        BASE_CONTROLLER_PORT=$((BASE_PORT + NODES))
    fi
    if [[ $from_env != env || -z ${KAFKA_HOST:-} ]]; then
        HOST=$(cluster_get host)
        HOST=${HOST:-${KAFKA_HOST:-127.0.0.1}}
    fi
    check_port KAFKA_PORT "$BASE_PORT"
    check_port KAFKA_CONTROLLER_PORT "$BASE_CONTROLLER_PORT"
    check_port "the last node's client port" $((BASE_PORT + NODES - 1))
    check_port "the last node's controller port" $((BASE_CONTROLLER_PORT + NODES - 1))
    if ((BASE_CONTROLLER_PORT < BASE_PORT + NODES && BASE_PORT < BASE_CONTROLLER_PORT + NODES)); then
        die "client ports $BASE_PORT..$((BASE_PORT + NODES - 1)) and controller ports" \
            "$BASE_CONTROLLER_PORT..$((BASE_CONTROLLER_PORT + NODES - 1)) overlap"
    fi
    local i voters=()
    for ((i = 1; i <= NODES; i++)); do
        voters+=("$i@$HOST:$((BASE_CONTROLLER_PORT + i - 1))")
    done
    QUORUM_VOTERS=$(IFS=,; printf '%s' "${voters[*]}")
}

# Point the per-broker variables (ports, files, storage) at node $1, so that
# render_config, ensure_formatted, launch_broker and cmd_stop act on that node.
select_node() {
    NODE_ID=$1
    NODE_RUN_DIR=$RUN_DIR/node-$1
    PORT=$((BASE_PORT + $1 - 1))
    CONTROLLER_PORT=$((BASE_CONTROLLER_PORT + $1 - 1))
    DATA_DIR=$NODE_RUN_DIR/data
    PROPS=$NODE_RUN_DIR/server.properties
    PID_FILE=$NODE_RUN_DIR/kafka.pid
    STATE_FILE=$NODE_RUN_DIR/kafka.state
    LOG_FILE=$NODE_RUN_DIR/kafka.log
    FORMAT_LOG=$NODE_RUN_DIR/format.log
    FORMAT_STAMP=$DATA_DIR/.draftstream-format
}

# The node ids a command acts on: --node I, or all of them.
node_ids() {
    if [[ -n $ONLY_NODE ]]; then
        printf '%s\n' "$ONLY_NODE"
    else
        seq 1 "$NODES"
    fi
}

# What makes the rendered single-node template node $NODE_ID of the cluster (its own
# ports and log dir are already in it): the node id, the static quorum of every node,
# and replication that survives the loss of one node without losing an acknowledged
# write (acks=all needs min.insync.replicas copies). "-KEY" removes KEY.
cluster_props() {
    local rf=$((NODES < 3 ? NODES : 3)) isr
    isr=$((rf >= 3 ? 2 : 1))
    printf '%s\n' \
        "node.id=$NODE_ID" \
        "-controller.quorum.bootstrap.servers" \
        "controller.quorum.voters=$QUORUM_VOTERS" \
        "default.replication.factor=$rf" \
        "min.insync.replicas=$isr" \
        "offsets.topic.replication.factor=$rf" \
        "transaction.state.log.replication.factor=$rf" \
        "transaction.state.log.min.isr=$isr" \
        "share.coordinator.state.topic.replication.factor=$rf" \
        "share.coordinator.state.topic.min.isr=$isr"
}

# Apply KEY=VALUE lines (replace KEY's line, or append) and -KEY lines (remove KEY) from
# stdin (not empty) to the properties file $1; $2, when given, becomes its first line.
edit_props() {
    local file=$1 tmp
    tmp=$(mktemp "$file.XXXXXX")
    chmod 600 "$tmp"
    awk -v header="${2:-}" 'FNR == 1 && NR != FNR && header != "" { print header }
        NR == FNR {
            if ($0 ~ /^-/) { drop[substr($0, 2)] = 1; next }
            k = $0; sub(/=.*/, "", k); set[k] = $0; order[++n] = k; next
        }
        { k = $0; sub(/=.*/, "", k) }
        /^[^#]/ && (k in drop) { next }
        /^[^#]/ && (k in set) { print set[k]; done[k] = 1; next }
        { print }
        END {
            for (i = 1; i <= n; i++) if (!(order[i] in done)) {
                if (!added++) print "\n# --- cluster (added by kafka.sh for a local cluster) ---"
                print set[order[i]]
            }
        }' - "$file" >"$tmp"
    mv "$tmp" "$file"
}

render_node_config() {
    render_config
    cluster_props | edit_props "$PROPS" "# Node $NODE_ID of a local $NODES-node cluster: kafka.sh set node.id, the static quorum \
and the replication settings below over the single-node template (cluster_props)."
}

# True when node $NODE_ID's storage was formatted for this cluster's voters and id $1.
node_formatted_for() {
    [[ -f $DATA_DIR/meta.properties && -f $FORMAT_STAMP ]] &&
        [[ $(sed -n 's/^controller=//p' "$FORMAT_STAMP") == "$QUORUM_VOTERS" ]] &&
        [[ $(sed -n 's/^cluster_id=//p' "$FORMAT_STAMP") == "$1" ]]
}

# Keep the cluster id when every node's storage belongs to this cluster; otherwise every
# node is re-formatted under a new id (never while one runs: a voter must not lose its log).
cluster_prepare() {
    [[ -z $SASL_SSL_PORT ]] || die "KAFKA_SASL_SSL_PORT is for the single broker; the local cluster is PLAINTEXT only"
    local single_pid
    if single_pid=$(running_pid); then
        die "a single broker (pid $single_pid) runs in $RUN_DIR: stop it first, or use another KAFKA_RUN_DIR"
    fi
    local stored_id i all_formatted=1 running=()
    stored_id=$(cluster_get cluster_id)
    for ((i = 1; i <= NODES; i++)); do
        select_node "$i"
        [[ -n $stored_id ]] && node_formatted_for "$stored_id" || all_formatted=0
        ! running_pid >/dev/null || running+=("$i")
    done
    if ((all_formatted)); then
        CLUSTER_ID=$stored_id
    else
        ((${#running[@]} == 0)) || die "node(s) ${running[*]} run with other cluster settings or storage:" \
            "stop the cluster first (kafka.sh stop), then start re-formats every node"
        CLUSTER_ID=$(new_cluster_id)
        ((${#stored_id} == 0)) || log "re-formatting the storage of all $NODES nodes (a new cluster; old topics are deleted)"
    fi
    mkdir -p "$RUN_DIR"
    printf 'nodes=%s\nhost=%s\nport=%s\ncontroller_port=%s\nvoters=%s\ncluster_id=%s\n' \
        "$NODES" "$HOST" "$BASE_PORT" "$BASE_CONTROLLER_PORT" "$QUORUM_VOTERS" "$CLUSTER_ID" >"$CLUSTER_FILE"
}

cluster_bootstrap() {
    local i out=()
    for ((i = 1; i <= NODES; i++)); do out+=("$HOST:$((BASE_PORT + i - 1))"); done
    (IFS=,; printf '%s' "${out[*]}")
}

cmd_cluster_start() {
    [[ -z $ONLY_NODE || -f $CLUSTER_FILE ]] || die "no cluster in $RUN_DIR yet: start all of it first (start --nodes N)"
    local started_ns i pid launched=()
    started_ns=$(date +%s%N)
    cmd_fetch
    check_java
    # One node of a standing cluster comes back on the ports the cluster was made with,
    # whatever KAFKA_PORT / KAFKA_CONTROLLER_PORT the caller's environment holds.
    if [[ -n $ONLY_NODE ]]; then resolve_cluster_ports state; else resolve_cluster_ports env; fi
    cluster_prepare
    for i in $(node_ids); do
        select_node "$i"
        if pid=$(running_pid); then
            log "node $i already running (pid $pid)"
            continue
        fi
        local p
        for p in "$PORT" "$CONTROLLER_PORT"; do
            ! port_open "$HOST" "$p" || die "port $HOST:$p (node $i) is already in use by another process"
        done
        mkdir -p "$NODE_RUN_DIR"
        render_node_config
        ensure_formatted
        launch_broker
        launched+=("$i:$LAUNCHED_PID")
    done
    resolve_python # while the JVMs start
    local deadline=$((SECONDS + START_TIMEOUT)) entry
    # A node is ready once a quorum majority runs: all of them start before any is awaited.
    for entry in ${launched[@]+"${launched[@]}"}; do
        select_node "${entry%%:*}"
        wait_ready "${entry#*:}" "$deadline"
    done
    local ms=$((($(date +%s%N) - started_ns) / 1000000))
    log "Kafka $(kafka_version || echo '?'): node(s) $(node_ids | paste -sd, -) of $NODES ready on $HOST" \
        "in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s (logs in $RUN_DIR/node-*/kafka.log)"
    cmd_cluster_status
}

cmd_cluster_stop() {
    if [[ ! -f $CLUSTER_FILE ]]; then
        echo "stopped (was not running)"
        return 0
    fi
    resolve_cluster_ports state
    local i pids=() failed=0
    # In parallel: each node's controlled shutdown may take seconds.
    for i in $(node_ids); do
        (select_node "$i" && printf 'node=%s %s\n' "$i" "$(cmd_stop)") &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || failed=1; done
    ((failed == 0)) || die "a node did not stop cleanly (see above)"
}

cmd_cluster_status() {
    if [[ ! -f $CLUSTER_FILE ]]; then
        echo "stopped"
        return 1
    fi
    resolve_cluster_ports state
    local i pid running=0
    for ((i = 1; i <= NODES; i++)); do
        select_node "$i"
        if pid=$(running_pid); then
            running=$((running + 1))
            printf 'node=%s running pid=%s bootstrap=%s:%s port=%s controller_port=%s version=%s\n' \
                "$i" "$pid" "$HOST" "$PORT" "$PORT" "$CONTROLLER_PORT" "$(kafka_version || true)"
        else
            printf 'node=%s stopped port=%s controller_port=%s\n' "$i" "$PORT" "$CONTROLLER_PORT"
        fi
    done
    printf 'cluster nodes=%s running=%s bootstrap=%s voters=%s\n' \
        "$NODES" "$running" "$(cluster_bootstrap)" "$QUORUM_VOTERS"
    ((running > 0))
}

# The server.properties a start would write, without starting (or writing) anything.
cmd_config() {
    local i tmp
    tmp=$(mktemp -d)
    # shellcheck disable=SC2064 # expand now: tmp is local
    trap "rm -rf '$tmp'" RETURN
    if ((NODES == 1)); then
        PROPS=$tmp/server.properties
        render_config
        cat "$PROPS"
        return 0
    fi
    resolve_cluster_ports env
    for i in $(node_ids); do
        select_node "$i"
        printf '# ==> node-%s/server.properties <==\n' "$i"
        PROPS=$tmp/node-$i.properties
        render_node_config
        cat "$PROPS"
    done
}

# The KRaft quorum as its controllers report it (kafka-metadata-quorum describe --status).
cmd_quorum() {
    local endpoints=() i
    if ((NODES == 1)); then
        running_pid >/dev/null || die "the broker is not running"
        endpoints=("$(state_get host):$(state_get controller_port)")
    else
        [[ -f $CLUSTER_FILE ]] || die "no cluster in $RUN_DIR"
        resolve_cluster_ports state
        for ((i = 1; i <= NODES; i++)); do
            select_node "$i"
            ! running_pid >/dev/null || endpoints+=("$HOST:$CONTROLLER_PORT")
        done
        ((${#endpoints[@]})) || die "no node of the cluster is running"
    fi
    check_java
    local cfg out leader
    cfg=$(mktemp)
    # A quorum without a leader must fail the command, not hang it.
    printf 'request.timeout.ms=10000\ndefault.api.timeout.ms=20000\n' >"$cfg"
    out=$(run_tool org.apache.kafka.tools.MetadataQuorumCommand --command-config "$cfg" \
        --bootstrap-controller "$(IFS=,; printf '%s' "${endpoints[*]}")" describe --status 2>&1) || {
        rm -f "$cfg"
        die "kafka-metadata-quorum failed: $(tail -n 5 <<<"$out")"
    }
    rm -f "$cfg"
    leader=$(sed -n 's/^LeaderId: *//p' <<<"$out")
    [[ $leader =~ ^[0-9]+$ ]] || die "no leader in the quorum's answer: $out"
    printf 'quorum leader=%s epoch=%s voters=%s\n' "$leader" "$(sed -n 's/^LeaderEpoch: *//p' <<<"$out")" \
        "$(sed -n 's/^CurrentVoters: *//p' <<<"$out" | grep -o '"id": *[0-9]*' | grep -o '[0-9]*$' | paste -sd, -)"
}

# ---------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------

# One value of the state file written at start ("" when absent).
state_get() { sed -n "s/^$1=//p" "$STATE_FILE" 2>/dev/null || true; }

print_running() {
    local pid=$1 port sasl_ssl_port
    port=$(state_get port)
    sasl_ssl_port=$(state_get sasl_ssl_port)
    printf 'running pid=%s bootstrap=%s:%s port=%s controller_port=%s' \
        "$pid" "$(state_get host)" "$port" "$port" "$(state_get controller_port)"
    [[ -n $sasl_ssl_port ]] && printf ' sasl_ssl_port=%s cafile=%s' "$sasl_ssl_port" "$TLS_DIR/ca.pem"
    printf ' version=%s\n' "$(kafka_version || true)"
}

cmd_status() {
    local pid
    if pid=$(running_pid); then
        print_running "$pid"
        return 0
    fi
    echo "stopped"
    return 1
}

cmd_start() {
    local pid
    if pid=$(running_pid); then
        local running_port
        running_port=$(state_get port)
        if [[ -n ${KAFKA_PORT:-} && $running_port != "$KAFKA_PORT" ]]; then
            log "already running, on port $running_port (not KAFKA_PORT=$KAFKA_PORT): use restart to move it"
        else
            log "already running"
        fi
        print_running "$pid"
        return 0
    fi
    check_port KAFKA_PORT "$PORT"
    check_port KAFKA_CONTROLLER_PORT "$CONTROLLER_PORT"
    [[ -z $SASL_SSL_PORT ]] || check_port KAFKA_SASL_SSL_PORT "$SASL_SSL_PORT"
    if [[ -n $SASL_SSL_PORT ]]; then
        # These values end up in a JAAS string and in --add-scram: keep them plain.
        [[ $SASL_USER =~ ^[A-Za-z0-9._-]+$ ]] || die "KAFKA_SASL_USER may only use A-Z a-z 0-9 . _ -"
        [[ $SASL_PASSWORD =~ ^[A-Za-z0-9._~@%+:-]+$ ]] ||
            die "KAFKA_SASL_PASSWORD may only use A-Z a-z 0-9 and . _ ~ @ % + : -"
    fi
    check_sasl_users
    local p
    for p in "$PORT" "$CONTROLLER_PORT" $SASL_SSL_PORT; do
        ! port_open "$HOST" "$p" || die "port $HOST:$p is already in use by another process"
    done
    local started_ns
    started_ns=$(date +%s%N)
    cmd_fetch
    check_java
    mkdir -p "$RUN_DIR"
    [[ -z $SASL_SSL_PORT ]] || ensure_tls
    render_config
    ensure_formatted

    launch_broker
    pid=$LAUNCHED_PID
    resolve_python # while the JVM starts
    local deadline=$((SECONDS + START_TIMEOUT))
    wait_ready "$pid" "$deadline"
    if [[ -n $SASL_SSL_PORT ]]; then
        until port_open "$HOST" "$SASL_SSL_PORT"; do
            ((SECONDS < deadline)) || die "the SASL_SSL listener on $SASL_SSL_PORT did not open"
            sleep 0.1
        done
    fi
    local ms=$((($(date +%s%N) - started_ns) / 1000000))
    log "Kafka $(kafka_version || echo '?') ready on $HOST:$PORT in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s" \
        "(pid $pid, log $LOG_FILE)"
    print_running "$pid"
}

# Start kafka.Kafka on $PROPS in the background (pid in $LAUNCHED_PID and $PID_FILE).
LAUNCHED_PID=""
launch_broker() {
    cds_opts
    [[ -f $LOG_FILE ]] && mv -f "$LOG_FILE" "$LOG_FILE.1"
    # setsid: the broker must outlive this script and ignore the Ctrl-C of the terminal
    # (or pytest) that started it. 9>&-: do not inherit the lock below.
    (
        cd "$NODE_RUN_DIR"
        exec setsid "$JAVA" "${HEAP_OPTS[@]}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
            -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true \
            ${CDS_OPTS[@]+"${CDS_OPTS[@]}"} ${EXTRA_JVM_OPTS[@]+"${EXTRA_JVM_OPTS[@]}"} \
            -Dlog4j2.configurationFile="$LOG4J_CONFIG" -Dkafka.logs.dir="$NODE_RUN_DIR" \
            -cp "$LIBS_DIR/*" kafka.Kafka "$PROPS" </dev/null >"$LOG_FILE" 2>&1 9>&-
    ) &
    LAUNCHED_PID=$!
    printf '%s\n' "$LAUNCHED_PID" >"$PID_FILE"
    printf 'host=%s\nport=%s\ncontroller_port=%s\nsasl_ssl_port=%s\ncds_partial=%s\n' \
        "$HOST" "$PORT" "$CONTROLLER_PORT" "$SASL_SSL_PORT" "$CDS_PARTIAL" >"$STATE_FILE"
}

# Wait until broker $1 (just launched) serves metadata that lists it, or die at time $2.
wait_ready() {
    local pid=$1 deadline=$2
    until port_open "$HOST" "$PORT" && probe_ready "$HOST" "$PORT"; do
        if ! is_alive "$pid"; then
            rm -f "$PID_FILE" "$STATE_FILE"
            tail -n 40 "$LOG_FILE" >&2 || true
            die "the broker exited during startup (log: $LOG_FILE)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 40 "$LOG_FILE" >&2 || true
            cmd_stop >/dev/null
            die "the broker was not ready within ${START_TIMEOUT}s (log: $LOG_FILE)"
        fi
        sleep 0.1
    done
}

cmd_stop() {
    local pid i killed=0 cds_partial wait_s=$STOP_TIMEOUT
    if ! pid=$(running_pid); then
        rm -f "$PID_FILE" "$STATE_FILE"
        echo "stopped (was not running)"
        return 0
    fi
    cds_partial=$(state_get cds_partial)
    # Writing the class-data archive at exit takes 5 s on an idle machine, more on a busy one.
    [[ -z $cds_partial ]] || wait_s=$((STOP_TIMEOUT * 3))
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < wait_s * 10; i++)); do
        is_our_broker "$pid" || break
        sleep 0.1
    done
    if is_our_broker "$pid"; then
        log "no exit ${wait_s}s after SIGTERM; sending SIGKILL to $pid"
        kill -KILL "$pid" 2>/dev/null || true
        killed=1
        for ((i = 0; i < 50; i++)); do
            is_our_broker "$pid" || break
            sleep 0.1
        done
    fi
    # A clean exit has written the class-data archive the broker was recording.
    if [[ -n $cds_partial && -f $cds_partial ]]; then
        if ((killed == 0)) && [[ -s $cds_partial ]]; then
            mv -f "$cds_partial" "$(cds_archive_of "$cds_partial")"
        else
            rm -f "$cds_partial"
        fi
    fi
    rm -f "$PID_FILE" "$STATE_FILE"
    echo "stopped (pid $pid)"
}

# One command at a time per run dir (two test sessions starting at once).
take_lock() {
    mkdir -p "$RUN_DIR"
    if command -v flock >/dev/null; then
        exec 9>"$RUN_DIR/.lock"
        flock -w 180 9 || die "another kafka.sh is still busy with $RUN_DIR"
    fi
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# --nodes N and --node I, after the command.
parse_options() {
    while (($#)); do
        case $1 in
        --nodes | --node)
            (($# >= 2)) || die "$1 needs a value"
            if [[ $1 == --nodes ]]; then OPT_NODES=$2; else ONLY_NODE=$2; fi
            shift 2
            ;;
        --nodes=*) OPT_NODES=${1#*=} && shift ;;
        --node=*) ONLY_NODE=${1#*=} && shift ;;
        *) die "unknown option '$1' (see kafka.sh help)" ;;
        esac
    done
}

main() {
    local cmd=${1:-}
    (($# == 0)) || shift
    parse_options "$@"
    case $cmd in
    start | stop | status | restart | config | quorum) resolve_nodes ;;
    esac
    if ((NODES > 1)); then
        case $cmd in
        start | stop | restart) take_lock ;;
        esac
        case $cmd in
        start) cmd_cluster_start ;;
        stop) cmd_cluster_stop ;;
        status) cmd_cluster_status ;;
        restart) cmd_cluster_stop && cmd_cluster_start ;;
        config) cmd_config ;;
        quorum) cmd_quorum ;;
        esac
        return
    fi
    case $cmd in
    fetch | start | stop | restart) take_lock ;;
    esac
    case $cmd in
    fetch) cmd_fetch && log "jars in $LIBS_DIR" ;;
    cluster-id) new_cluster_id ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    restart) cmd_stop && cmd_start ;;
    config) cmd_config ;;
    quorum) cmd_quorum ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        exit 2
        ;;
    esac
}

main "$@"
