"""``draftstream probe``: pay for a few answers per dataset before the spend, and judge them.

The answers go the inference worker's own way (:class:`~services.inference.answers.Answerer`):
the halt gate, a ``RequestStarted`` on ``requests`` and the ``ResponseReceived`` on
``responses`` and the response store, so the budget counts the probe's spend, a prompt the
store already answered is not paid again, and the run later reuses the probe's answers
(the probe takes the first ``n`` prompts of the dataset's topic, which the run reaches
too). Each answer is then rebuilt and audited here with the reconstruct and audit cores
(the pipeline's stages, when running, judge the same answers again: it costs nothing).

A dataset that stands halted is not probed (the gate would hold every request): it is
reported, and the command exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence

import httpx
from aiokafka import AIOKafkaProducer

from schemas import Halt, PromptPublished, ResponseReceived, SchemaError, decode
from services.audit.app import default_profile_loader
from services.audit.core import audit_batch
from services.common.acls import used_topics
from services.common.config import Settings
from services.common.errors import CommandError
from services.common.halts import HaltFollower
from services.common.kafka import ensure_topics, make_producer
from services.common.records import DeadLetter
from services.common.service import release
from services.common.topics import Record, read_to_end
from services.inference.adapters.providers import Provider, make_provider
from services.inference.adapters.transport import make_http_client
from services.inference.answers import Answerer
from services.inference.calls import ProviderCall
from services.inference.core import request_hash, request_max_tokens, store_key
from services.inference.guard import ProviderGuard
from services.inference.store import ResponseStore, open_store
from services.inference.tool_route import can_write_in_text, rows_lines
from services.probe.core import DatasetReport, Findings, ProbeAnswer, ProbeRun, by_upstream, forecast, summarize
from services.profiles import Profile
from services.profiles.conventions import Convention
from services.reconstruct.app import ProfileCache
from services.reconstruct.facts import STRIPS_PLACE, FactBook
from services.reconstruct.reencode import prompt_ids_of
from services.reconstruct.verify import reconstruct_with_facts

log = logging.getLogger(__name__)

PROBE_ACTOR = "probe"
"""The ``by`` of a halt ``[inference] probe_first`` publishes for a dataset below ``min_yield``."""


class ProbeError(CommandError):
    """The probe cannot run (no response store to read its answers back from)."""


async def first_prompts(settings: Settings, dataset: str, n: int) -> tuple[list[Record], int]:
    """The first ``n`` prompt records of the dataset's topic (lowest offsets first) and how many it holds."""
    records: list[Record] = []
    await read_to_end(settings.kafka, settings.kafka.prompts_topic(dataset), records.append)
    records.sort(key=lambda r: (r.offset, r.partition))
    return records[:n], len(records)


def judge(
    settings: Settings, responses: Sequence[ResponseReceived], book: FactBook | None = None
) -> list[ProbeAnswer]:
    """Rebuild and audit responses with the reconstruct and audit cores (CPU work: run it in a thread).

    The answers are one batch, as the reconstruct stage would take them: with ``book``, what they
    prove about their upstreams (a ``strips_at_edges`` fact above all) is gathered from all of them
    before any is judged, and left in ``book``.
    """
    profiles = ProfileCache(settings)
    audit_profiles = default_profile_loader(settings)
    out: list[ProbeAnswer | None] = [None] * len(responses)
    groups: dict[tuple[str, Convention], list[int]] = {}
    for index, response in enumerate(responses):
        groups.setdefault((profiles.profile_name(response), profiles.convention(response)), []).append(index)
    for (name, convention), members in groups.items():
        profile = profiles.get(name)
        if not isinstance(profile, Profile):
            for index in members:
                out[index] = ProbeAnswer(responses[index], dead_reason=profile.reason)
            continue
        group = [responses[i] for i in members]
        rebuilt, _ = reconstruct_with_facts(group, profile, convention, book)
        prompts = prompt_ids_of(group, profile, convention)
        for index, verdict, prompt in zip(members, rebuilt, prompts, strict=True):
            if isinstance(verdict, DeadLetter):
                length = len(prompt) if prompt is not None else None
                out[index] = ProbeAnswer(responses[index], dead_reason=verdict.reason, prompt_length=length)
                continue
            audited = audit_batch([verdict], audit_profiles(name), lambda d: settings.dataset(d).audit)[0]
            out[index] = ProbeAnswer(responses[index], sample=verdict, audited=audited)
    return [answer for answer in out if answer is not None]


