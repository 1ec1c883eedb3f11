"""Auditing a file of reconstructed samples offline: failures by code, one verdict per line."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from schemas import SampleReconstructed
from services.audit.checks import REPORT_ONLY
from services.audit.core import ThresholdsFor, audit_batch, failure_message
from services.profiles import ProfileLike


@dataclass
class OfflineReport:
    """Failures by code over a file of samples: counts and one example key each."""

    total: int = 0
    passed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)  # report-only codes with a difference
    # One verdict per sample, in input order: (line, key, passed, reasons, message).
    verdicts: list[tuple[int, str, bool, list[str], str]] = field(default_factory=list)

    def add_failure(self, code: str, key: str, message: str) -> None:
        """Count one failure of ``code`` for sample ``key``."""
        self.failures[code] = self.failures.get(code, 0) + 1
        self.examples.setdefault(code, key)
        self.messages.setdefault(code, message)

    @property
    def failed(self) -> int:
        """Samples that failed at least one check (or could not be read)."""
        return self.total - self.passed


def offline_audit(
    lines: Iterable[bytes],
    profiles: Callable[[str], ProfileLike],
    thresholds: ThresholdsFor,
    *,
    profile_override: str | None = None,
    batch_size: int = 256,
) -> OfflineReport:
    """Run the checks over JSONL lines of SampleReconstructed, in batches per profile.

    ``profiles`` raises any exception for an unknown name; that sample counts under
    ``unknown_profile``. A line that does not decode counts under its SchemaError reason.
    """
    from schemas import SchemaError, decode

    report = OfflineReport()
    pending: dict[str, list[tuple[int, SampleReconstructed]]] = {}

    def flush(name: str) -> None:
        batch = pending.pop(name, [])
        if not batch:
            return
        try:
            profile = profiles(name)
        except Exception as exc:  # noqa: BLE001 - reported per sample, the audit goes on
            for n, s in batch:
                key = f"{s.dataset}:{s.sample_id}"
                report.add_failure("unknown_profile", key, f"{name!r}: {exc}")
                report.verdicts.append((n, key, False, ["unknown_profile"], f"{name!r}: {exc}"))
            return
        for (n, _), result in zip(batch, audit_batch([s for _, s in batch], profile, thresholds), strict=True):
            key = f"{result.dataset}:{result.sample_id}"
            if result.passed:
                report.passed += 1
            report.verdicts.append((n, key, result.passed, list(result.reasons), failure_message(result)))
            for r in result.results:
                if not r.passed and r.code not in REPORT_ONLY:
                    report.add_failure(r.code, key, r.message)
                elif r.code in REPORT_ONLY and r.value:
                    report.notes[r.code] = report.notes.get(r.code, 0) + 1

    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        report.total += 1
        try:
            sample = decode(line, SampleReconstructed)
        except SchemaError as exc:
            report.add_failure(exc.reason, f"line {n}", exc.message)
            report.verdicts.append((n, f"line {n}", False, [exc.reason], exc.message))
            continue
        name = profile_override or sample.profile
        pending.setdefault(name, []).append((n, sample))
        if len(pending[name]) >= batch_size:
            flush(name)
    for name in list(pending):
        flush(name)
    report.verdicts.sort(key=lambda v: v[0])
    return report
