"""Whether paying is safe: pre-flight checks, outage halts and their probe, refused accounts.

Before the first paid request every dataset's profile and the provider are checked; a
failure halts the scope on ``control`` instead of paying for answers that cannot be
used, and a halt the check published earlier is lifted once it passes. An outage
(``provider.outage_after`` connection errors, timeouts, 5xx or 404s in a row) halts the
provider (scope ``provider:<name>``: every worker of this provider, and no other) instead of
draining the topic into dead letters; a probe resumes by itself when the provider answers
again. A rate limit that admits nothing (only 429s for ``provider.rate_limit_stall_s``) halts
the provider the same way, and the probe sends one request of a single token now and then
until the limit admits it. A 401/402 halts the provider until a person resumes. A worker
whose provider is halted leaves the consumer group meanwhile (services/inference/app.py).
A provider that does not implement the check (``GET /models`` answering 404, 405 or 501)
but serves its completion endpoint is unknown, not down: pre-flight goes on and the first real request decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from aiokafka.errors import KafkaError

from schemas import Halt, Message, PromptPublished, Resume, provider_scope
from services.common.config import DatasetSettings, Settings
from services.common.halts import HaltFollower
from services.common.metrics import PROVIDER_OUTAGES
from services.common.plan import plan_lines
from services.common.service import release
from services.inference.adapters.providers import Provider
from services.inference.core import (
    OUTAGE_ACTOR,
    PREFLIGHT_ACTOR,
    RATE_LIMIT_ACTOR,
    STAGE,
    OutageDetector,
    ProviderCheck,
    ProviderFailure,
    is_rate_limited,
    outage_reason,
)
from services.inference.throttle import ProviderThrottle
from services.inference.tool_route import PARSED_ADVICE, can_write_in_text, dataset_route, provable, route_line
from services.profiles import Profile

log = logging.getLogger(__name__)

PROBE_DATASET = "rate-limit-probe"
"""The dataset name of the rate-limit probe's request (sample key ``rate-limit-probe:rate-limit``)."""


