"""The test broker itself: records go through it, and it is the Kafka we pin (4.4)."""

from __future__ import annotations

import asyncio
import struct
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tests.kafka_fixture import TopicFactory

pytestmark = pytest.mark.kafka

# metadata.version feature levels of Kafka 4.4 (org.apache.kafka.server.common.
# MetadataVersion in the 4.4.0 jars: 4.3-IV0 is 30, 4.5-IV0 is 34).
KAFKA_4_4_METADATA_LEVELS = {31: "4.4-IV0", 32: "4.4-IV1", 33: "4.4-IV2"}


async def test_produce_then_consume_round_trip(kafka_bootstrap: str, topic_factory: TopicFactory) -> None:
    topic = await topic_factory("roundtrip", partitions=1)
    value = "réponse ✓ ".encode() * 1000  # 14 kB, non-ASCII
    headers = [("sample-id", b"s-1"), ("attempt", b"1")]

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, value=value, key=b"k-1", headers=headers)
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"test-broker-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=30)
    finally:
        await consumer.stop()

    assert (record.topic, record.partition, record.offset) == (topic, sent.partition, sent.offset)
    assert record.key == b"k-1"
    assert record.value == value
    assert list(record.headers) == headers


async def test_broker_is_kafka_4_4(kafka_bootstrap: str) -> None:
    """The broker's own ApiVersions answer: the metadata.version it supports and runs at.

    A broker of another release supports another highest level (4.3 stops at 30, 4.5
    goes past 33), so this fails on anything but Kafka 4.4.x.
    """
    supported, finalized = await _metadata_version_feature(kafka_bootstrap)
    assert supported in KAFKA_4_4_METADATA_LEVELS, f"broker supports metadata.version up to level {supported}"
    assert finalized in KAFKA_4_4_METADATA_LEVELS, f"cluster runs at metadata.version level {finalized}"


# --- a minimal ApiVersions v3 client ---------------------------------------------------
# aiokafka implements ApiVersions up to v2, which predates the feature fields (KIP-584),
# so the request is built and the response read by hand, with the Kafka protocol's
# compact (varint-prefixed) encodings and tagged fields.


async def _metadata_version_feature(bootstrap: str) -> tuple[int, int]:
    """Return (highest supported, finalized) level of the ``metadata.version`` feature."""
    host, port = bootstrap.split(",")[0].strip().rsplit(":", 1)
    client_id = b"draftstream-tests"
    header = struct.pack(">hhih", 18, 3, 1, len(client_id)) + client_id + b"\x00"  # api 18, v3, corr 1
    body = _compact_bytes(b"draftstream-tests") + _compact_bytes(b"0.1.0") + b"\x00"
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout=10)
    try:
        writer.write(struct.pack(">i", len(header) + len(body)) + header + body)
        await writer.drain()
        (size,) = struct.unpack(">i", await asyncio.wait_for(reader.readexactly(4), timeout=10))
        response = _Reader(await asyncio.wait_for(reader.readexactly(size), timeout=10))
    finally:
        writer.close()
        await writer.wait_closed()

    assert response.int32() == 1, "correlation id"
    error_code = response.int16()
    assert error_code == 0, f"ApiVersions v3 failed with error code {error_code}"
    for _ in range(response.uvarint() - 1):  # api keys: key, min, max, tagged fields
        response.int16(), response.int16(), response.int16()
        response.skip_tagged_fields()
    response.int32()  # throttle time
    supported: dict[str, int] = {}
    finalized: dict[str, int] = {}
    for _ in range(response.uvarint()):
        tag, length = response.uvarint(), response.uvarint()
        field = _Reader(response.take(length))
        if tag == 0:  # SupportedFeatures: name, min version, max version
            for _ in range(field.uvarint() - 1):
                name = field.compact_string()
                _min, supported[name] = field.int16(), field.int16()
                field.skip_tagged_fields()
        elif tag == 2:  # FinalizedFeatures: name, max version level, min version level
            for _ in range(field.uvarint() - 1):
                name = field.compact_string()
                finalized[name], _min = field.int16(), field.int16()
                field.skip_tagged_fields()
    assert "metadata.version" in supported, f"no metadata.version among supported features {supported}"
    assert "metadata.version" in finalized, f"no finalized metadata.version among {finalized}"
    return supported["metadata.version"], finalized["metadata.version"]


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _compact_bytes(data: bytes) -> bytes:
    return _uvarint(len(data) + 1) + data


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise ValueError("truncated ApiVersions response")
        chunk = self._data[self._pos : self._pos + n]
        self._pos += n
        return chunk

    def int16(self) -> int:
        value: int = struct.unpack(">h", self.take(2))[0]
        return value

    def int32(self) -> int:
        value: int = struct.unpack(">i", self.take(4))[0]
        return value

    def uvarint(self) -> int:
        shift = result = 0
        while True:
            byte = self.take(1)[0]
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    def compact_string(self) -> str:
        return self.take(self.uvarint() - 1).decode()

    def skip_tagged_fields(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.take(self.uvarint())
