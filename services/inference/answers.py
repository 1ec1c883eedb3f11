"""One prompt record in, its answer out: a paid response, a reused one, or a dead letter.

Money: a request already paid for is never sent again. Every paid response is written
to the compacted ``response-store`` topic under its request key (dataset, sample id and
the hash of the exact request, :mod:`services.inference.store`); a prompt seen again (a
re-publish, a restart, a rebalance, a replay ``--to inference``) is answered from there
and re-published with ``reused=True``, which the budget does not count again. ``--repay``
(or the ``draftstream.inference.repay`` header on a prompt) pays again on purpose. The
same request in flight twice in one worker is paid once: the second waits for the first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaProducer

from schemas import DEAD_LETTER_TOPIC, PROMPTS_TOPIC_PREFIX, RESPONSES_TOPIC, PromptPublished, ResponseReceived, encode
from schemas import sample_key as key_of
from services.common.config import DatasetSettings, Settings
from services.common.kafka import dead_letter_of
from services.common.metrics import DEAD_LETTERS, RESPONSES, RESPONSES_REUSED
from services.common.records import DeadLetter
from services.common.topics import Record
from services.inference.adapters.providers import Provider
from services.inference.calls import Paid, ProviderCall
from services.inference.core import (
    STAGE,
    check_prompt,
    dataset_of_topic,
    request_hash,
    request_max_tokens,
    response_event,
    store_key,
    wants_repay,
)
from services.inference.guard import ProviderGuard
from services.inference.store import ResponseStore

log = logging.getLogger(__name__)


class Answerer:
    """Answers prompt records; every output is acknowledged by the broker before it returns."""

    def __init__(
        self,
        settings: Settings,
        provider: Provider,
        producer: AIOKafkaProducer,
        call: ProviderCall,
        guard: ProviderGuard,
        store: ResponseStore | None,
        *,
        repay: bool,
    ) -> None:
        self._settings = settings
        self._provider = provider
        self._producer = producer
        self._call = call
        self._guard = guard
        self._store = store
        self._repay = repay
        kafka = settings.kafka
        self._prompts_prefix = kafka.topic(PROMPTS_TOPIC_PREFIX)
        self._responses = kafka.topic(RESPONSES_TOPIC)
        self._dead_letters = kafka.topic(DEAD_LETTER_TOPIC)
        self._pending: dict[str, asyncio.Future[None]] = {}
        self.responded = 0
        self.reused = 0
        self.dead_lettered = 0

    def dataset_of(self, topic: str) -> str:
        """The dataset a prompts topic carries ('' for another topic)."""
        return dataset_of_topic(topic, self._prompts_prefix) or ""

    async def answer(self, record: Record, answered: Callable[[], None] = lambda: None) -> None:
        """Publish the answer to one prompt record (see the module docstring).

        ``answered`` is called once the provider's part is over, before publishing.
        """
        topic_dataset = self.dataset_of(record.topic)
        verdict = check_prompt(
            record.value, max_prompt_chars=self._settings.provider.max_prompt_chars, topic_dataset=topic_dataset or None
        )
        if isinstance(verdict, DeadLetter):
            await self._dead_letter(record, verdict, dataset=topic_dataset)
            return
        prompt = verdict
        dataset = self._settings.dataset(prompt.dataset)
        max_tokens = request_max_tokens(prompt, dataset.max_tokens)
        if not self._guard.checked(prompt.dataset):
            await self._guard.check_dataset(prompt.dataset)  # a dataset the configuration does not name
        identity = self._provider.request_identity(prompt, dataset, max_tokens=max_tokens)
        if isinstance(identity.get("body"), dict) and identity["body"].get("tools"):
            self._guard.parsed_tools(prompt.dataset)  # before money moves, where no pre-flight said it
        digest = request_hash(identity)
        key = store_key(prompt.dataset, prompt.sample_id, digest)
        if self._store is not None and not (self._repay or wants_repay(record.headers)):
            earlier = self._pending.get(key)
            if earlier is not None:
                await asyncio.shield(earlier)  # the same request is in flight here: wait for its answer
            stored = await self._store.get(key)
            if stored is not None:
                await self._reuse(stored)
                return
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[key] = mine
        try:
            paid = await self._call.pay(prompt, dataset, max_tokens)
            answered()
            if isinstance(paid, DeadLetter):
                await self._dead_letter(record, paid, dataset=prompt.dataset)
            else:
                await self._publish(prompt, dataset, max_tokens, paid, digest, key)
        finally:
            if self._pending.get(key) is mine:
                del self._pending[key]
            mine.set_result(None)

    async def _publish(
        self, prompt: PromptPublished, dataset: DatasetSettings, max_tokens: int, paid: Paid, digest: str, key: str
    ) -> None:
        """The paid response to ``responses`` and to the store, both acknowledged."""
        result, attempt, latency, attempt_id = paid
        event = response_event(
            prompt,
            result,
            provider=self._provider.name,
            model=self._settings.provider.model,
            profile=dataset.profile,
            tools_sent=self._provider.tools_sent(prompt, dataset),
            max_tokens=max_tokens,
            latency_s=latency,
            attempt=attempt,
            now=time.time(),
        )
        event = msgspec.structs.replace(
            event, request_hash=digest, attempt_id=attempt_id, provider_name=self._settings.provider.label
        )
        sample = key_of(prompt.dataset, prompt.sample_id).encode()
        value = encode(event)
        acks = [await self._producer.send(self._responses, value, key=sample)]
        if self._store is not None:
            acks.append(await self._store.put(key, value))
        await asyncio.gather(*acks)
        RESPONSES.labels(dataset=prompt.dataset).inc()
        self.responded += 1

    async def _reuse(self, stored: ResponseReceived) -> None:
        """Re-publish a response already paid for, marked so the budget does not count it again."""
        event = msgspec.structs.replace(stored, reused=True)
        key = key_of(event.dataset, event.sample_id).encode()
        await (await self._producer.send(self._responses, encode(event), key=key))
        RESPONSES_REUSED.labels(dataset=event.dataset).inc()
        self.reused += 1
        log.debug("%s answered from the response store (no new request)", key.decode())

    async def _dead_letter(self, record: Record, verdict: DeadLetter, *, dataset: str) -> None:
        out = dead_letter_of(
            record, dlq_topic=self._dead_letters, stage=STAGE, verdict=verdict, dataset=dataset or None
        )
        await (await self._producer.send(out.topic, out.value, key=out.key, headers=out.headers))
        DEAD_LETTERS.labels(stage=STAGE, reason=verdict.reason).inc()
        self.dead_lettered += 1