class ProviderGuard:
    """The checks and halts around the provider that no single prompt owns."""

    def __init__(self, settings: Settings, provider: Provider, halts: HaltFollower) -> None:
        self._settings = settings
        self._provider = provider
        self._halts = halts
        # Outage, pre-flight, account and rate-limit halts pause this provider's workers only.
        self.scope = provider_scope(settings.provider.label)
        self.outage = OutageDetector(settings.provider.outage_after)
        self.throttle = ProviderThrottle(settings.provider, provider.name)
        self._rate_limit_published = False
        self.preflight: dict[str, ProviderCheck] = {}
        self._checked: dict[str, bool] = {}
        self._parsed_tools_said: set[str] = set()  # datasets told their tools go through the server's parser
        self._completions_check: ProviderCheck | None = None
        self._check_lock = asyncio.Lock()
        self._outage_published = False
        self._account_halt_published = False
        self._probe: asyncio.Task[None] | None = None
        halts.listeners.append(self._on_halts_changed)

    def _on_halts_changed(self) -> None:
        if self._halts.standing(self.scope) is None:
            self._account_halt_published = False
            if self._rate_limit_published:  # resumed (by the probe, another worker or a person)
                self._rate_limit_published = False
                self.throttle.unstall()

    # --- pre-flight ---------------------------------------------------------------------

    async def check_all(self) -> None:
        """Say what each dataset will do; check its profile, then the provider itself (reachable, key, model)."""
        for line in plan_lines(self._settings):
            log.info("pre-flight: %s", line)
        for name in sorted(self._settings.datasets):
            await self.check_dataset(name)
        check = await self._provider.check()
        self.preflight[self.scope] = check
        base = self._settings.provider.base_url
        self.throttle.stated(check.rate_limit_rps)
        if check.ok:
            if check.unknown:
                log.warning("pre-flight: provider %s at %s: %s", self._provider.name, base, check.detail)
            else:
                log.info("pre-flight: provider %s at %s answers: %s", self._provider.name, base, check.detail or "ok")
            await self._resume_own(self.scope, (PREFLIGHT_ACTOR, OUTAGE_ACTOR), "pre-flight passed")
            return
        log.error("pre-flight: provider %s at %s: %s", self._provider.name, base, check.message)
        standing = self._halts.standing(self.scope)
        if standing is not None and standing.by not in (PREFLIGHT_ACTOR, OUTAGE_ACTOR):
            return  # a person's or the budget's halt stands already; it is not replaced
        by = OUTAGE_ACTOR if check.outage else PREFLIGHT_ACTOR
        halt = Halt(scope=self.scope, reason=f"pre-flight: {check.message}", by=by, at=time.time())
        await self._halts.publish(halt)
        if check.outage:
            self._outage_published = True

    def checked(self, name: str) -> bool:
        """Whether ``name``'s profile was checked already (passed or not)."""
        return name in self._checked

    async def check_dataset(self, name: str) -> bool:
        """Load and verify the dataset's profile once; halt the dataset when it cannot be used."""
        async with self._check_lock:
            if name in self._checked:
                return self._checked[name]
            from services.profiles import load_profile

            profile = self._settings.dataset(name).profile
            try:
                loaded = await asyncio.to_thread(load_profile, profile, self._settings)
            except Exception as exc:  # noqa: BLE001 - any failure to load means: do not pay for it
                code = getattr(exc, "reason", type(exc).__name__)
                message = f"pre-flight: dataset {name}: profile {profile!r} cannot be used ({code}): {exc}"
                self.preflight[name] = ProviderCheck(ok=False, reason=str(code), message=message)
                self._checked[name] = False
                await self._halt_dataset(name, message)
                return False
            await asyncio.to_thread(self._say_tool_route, name, loaded)
            if self._settings.mode_of(self._settings.dataset(name)) == "completions":
                refused = await self._completions_refused(name)
                if refused is not None:
                    self.preflight[name], self._checked[name] = refused, False
                    return False
            self.preflight[name] = ProviderCheck(ok=True, detail=f"profile {profile} loaded")
            self._checked[name] = True
            await self._resume_own(name, (PREFLIGHT_ACTOR,), f"pre-flight passed: profile {profile} loads")
            return True

    def _say_tool_route(self, name: str, profile: Profile) -> None:
        """By which route the dataset's tools travel; a warning where their calls cannot be proven."""
        in_text = can_write_in_text(lambda m, t: profile.render_prompt(m, t))
        line = route_line(self._settings, name, in_text=in_text, ahead=True)
        dataset = self._settings.dataset(name)
        if provable(self._settings, dataset, dataset_route(self._settings, dataset, in_text=in_text)):
            log.info("pre-flight: %s", line)
        else:
            self._parsed_tools_said.add(name)
            log.warning("pre-flight: %s", line)

    def parsed_tools(self, name: str) -> None:
        """A prompt of ``name`` goes with the ``tools`` parameter: said once, unless its pre-flight said it."""
        if name not in self._parsed_tools_said:
            self._parsed_tools_said.add(name)
            log.warning("dataset %s: a prompt's tools go as the tools parameter, through the server's tool parser "
                        "(its template could not write them into the system text): %s", name, PARSED_ADVICE)

    async def _completions_refused(self, name: str) -> ProviderCheck | None:
        """Completions mode: halt ``name`` when the provider refuses its text-completions endpoint.

        The endpoint is asked once per worker (one 1-token request); the answer holds for
        every dataset in completions mode.
        """
        if self._completions_check is None:
            self._completions_check = await self._provider.check_completions()
        check = self._completions_check
        log.info("pre-flight: completions mode: %s", check.message or check.detail)
        if check.ok:
            return None
        message = f"pre-flight: dataset {name}: {check.message}"
        await self._halt_dataset(name, message)
        return ProviderCheck(ok=False, reason=check.reason, message=message)

    async def _halt_dataset(self, name: str, message: str) -> None:
        """Halt one dataset for a pre-flight failure, unless someone else's halt stands."""
        standing = self._halts.standing(name)
        if standing is None or standing.by == PREFLIGHT_ACTOR:
            await self._halts.publish(Halt(scope=name, reason=message, by=PREFLIGHT_ACTOR, at=time.time()))

    async def _resume_own(self, scope: str, actors: tuple[str, ...], reason: str) -> None:
        """Lift a standing halt of ``scope`` when one of ``actors`` published it (never a person's)."""
        standing = self._halts.standing(scope)
        if standing is not None and standing.by in actors:
            await self._halts.publish(Resume(scope=scope, reason=reason, by=PREFLIGHT_ACTOR, at=time.time()))

    # --- during the run -----------------------------------------------------------------

    async def halt_account(self, failure: ProviderFailure) -> None:
        """A 401/402 means no prompt of this provider can succeed: halt it until a person resumes."""
        halt = Halt(
            scope=self.scope,
            reason=f"provider HTTP {failure.http_status}: {failure.message[:300]}",
            by=STAGE,
            at=time.time(),
        )
        self._halts.apply(halt)
        if self._account_halt_published:
            return
        self._account_halt_published = True
        log.error("provider refused the account (HTTP %s): halting %s", failure.http_status, self.scope)
        await self._halts.send(halt)

    async def halt_outage(self) -> None:
        """Enough outage-class failures in a row: halt the provider (the probe resumes)."""
        if self._outage_published:
            return
        standing = self._halts.standing(self.scope)
        self._outage_published = True
        reason = outage_reason(self.outage, self._settings.provider.base_url)
        PROVIDER_OUTAGES.labels(reason=self.outage.last.reason if self.outage.last else "unknown").inc()
        if standing is not None:
            log.error("provider outage while %s is halted already: %s", self.scope, reason)
            return
        await self._halts.publish(Halt(scope=self.scope, reason=reason, by=OUTAGE_ACTOR, at=time.time()))

    async def halt_rate_limit(self) -> None:
        """Nothing but 429s for ``provider.rate_limit_stall_s``: halt the provider (the probe resumes)."""
        if self._rate_limit_published:
            return
        self._rate_limit_published = True
        limits, cfg = self.throttle.limits, self._settings.provider
        reason = (
            f"rate limit at {cfg.base_url}: nothing admitted for {cfg.rate_limit_stall_s:g} s "
            f"([provider] rate_limit_stall_s), {limits.stall.refusals} x HTTP 429 in a row, window "
            f"{limits.limit}; resumes by itself when a probe request is admitted"
        )
        if self._halts.standing(self.scope) is not None:
            log.error("%s (while %s is halted already)", reason, self.scope)
            return
        await self._halts.publish(Halt(scope=self.scope, reason=reason, by=RATE_LIMIT_ACTOR, at=time.time()))

    async def provider_down(self, failure: ProviderFailure) -> bool:
        """After a prompt's last attempt failed with a connection error, timeout, 5xx or 404:
        is the provider down (wait for it), or is the failure this request's own (dead letter)?

        Down while the provider's halt stands. Up when a request sent after this prompt's first
        failure was answered. Otherwise a free check (``GET /models``, OpenRouter ``GET /key``)
        decides; a failed check counts towards the outage halt. A provider without the check
        (``unknown``) tells nothing: the failure is the request's own, and the failed requests
        themselves count towards the outage halt.
        """
        if self._halts.standing(self.scope) is not None:
            return True
        if not self.outage.nobody_answered_since(failure):
            return False
        seq = self.outage.begin()
        try:
            check = await self._provider.check()
        except Exception:  # noqa: BLE001 - a check that crashes says nothing about the provider
            log.exception("provider check failed")
            return False
        if check.unknown:
            return False
        if check.ok:
            self.outage.success(seq)
            return False
        probe = ProviderFailure(reason=check.reason or "provider_connection", message=check.message, retryable=True)
        if check.outage and self.outage.failure(probe, seq):
            await self.halt_outage()
        return check.outage

    def start_probe(self) -> None:
        """Probe the provider in the background while an outage halt stands."""
        self._probe = asyncio.create_task(self._probe_loop(), name="inference-probe")

    async def close(self) -> None:
        """Stop the probe and the throttle's timer."""
        await release(self._probe)
        self.throttle.close()

    async def _probe_loop(self) -> None:
        """While an outage halt stands, check the provider every few seconds; resume when it answers."""
        interval = self._settings.provider.probe_interval_s
        while True:
            await asyncio.sleep(interval)
            standing = self._halts.standing(self.scope)
            if standing is None and self.throttle.stalled() and self.throttle.waiting:
                # A long Retry-After: no 429 comes to notice the stall, but requests wait for it.
                await self._halt_quietly(self.halt_rate_limit())
                continue
            if standing is not None and standing.by == RATE_LIMIT_ACTOR:
                await self._probe_rate_limit()
                continue
            if standing is None or standing.by != OUTAGE_ACTOR:
                self._outage_published = False if standing is None else self._outage_published
                continue
            try:
                check = await self._provider.check()
            except Exception:  # noqa: BLE001 - a probe that crashes is a probe that failed
                log.exception("provider probe failed")
                continue
            if not check.ok:
                log.warning(
                    "provider still unavailable (%s): %s; next probe in %.0f s", check.reason, check.message, interval
                )
                continue
            # The probe's answer counts as one: a prompt that still fails after it fails
            # on its own (a dead letter), not because the provider is down. A provider without
            # the check (unknown) is resumed with its failure streak kept: the first real
            # request decides, and one more failure halts again at once.
            if not check.unknown:
                self.outage.success(self.outage.begin())
            self._outage_published = False
            said = "the next request decides" if check.unknown else "provider answers again"
            resume = Resume(scope=self.scope, reason=f"{said}: {check.detail or 'ok'}",
                            by=OUTAGE_ACTOR, at=time.time())
            try:
                await self._halts.publish(resume)
            except KafkaError:
                log.exception("could not publish the resume after the outage; retrying")

    async def _halt_quietly(self, publishing: Coroutine[Any, Any, None]) -> None:
        """Publish a halt or resume from the probe loop; a broker failure is retried next round."""
        try:
            await publishing
        except KafkaError:
            log.exception("could not publish on control; retrying")

    async def _probe_rate_limit(self) -> None:
        """While a rate-limit halt stands: one request of a single token; admitted means resume."""
        if self.throttle.limits.wait_s(time.monotonic()) > 0:
            return  # the last Retry-After has not passed yet
        names = sorted(self._settings.datasets)
        dataset = self._settings.dataset(names[0]) if names else DatasetSettings()
        probe = PromptPublished(
            dataset=PROBE_DATASET, sample_id="rate-limit", messages=[Message(role="user", content="Say OK.")]
        )
        try:
            await self._provider.complete(probe, dataset, max_tokens=1)
        except ProviderFailure as failure:
            if is_rate_limited(failure):
                self.throttle.limits.pause.extend(time.monotonic(), failure.retry_after_s or 0.0)
                log.warning("rate limit still admits nothing (%s); next probe in %.0f s",
                            failure.message[:200], self._settings.provider.probe_interval_s)
                return
            # Any other answer is not a rate limit: the outage detector and the prompts judge it.
        except Exception:  # noqa: BLE001 - a probe that crashes is a probe that failed
            log.exception("rate-limit probe failed")
            return
        self.throttle.unstall()
        resume = Resume(scope=self.scope, reason="rate limit admits requests again (probe answered)",
                        by=RATE_LIMIT_ACTOR, at=time.time())
        await self._halt_quietly(self._halts.publish(resume))
