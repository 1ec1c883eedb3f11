"""Bytes on the broker's log dirs per topic, through Kafka's DescribeLogDirs (API key 35, v1),
which aiokafka's admin client does not offer."""

from __future__ import annotations

from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Int64, Schema, String

from bench.common import BOOTSTRAP


class _LogDirsResponse(Response):
    API_KEY = 35
    API_VERSION = 1
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            Array(
                ("error_code", Int16),
                ("log_dir", String("utf-8")),
                (
                    "topics",
                    Array(
                        ("name", String("utf-8")),
                        (
                            "partitions",
                            Array(
                                ("partition_index", Int32),
                                ("partition_size", Int64),
                                ("offset_lag", Int64),
                                ("is_future_key", Boolean),
                            ),
                        ),
                    ),
                ),
            ),
        ),
    )


class _LogDirsRequestV1(RequestStruct):
    API_KEY = 35
    API_VERSION = 1
    RESPONSE_TYPE = _LogDirsResponse
    SCHEMA = Schema(("topics", Array(("topic", String("utf-8")), ("partitions", Array(Int32)))))


class _LogDirsRequest(Request[_LogDirsRequestV1]):
    """Kafka's DescribeLogDirs (all topics): aiokafka has no admin call for it."""

    API_KEY = 35

    def build(self, request_struct_class: type[_LogDirsRequestV1]) -> _LogDirsRequestV1:
        return request_struct_class(None)


async def disk_per_topic(prefix: str) -> dict[str, int]:
    """Bytes on the broker's log dirs per topic of this run (the prefix removed)."""
    from services.common.config import KafkaSettings
    from services.common.kafka import make_admin

    admin = make_admin(KafkaSettings(bootstrap_servers=BOOTSTRAP))
    await admin.start()
    try:
        client = admin._client  # noqa: SLF001 - the request aiokafka's admin lacks
        sizes: dict[str, int] = {}
        for broker in client.cluster.brokers():
            response = await client.send(broker.nodeId, _LogDirsRequest())
            for _, _, topics in response.results:
                for name, partitions in topics:
                    if name.startswith(prefix):
                        key = name.removeprefix(prefix)
                        sizes[key] = sizes.get(key, 0) + sum(p[1] for p in partitions)
        return sizes
    finally:
        await admin.close()
