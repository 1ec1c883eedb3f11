"""The audit's verdict over reconstructed samples: every check of ``checks``, run in batches.

The tokenizer work of a batch is two calls (decode every in-vocab output, re-encode the
texts); each sample then gets its check results and a :class:`~schemas.SampleAudited`
naming every failing code. No Kafka, no clock, no environment here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schemas import CheckResult, SampleAudited, SampleReconstructed
from services.audit.checks import (
    CHECK_CODES,
    CHECKS,
    REPORT_ONLY,
    TRUNCATED_ACCEPTED,
    Prepared,
    Thresholds,
    ids_within,
    mismatch_fraction,
)
from services.audit.toolblocks import parse_tool_tokens, tool_token_roles
from services.profiles import ProfileLike


def run_checks(p: Prepared, profile: ProfileLike) -> list[CheckResult]:
    """Every enabled, applicable check on one prepared sample, in the fixed order."""
    disabled = set(p.thresholds.disabled_checks)
    results: list[CheckResult] = []
    for code, check in CHECKS:
        if code in disabled:
            continue
        result = check(p, profile)
        if result is not None:
            results.append(result)
    return results


def verdict(
    sample: SampleReconstructed, results: list[CheckResult], audited_at: float = 0.0
) -> SampleAudited:
    """The SampleAudited for a sample and its check results."""
    reasons = [r.code for r in results if not r.passed and r.code not in REPORT_ONLY]
    return SampleAudited(
        dataset=sample.dataset,
        sample_id=sample.sample_id,
        sample=sample,
        passed=not reasons,
        results=results,
        reasons=reasons,
        audited_at=audited_at,
    )


ThresholdsFor = Thresholds | Callable[[str], Thresholds]


def _thresholds(t: ThresholdsFor, dataset: str) -> Thresholds:
    return t(dataset) if callable(t) else t


def _in_vocab(sample: SampleReconstructed, vocab_size: int) -> bool:
    return ids_within(sample.output_ids, vocab_size)


def prepare_batch(
    samples: Sequence[SampleReconstructed], profile: ProfileLike, thresholds: ThresholdsFor
) -> list[Prepared]:
    """Decode every in-vocab output and re-encode the texts, one batch call each."""
    decodable = [i for i, s in enumerate(samples) if _in_vocab(s, profile.vocab_size)]
    texts = profile.decode_batch([list(samples[i].output_ids) for i in decodable]) if decodable else []
    reencoded = profile.encode_batch(list(texts)) if texts else []
    decoded_by: dict[int, tuple[str, list[int]]] = {
        i: (t, list(e)) for i, t, e in zip(decodable, texts, reencoded, strict=True)
    }
    out: list[Prepared] = []
    for i, s in enumerate(samples):
        got = decoded_by.get(i)
        out.append(Prepared(s, _thresholds(thresholds, s.dataset), got[0] if got else None,
                            got[1] if got else None))
    return out


def audit_batch(
    samples: Sequence[SampleReconstructed],
    profile: ProfileLike,
    thresholds: ThresholdsFor,
    *,
    audited_at: float = 0.0,
) -> list[SampleAudited]:
    """Audit samples of one profile; tokenizer work is two batch calls for the whole batch.

    ``thresholds`` is one :class:`Thresholds` or a function from dataset name to it.
    """
    return [
        verdict(p.sample, run_checks(p, profile), audited_at)
        for p in prepare_batch(samples, profile, thresholds)
    ]


def audit(
    sample: SampleReconstructed,
    profile: ProfileLike,
    thresholds: Thresholds,
    *,
    audited_at: float = 0.0,
) -> SampleAudited:
    """Audit one sample against its profile."""
    return audit_batch([sample], profile, thresholds, audited_at=audited_at)[0]


def failure_message(audited: SampleAudited) -> str:
    """One line naming every failing check and why, for the dead-letter message header."""
    return "; ".join(f"{r.code}: {r.message}" if r.message else r.code
                     for r in audited.results if not r.passed and r.code not in REPORT_ONLY)


__all__ = [
    "CHECKS",
    "CHECK_CODES",
    "REPORT_ONLY",
    "TRUNCATED_ACCEPTED",
    "Prepared",
    "Thresholds",
    "ThresholdsFor",
    "audit",
    "audit_batch",
    "failure_message",
    "mismatch_fraction",
    "parse_tool_tokens",
    "prepare_batch",
    "run_checks",
    "tool_token_roles",
    "verdict",
]
