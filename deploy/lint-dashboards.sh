#!/usr/bin/env bash
# Lint every Grafana dashboard under grafana/dashboards/ with Grafana's dashboard-linter.
#
# The linter is a Go program, installed once through the Go module proxy into
# .run/go/bin (GOPATH, module and build caches under .run/go too) and reused after.
# Exit status: 0 clean; 1 a dashboard has a linter error (or a warning with
# DASHBOARD_LINTER_STRICT=1); 2 the linter could not be installed and DASHBOARD_LINTER_REQUIRED=1.
#
# Without the linter (no Go toolchain, or the module proxy refuses the module: proxy.golang.org
# answers 403 for every version of github.com/grafana/dashboard-linter) the script says so and
# runs the Python checks that hold the dashboards to the same rules
# (tests/unit/test_observability.py, which `make test` runs too), and exits with their status.
#   DASHBOARD_LINTER_VERSION   module version (default: latest)
#   DASHBOARD_LINTER_STRICT    1 = warnings fail too (the linter's --strict)
#   DASHBOARD_LINTER_REQUIRED  1 = a linter that cannot be installed is a failure (exit 2)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

module=github.com/grafana/dashboard-linter
version=${DASHBOARD_LINTER_VERSION:-latest}
export GOPATH="$root/.run/go"
export GOBIN="$GOPATH/bin"
export GOMODCACHE="$GOPATH/pkg/mod"
export GOCACHE="$GOPATH/cache"
export GOFLAGS="${GOFLAGS:--mod=mod}"
linter="$GOBIN/dashboard-linter"
log="$GOPATH/install.log"

install_linter() {
    command -v go >/dev/null 2>&1 || { echo "the Go toolchain is not installed (apt-get install golang-go)"; return 1; }
    mkdir -p "$GOBIN"
    echo "lint-dashboards: installing $module@$version into $GOBIN" >&2
    if go install "$module@$version" >"$log" 2>&1; then
        return 0
    fi
    # Some releases carry a `replace` directive in go.mod, which `go install pkg@version`
    # refuses; building inside the downloaded module honours it.
    local dir
    if dir=$(go mod download -json "$module@$version" 2>>"$log" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') \
        && [[ -n "$dir" ]] \
        && (cd "$dir" && go build -o "$linter" . >>"$log" 2>&1); then
        return 0
    fi
    tail -n 5 "$log"
    return 1
}

python_checks() {
    local py=python3
    [[ -x .venv/bin/python ]] && py=.venv/bin/python
    "$py" -m pytest -q -p no:cacheprovider tests/unit/test_observability.py -k "dashboard or quer"
}

if [[ ! -x "$linter" ]]; then
    if ! why=$(install_linter); then
        echo "lint-dashboards: could not install $module@$version: $why" >&2
        if [[ "${DASHBOARD_LINTER_REQUIRED:-0}" == "1" ]]; then
            echo "lint-dashboards: DASHBOARD_LINTER_REQUIRED=1, so this is a failure" >&2
            exit 2
        fi
        echo "lint-dashboards: running the Python dashboard checks instead" >&2
        python_checks
        exit $?
    fi
fi

shopt -s nullglob
dashboards=(grafana/dashboards/*.json)
if (( ${#dashboards[@]} == 0 )); then
    echo "lint-dashboards: no dashboards under grafana/dashboards/" >&2
    exit 1
fi

strict=()
[[ "${DASHBOARD_LINTER_STRICT:-0}" == "1" ]] && strict=(--strict)

status=0
for dashboard in "${dashboards[@]}"; do
    # Without --strict the linter exits 0 even on errors: read its report instead.
    if ! out=$("$linter" lint "${strict[@]}" "$dashboard" 2>&1); then
        status=1
    fi
    if grep -q '^\[❌\]' <<<"$out"; then
        status=1
    fi
    problems=$(grep -E '^\[(❌|⚠️)\]' <<<"$out" || true)
    if [[ -n "$problems" ]]; then
        echo "$dashboard:"
        echo "$problems"
    else
        echo "ok  $dashboard"
    fi
done
exit $status
