"""One prompt's paid request: the halt gate, the request record, the retry policy, the verdict.

Each attempt waits at the halt gate and at the rate-limit throttle (the adaptive window
and ``Retry-After`` pause of :mod:`services.inference.throttle`), announces itself on ``requests`` (what the budget
counts as in flight) and, once the broker acknowledged, calls the provider. An attempt a
halt holds back before its first byte goes out is withdrawn on ``requests`` (the same
record, ``withheld``) and waits at the gate again. Retries back off exponentially
(with jitter, capped, honouring ``Retry-After``). A 429 is never a dead letter:
it moves the pace (or the window), holds the prompt for its ``Retry-After`` and it waits its turn again, without
using up the attempts other failures have (a storm that admits nothing for
``provider.rate_limit_stall_s`` halts the provider's workers, see the guard). After the last attempt a
failure is one of: the account was refused (halt the provider's workers, wait at the gate, start over), the
provider answers nobody (wait out the outage, start over), or this request's own fault (a
dead letter).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

import msgspec
from aiokafka import AIOKafkaProducer

from schemas import REQUESTS_TOPIC, PromptPublished, RequestStarted, encode, sample_key
from services.budget.usage import completion_tokens_of
from services.common.config import DatasetSettings, Settings
from services.common.halts import HaltFollower, Stopped
from services.common.metrics import INFLIGHT, REQUEST_LATENCY, REQUESTS, RETRIES
from services.common.records import DeadLetter
from services.inference.adapters.providers import Provider
from services.inference.core import (
    NotSent,
    ProviderFailure,
    ProviderResult,
    backoff_for,
    dead_letter_for,
    is_outage_failure,
    is_rate_limited,
    may_be_billed,
    prompt_chars,
    request_started,
)
from services.inference.guard import ProviderGuard
from services.inference.headroom import Headroom

log = logging.getLogger(__name__)

Paid = tuple[ProviderResult, int, float, str]
"""A provider's answer, the attempt that got it, its latency in seconds, the attempt's id."""


def release_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of every exception it was raised from or during.

    An exception raised deep in the HTTP client comes back with tracebacks whose frames
    hold the request's whole object graph, in cycles (a frame holding the exception that
    holds the frame): reference counting never frees them, and each waits for an
    older-generation cycle collection, a long one at 10,000 in flight (a halt withholding
    hundreds of requests at the last moment left ~150 objects each). Without the
    tracebacks they are freed at once. Only for failures whose traceback nobody logs.
    """
    pending: list[BaseException] = [exc]
    seen: list[BaseException] = []
    while pending and len(seen) < 40:
        current = pending.pop()
        if any(current is e for e in seen):
            continue
        seen.append(current)
        current.__traceback__ = None
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


class _Tries:
    """What one prompt's requests used so far, kept when its attempts start over."""

    def __init__(self) -> None:
        # The first outage-class failed request (OutageDetector sequence number): no later
        # request answered at the last attempt means nobody got through.
        self.mark: int | None = None
        self.sent = 0  # requests sent: the attempt number of the next is one more
        self.failed = 0  # failed requests other than 429s: these are bounded by max_attempts
        # The id of the last request sent, when it ended with an error this worker read (the
        # provider billed nothing): the next attempt tells the budget so.
        self.ended = ""


