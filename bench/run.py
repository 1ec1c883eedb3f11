"""Run every benchmark (each in its own process), print one table, write bench/results.json.

``python -m bench.run [--quick] [--jobs N] [--only NAME ...]``. Exit status: 2 when a
benchmark crashed (or produced no figures), else 0: a missed target is a finding reported in
the table, not a crash (at quick sizes the tiny inputs make the ratios meaningless anyway;
that run only proves the benchmarks still work, so ``--quick`` runs three at a time and
prints each one's output when it ends; a full run takes them one by one, each on a machine
no other benchmark loads).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The longest first: run side by side, the last to start sets the end.
BENCHMARKS: tuple[tuple[str, str], ...] = (
    ("lost", "bench.bench_lost"),
    ("ratelimit", "bench.bench_ratelimit"),
    ("e2e", "bench.bench_e2e"),
    ("headroom", "bench.bench_headroom"),
    ("scaleout", "bench.bench_scaleout"),
    ("halt", "bench.bench_halt"),
    ("concurrency", "bench.bench_concurrency"),
    ("reconstruct", "bench.bench_reconstruct"),
)
KEYS = ("name", "value", "reference", "ratio", "spread", "target", "met")
RESULTS = Path(__file__).resolve().parent / "results.json"


def run_one(name: str, module: str, quick: bool, *, capture: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Run one benchmark module as a child process; (rows, error or None).

    With ``capture`` its output is printed in one piece when it ends (benchmarks running side
    by side), else as it comes.
    """
    t0 = time.monotonic()
    header = f"\n=== {name} ({module}{' --quick' if quick else ''}) ==="
    if not capture:
        print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", module, "--result-file", str(out)]
        if quick:
            argv.append("--quick")
        child = subprocess.run(  # noqa: S603 - our modules
            argv, cwd=Path(__file__).resolve().parent.parent, check=False, text=True,
            stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None,
        )
        if capture:
            print(f"{header}\n{child.stdout.rstrip()}", flush=True)
        print(f"=== {name}: {time.monotonic() - t0:.0f}s ===", flush=True)
        if child.returncode != 0 or not out.is_file():
            return [], f"{module} exited with status {child.returncode}"
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
    parser.add_argument("--jobs", type=int, default=None,
                        help="benchmarks run side by side (default 3 with --quick, else 1)")
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in BENCHMARKS], help="run only these")
    args = parser.parse_args()
    jobs = max(1, args.jobs if args.jobs is not None else 3 if args.quick else 1)
    selected = [(n, m) for n, m in BENCHMARKS if not args.only or n in args.only]
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(lambda nm: run_one(*nm, args.quick, capture=jobs > 1), selected))
    for got, error in outcomes:  # the table keeps the benchmarks' order, whichever ended first
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