class Prober:
    """The inference worker's parts, wired once for the probe: store, gate, request records, calls."""

    def __init__(self, settings: Settings, *, http_client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self._http = http_client
        self._own_http = http_client is None
        self._stopping = asyncio.Event()
        self.halts = HaltFollower(settings.kafka, self._stopping, provider=settings.provider.label)
        self._producers: tuple[AIOKafkaProducer, ...] = ()  # made in start(): none when attached
        self.answerer: Answerer | None = None

    async def start(self) -> None:
        """Connect, load the halts and the response store."""
        settings = self.settings
        await ensure_topics(settings.kafka, settings.datasets, needed=used_topics("inference"))
        self._http = self._http or make_http_client(settings)
        provider = make_provider(settings, self._http)
        self.provider = provider
        producer, announcer = self._producers = (make_producer(settings.kafka), make_producer(settings.kafka))
        await asyncio.gather(producer.start(), announcer.start())
        await self.halts.start(producer)
        store = await open_store(settings, producer)
        if store is None:
            raise ProbeError("the probe reads its answers from the response store: set [inference] reuse_responses")
        self.store = store
        guard = ProviderGuard(settings, provider, self.halts)
        worker = f"probe-{socket.gethostname()}-{os.getpid()}"
        call = ProviderCall(settings, provider, announcer, self.halts, guard, worker)
        self.answerer = Answerer(settings, provider, producer, call, guard, store, repay=False)

    @classmethod
    def attached(
        cls, settings: Settings, answerer: Answerer, store: ResponseStore, provider: Provider, halts: HaltFollower
    ) -> Prober:
        """A prober on a running inference worker's own parts (``[inference] probe_first``); not started or closed."""
        prober = cls(settings)
        prober.answerer, prober.store, prober.provider, prober.halts = answerer, store, provider, halts
        return prober

    async def close(self) -> None:
        """Release every client."""
        self._stopping.set()
        await self.halts.close()
        if getattr(self, "store", None) is not None:
            await self.store.close()
        await release(*self._producers, self._http if self._own_http else None)

    async def probe(self, dataset: str, n: int) -> DatasetReport:
        """Pay for (or reuse) the answers to the dataset's first ``n`` prompts and report on them."""
        answerer = self.answerer
        if answerer is None:
            raise RuntimeError("start() the prober first")
        records, total = await first_prompts(self.settings, dataset, n)
        tools = await asyncio.to_thread(self.tool_lines, dataset, records)
        for line, sound in tools:  # said before the probe pays for an answer
            log.log(logging.INFO if sound else logging.WARNING, "probe %s: %s", dataset, line)
        paid_before = answerer.responded
        await asyncio.gather(*(answerer.answer(r) for r in records))
        responses = [r for r in [await self._stored(record) for record in records] if r is not None]
        book = FactBook()
        answers = await asyncio.to_thread(judge, self.settings, responses, book)
        strips = tuple(sorted(f"{upstream} (evidence {fact.evidence}: {fact.reason})" for (upstream, place), fact
                              in book.facts.items() if place == STRIPS_PLACE))  # fmt: skip
        dataset_settings = self.settings.dataset(dataset)
        profile = ProfileCache(self.settings).get(dataset_settings.profile)
        prompt_offset = dataset_settings.audit.prompt_usage_offset or 0  # as the audit's prompt_matches

        def findings_of(group: Sequence[ProbeAnswer]) -> Findings:
            return summarize(
                group,
                think_start=profile.think_start if isinstance(profile, Profile) else None,
                think_end=profile.think_end if isinstance(profile, Profile) else None,
                end_of_turn=profile.end_of_turn if isinstance(profile, Profile) else "",
                end_of_turn_id=profile.end_of_turn_id if isinstance(profile, Profile) else -1,
                logprobs_asked=self.settings.provider.request_logprobs,
                prompt_offset=prompt_offset,
            )

        findings = findings_of(answers)
        upstreams = {name: findings_of(group) for name, group in by_upstream(answers).items()}
        return DatasetReport(
            dataset=dataset,
            findings=findings,
            upstreams=upstreams,
            forecast=forecast(findings, total),
            requests_sent=answerer.responded - paid_before,
            profile=dataset_settings.profile,
            prompt_offset=prompt_offset,
            strips=strips,
            tools=tuple(line for line, _ in tools),
            tools_unproven=not all(sound for _, sound in tools),
        )

    def tool_lines(self, dataset: str, records: Sequence[Record]) -> list[tuple[str, bool]]:
        """By which route the probed prompts' tools travel, and whether their calls can be proven."""
        prompts = [p for p in (_prompt(r) for r in records) if p is not None and p.tools]
        if not prompts:
            return []
        profile = ProfileCache(self.settings).get(self.settings.dataset(dataset).profile)
        in_text = isinstance(profile, Profile) and can_write_in_text(lambda m, t: profile.render_prompt(m, t))
        own = sum(1 for p in prompts if p.tools_in_text)
        return rows_lines(self.settings, dataset, in_text=in_text, fielded=len(prompts) - own, own_text=own)

    async def _stored(self, record: Record) -> ResponseReceived | None:
        """The response the store holds for a prompt record (None: it ended as a dead letter)."""
        prompt = _prompt(record)
        if prompt is None:
            return None
        dataset = self.settings.dataset(prompt.dataset)
        max_tokens = request_max_tokens(prompt, dataset.max_tokens)
        digest = request_hash(self.provider.request_identity(prompt, dataset, max_tokens=max_tokens))
        return await self.store.get(store_key(prompt.dataset, prompt.sample_id, digest))


def _prompt(record: Record) -> PromptPublished | None:
    try:
        return decode(record.value, PromptPublished)
    except SchemaError:
        return None


async def run_probe(
    settings: Settings,
    datasets: Sequence[str] | None = None,
    n: int = 20,
    *,
    http_client: httpx.AsyncClient | None = None,
) -> ProbeRun:
    """Probe each dataset (default: every configured one) with at most ``n`` paid answers."""
    names = list(datasets or sorted(settings.datasets))
    prober = Prober(settings, http_client=http_client)
    run = ProbeRun()
    try:
        await prober.start()
        for name in names:
            standing = prober.halts.standing(name) or prober.halts.standing("global")
            if standing is not None:
                run.skipped[name] = f"halted by {standing.by}: {standing.reason}"
                continue
            run.reports.append(await prober.probe(name, n))
    finally:
        await prober.close()
    return run


async def probe_first(
    settings: Settings, answerer: Answerer, store: ResponseStore, provider: Provider, halts: HaltFollower
) -> list[DatasetReport]:
    """``[inference] probe_first``: probe every configured dataset not halted; halt those below ``min_yield``."""
    prober = Prober.attached(settings, answerer, store, provider, halts)
    reports: list[DatasetReport] = []
    for name in sorted(settings.datasets):
        if halts.is_halted(name):
            continue
        report = await prober.probe(name, settings.inference.probe_first)
        reports.append(report)
        found = report.findings
        top = ", ".join(f"{code} {n}" for code, n in found.reasons.most_common(3)) or "-"
        log.info("probe %s: %d of %d answers accepted (%d paid); reasons of the rest: %s",
                 name, found.accepted, found.answers, report.requests_sent, top)
        for caught in report.strips:
            log.warning("probe %s: an upstream loses whitespace its convention says it keeps (strips_at_edges): %s; "
                        "the reconstruct stage judges it as stripping from these answers on: set [provider] "
                        "convention", name, caught)
        mismatch = report.tokenizer_mismatch
        if mismatch is not None:
            log.error("probe %s: %s", name, mismatch)
            await halts.publish(Halt(scope=name, reason=mismatch, by=PROBE_ACTOR, at=time.time()))
        elif report.below(settings.budget.min_yield):
            reason = (
                f"probe: {found.accepted} of {found.answers} answers accepted ({found.share:.0%}), below min_yield "
                f"{settings.budget.min_yield:.0%}; top reasons: {top}"
            )
            await halts.publish(Halt(scope=name, reason=reason, by=PROBE_ACTOR, at=time.time()))
    return reports
