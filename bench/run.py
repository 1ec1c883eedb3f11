"""Run every benchmark (each in its own process), print one table, write bench/results.json.

``python -m bench.run [--quick] [--only NAME ...]``. Exit status: 2 when a benchmark
crashed (or produced no figures), else 0: a missed target is a finding reported in the
table, not a crash (at quick sizes the tiny inputs make the ratios meaningless anyway;
that run only proves the benchmarks still work).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCHMARKS: tuple[tuple[str, str], ...] = (
    ("reconstruct", "bench.bench_reconstruct"),
    ("e2e", "bench.bench_e2e"),
    ("concurrency", "bench.bench_concurrency"),
    ("halt", "bench.bench_halt"),
    ("scaleout", "bench.bench_scaleout"),
    ("ratelimit", "bench.bench_ratelimit"),
    ("headroom", "bench.bench_headroom"),
    ("lost", "bench.bench_lost"),
)
KEYS = ("name", "value", "reference", "ratio", "spread", "target", "met")
RESULTS = Path(__file__).resolve().parent / "results.json"


def run_one(module: str, quick: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Run one benchmark module as a child process; (rows, error or None)."""
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", module, "--result-file", str(out)]
        if quick:
            argv.append("--quick")
        code = subprocess.call(argv, cwd=Path(__file__).resolve().parent.parent)  # noqa: S603 - our modules
        if code != 0 or not out.is_file():
            return [], f"{module} exited with status {code}"
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows, None


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a fixed-width text table."""
    head = (
        f"{'benchmark':<48} {'value':>11} {'reference':>11} {'unit':<10} {'ratio':>7} {'rounds':>12} "
        f"{'target':>8}  met"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<48} {r['value']:>11.4g} {r['reference']:>11.4g} {r.get('unit', ''):<10} "
            f"{r['ratio']:>7.3f} {r.get('spread', ''):>12} {r['target']:>8}  {'yes' if r['met'] else 'NO'}"
        )
    return "\n".join(lines)


def main() -> int:
    """Run the selected benchmarks and report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: proves the benchmarks run")
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in BENCHMARKS], help="run only these")
    args = parser.parse_args()
    selected = [(n, m) for n, m in BENCHMARKS if not args.only or n in args.only]
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    started = time.monotonic()
    for name, module in selected:
        print(f"\n=== {name} ({module}{' --quick' if args.quick else ''}) ===", flush=True)
        t0 = time.monotonic()
        got, error = run_one(module, args.quick)
        print(f"=== {name}: {time.monotonic() - t0:.0f}s ===", flush=True)
        rows.extend(got)
        if error:
            errors.append(error)
    RESULTS.write_text(
        json.dumps(
            [{k: r.get(k, "") for k in KEYS} for r in rows],
            indent=2,
        )
        + "\n"
    )
    print(f"\n{table(rows)}\n\n{len(rows)} figures in {time.monotonic() - started:.0f}s; written to {RESULTS}")
    for error in errors:
        print(f"CRASHED: {error}", file=sys.stderr)
    if errors:
        return 2
    missed = [r["name"] for r in rows if not r["met"]]
    if missed:
        print(f"targets missed: {', '.join(missed)}{' (quick sizes: not a failure)' if args.quick else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
