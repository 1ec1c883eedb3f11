"""One prompt, one outcome: the latest dead letter per key, as a stage -> reason -> count tally.

A replayed record that fails again writes a new dead letter under the same key; one that is
accepted lands on ``accepted`` under it. Either supersedes the dead letter before it, so a
count of dead letters by reason counts each key once, by its latest failure, and not at all
once it was accepted. The budget keeps this tally (and the keys standing) in its checkpoints;
``status`` folds in what arrived since. Pure: no Kafka.

A record without a key cannot be superseded: it is counted as it is.
"""

from __future__ import annotations

Tally = dict[str, dict[str, int]]
"""stage -> primary reason -> dead-lettered keys."""
Standing = dict[str, tuple[str, str]]
"""key -> (stage, reason) of its latest dead letter, for the keys whose latest outcome is one."""


def _take(tally: Tally, standing: Standing, key: str) -> bool:
    """Remove ``key``'s standing dead letter from the tally; whether it had one."""
    earlier = standing.pop(key, None)
    if earlier is None:
        return False
    stage, reason = earlier
    reasons = tally.get(stage, {})
    left = reasons.get(reason, 0) - 1
    if left > 0:
        reasons[reason] = left
    else:
        reasons.pop(reason, None)
        if not reasons:
            tally.pop(stage, None)
    return True


def record_dead_letter(tally: Tally, standing: Standing, key: str, stage: str, reason: str) -> bool:
    """Count a dead letter as ``key``'s outcome; True when it supersedes an earlier one (a replay failed again)."""
    again = _take(tally, standing, key) if key else False
    reasons = tally.setdefault(stage, {})
    reasons[reason] = reasons.get(reason, 0) + 1
    if key:
        standing[key] = (stage, reason)
    return again


def record_accepted(tally: Tally, standing: Standing, key: str) -> bool:
    """An accepted sample is ``key``'s outcome; True when it supersedes a dead letter (a replay succeeded)."""
    return _take(tally, standing, key) if key else False


__all__ = ["Standing", "Tally", "record_accepted", "record_dead_letter"]