class ProviderCall:
    """Pays for one prompt's answer (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        provider: Provider,
        producer: AIOKafkaProducer,
        halts: HaltFollower,
        guard: ProviderGuard,
        worker_id: str,
        headroom: Headroom | None = None,
    ) -> None:
        self._cfg = settings.provider
        self._provider = provider
        self._producer = producer
        self._halts = halts
        self._guard = guard
        self._worker_id = worker_id
        self._headroom = headroom
        self._requests_topic = settings.kafka.topic(REQUESTS_TOPIC)

    async def pay(self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int) -> Paid | DeadLetter:
        """The answer, or the dead letter when the request itself cannot succeed.

        Raises :class:`Stopped` when the worker stops before a request could be sent.
        """
        tries = _Tries()
        while True:
            try:
                return await self._attempts(prompt, dataset, max_tokens, tries)
            except ProviderFailure as failure:
                if failure.fatal:
                    await self._guard.halt_account(failure)
                    tries.failed = 0
                    continue  # waits at the gate until resumed, then starts over
                if is_rate_limited(failure):
                    if failure.hold_s > 0:  # no pause holds every request: the refused one waits its Retry-After
                        await asyncio.sleep(failure.hold_s)
                    continue  # the run was too fast, not the prompt's fault: wait for the throttle again
                if is_outage_failure(failure) and await self._guard.provider_down(failure):
                    # Not this request's fault: the provider answers nobody. Start over (the
                    # outage halt, once published, holds it at the gate until the provider is back).
                    log.info(
                        "%s: %s after %d attempt(s) while the provider answers nobody; trying again",
                        sample_key(prompt.dataset, prompt.sample_id),
                        failure.reason,
                        failure.attempt,
                    )
                    tries.failed = 0
                    continue
                return dead_letter_for(failure, failure.attempt)
            except NotSent:
                continue  # a halt came before the request went out: back to the gate, nothing paid
            except Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in a provider adapter is one bad prompt
                log.exception("provider adapter failed on %s", sample_key(prompt.dataset, prompt.sample_id))
                return DeadLetter("inference_internal_error", f"{type(exc).__name__}: {exc}")

    def _backoff(self, exc: Exception, attempt: int) -> float | None:
        """Seconds to wait before the next attempt after ``exc``; None: no retry (raise it)."""
        if not isinstance(exc, ProviderFailure) or is_rate_limited(exc):  # a 429 waits at the throttle
            return None
        wait = backoff_for(exc, self._cfg.backoff_max_s)
        if wait is False:
            return None
        if wait is True:  # exponential, capped, with jitter
            cfg = self._cfg
            jitter = random.uniform(0, cfg.backoff_initial_s)  # noqa: S311 - spreading retries, not secrecy
            return float(min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (attempt - 1) + jitter))
        return wait

    async def _attempts(
        self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int, tries: _Tries
    ) -> Paid:
        """One provider call with retries (exponential backoff with jitter, capped; ``Retry-After`` wins).

        The attempts left are those other failures have not used; a 429 ends them at once.
        A plain loop: a retry library's per-call set-up cost more than the rest of a
        request's own bookkeeping, on every request, to serve the few that fail.
        """
        attempts = max(1, self._cfg.max_attempts - tries.failed)
        for attempt in range(1, attempts + 1):
            try:
                return await self._attempt(prompt, dataset, max_tokens, tries)
            except Exception as exc:
                wait = self._backoff(exc, attempt) if attempt < attempts else None
                if wait is None:
                    raise
                log.warning(
                    "%s: attempt %d of %d failed (%s); retrying in %.1f s",
                    sample_key(prompt.dataset, prompt.sample_id), attempt, attempts,
                    getattr(exc, "reason", type(exc).__name__), wait,
                )
                await asyncio.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    async def _attempt(
        self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int, tries: _Tries
    ) -> Paid:
        """One attempt: the gates, the request record, the provider call and what its outcome counts."""
        cfg, provider, outage, throttle = self._cfg, self._provider, self._guard.outage, self._guard.throttle
        scopes, halts = (prompt.dataset,), self._halts

        def may_send() -> bool:
            # Asked by the HTTP client at the last moment before a byte goes out; the halt
            # state is kept current by the control follower's own thread.
            return halts.may_go(*scopes)

        tries.sent += 1
        number = tries.sent
        seq, epoch = await self._admit(prompt, max_tokens)
        try:
            started = await self._announce(prompt, max_tokens, number, epoch, tries.ended)
        except BaseException:
            throttle.release(seq)
            raise
        inflight = INFLIGHT.labels(dataset=prompt.dataset)
        inflight.inc()
        t0 = time.monotonic()
        outage_seq = outage.begin()
        sent = True
        kept = False  # an attempt that may have been billed stays held at its worst case
        result: ProviderResult | None = None
        try:
            result = await provider.complete(prompt, dataset, max_tokens=max_tokens, may_send=may_send)
        except NotSent as withheld:
            release_frames(withheld)
            sent = False  # withheld at the last moment: no latency, no outcome to count
            throttle.release(seq)
            await self._withdraw(started)
            raise
        except ProviderFailure as failure:
            release_frames(failure)
            failure.attempt = number
            kept = may_be_billed(failure)
            tries.ended = "" if kept else started.attempt_id  # the next attempt releases it when nothing was billed
            REQUESTS.labels(provider=provider.name, outcome=failure.reason).inc()
            if is_rate_limited(failure):
                failure.hold_s = throttle.refused(
                    seq, failure.retry_after_s, failure.upstream, failure.stated_rps, failure.stated_count
                )
                if throttle.stalled():
                    await self._guard.halt_rate_limit()
            else:
                if failure.http_status is not None:  # a status came back: the rate limit admitted it
                    throttle.answered(failure.upstream, None, seq)
                else:
                    throttle.release(seq)
                tries.failed += 1
            if failure.retryable and (is_rate_limited(failure) or tries.failed < cfg.max_attempts):
                RETRIES.labels(provider=provider.name, reason=failure.reason).inc()
            if is_outage_failure(failure) and tries.mark is None:
                tries.mark = outage_seq
            failure.answered_mark = tries.mark
            if outage.failure(failure, outage_seq):
                await self._guard.halt_outage()
            raise
        except BaseException:
            throttle.release(seq)  # cancelled: the request's place goes to the next
            raise
        finally:
            if kept:
                self._keep(started)
            else:
                self._settle(started, result)
            latency = time.monotonic() - t0
            inflight.dec()
            if sent:
                REQUEST_LATENCY.labels(provider=provider.name).observe(latency)
        throttle.answered(result.upstream_provider, result.usage.completion_tokens, seq)
        REQUESTS.labels(provider=provider.name, outcome="ok").inc()
        outage.success(outage_seq)
        return result, number, latency, started.attempt_id

    async def _admit(self, prompt: PromptPublished, max_tokens: int) -> tuple[int, str]:
        """Pass the halt gate, room under the caps, then the throttle; the throttle sequence and lease epoch.

        Room under the caps comes first: a request waiting for headroom holds neither a provider
        slot nor a place in the throttle's window, so it never keeps another dataset's request
        from going (a place held while waiting for a lease, with that dataset's requests holding
        the slots the lease's requests need, would leave both waiting for good). A halt that lands
        while the throttle holds the request back sends it to the gate again and gives its room
        and its place up (other datasets' requests may go meanwhile).
        """
        throttle = self._guard.throttle
        tokens = throttle.tokens_estimate(prompt_chars(prompt), max_tokens) if throttle.counts_tokens else 0
        key = sample_key(prompt.dataset, prompt.sample_id)
        while True:
            if self._headroom is None:
                await self._halts.gate(prompt.dataset)
                epoch = ""
            else:  # the halt gate, then room under the caps (this worker's lease)
                epoch = await self._headroom.admit(prompt.dataset, key, max_tokens)
            try:
                seq = await throttle.admit(tokens)
            except BaseException:
                self._give_back_room(key)
                raise
            if self._halts.may_go(prompt.dataset):
                return seq, epoch
            throttle.release(seq)
            self._give_back_room(key)

    def _give_back_room(self, key: str) -> None:
        if self._headroom is not None:
            self._headroom.settle(key, None)

    async def _announce(
        self, prompt: PromptPublished, max_tokens: int, attempt: int, epoch: str, ended: str
    ) -> RequestStarted:
        """Publish the RequestStarted record the budget counts in flight (room and place already had).

        The attempt gets an id of its own (the budget holds it until the answer naming that id
        arrives); ``ended``: the id of this prompt's previous attempt here that ended with an error.

        A halt that arrives while the broker acknowledges is caught by ``may_send``, asked
        before the client is called: the attempt is withdrawn and goes back to the gate.
        """
        key = sample_key(prompt.dataset, prompt.sample_id)
        started = request_started(
            prompt, max_tokens=max_tokens, worker=self._worker_id, attempt=attempt, now=time.time()
        )
        started.lease_epoch = epoch
        started.attempt_id = uuid.uuid4().hex
        started.supersedes = ended
        started.provider_name = self._cfg.label
        try:
            await (await self._producer.send(self._requests_topic, encode(started), key=key.encode()))
        except BaseException:
            self._settle(started, None)
            raise
        return started

    def _settle(self, started: RequestStarted, result: ProviderResult | None) -> None:
        """Hand the lease what the request used: its answer's tokens, or nothing when unanswered."""
        if self._headroom is not None:
            used = None if result is None else completion_tokens_of(result)
            self._headroom.settle(sample_key(started.dataset, started.sample_id), used)

    def _keep(self, started: RequestStarted) -> None:
        """Keep an attempt that may have been billed in the lease's consumption for good, as the budget does."""
        if self._headroom is not None:
            self._headroom.keep(sample_key(started.dataset, started.sample_id), started.attempt_id)

    async def _withdraw(self, started: RequestStarted) -> None:
        """Tell the budget (and any reader of ``requests``) that an announced request was never sent."""
        key = sample_key(started.dataset, started.sample_id).encode()
        withheld = msgspec.structs.replace(started, withheld=True)
        await (await self._producer.send(self._requests_topic, encode(withheld), key=key))
