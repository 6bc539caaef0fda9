"""The tests' one Kafka toolbox: topics, records in and out, offsets, compacted tables."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from demux.ktable import read_ktable_raw
from walbus import kafka
from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES, KafkaAdmin, TopicSpec

Record = tuple[bytes | None, bytes | None]  # (key, value)


def _kw(bootstrap: str) -> dict[str, Any]:
    return {"bootstrap_servers": bootstrap}


async def create_topic(
    bootstrap: str, name: str, *, partitions: int = 1, configs: Mapping[str, str] | None = None, compact: bool = False
) -> None:
    """``name`` with ``partitions`` (and ``cleanup.policy=compact`` when ``compact``), if missing."""
    settings = {**({"cleanup.policy": "compact"} if compact else {}), **(configs or {})}
    async with KafkaAdmin(client_kwargs=_kw(bootstrap)) as admin:
        await admin.ensure_topic(TopicSpec(name, partitions=partitions, configs=tuple(settings.items())))


async def produce(
    bootstrap: str, topic: str, records: Iterable[Record], *, partition: int | None = None, compression: str | None = None
) -> None:
    """(key, value) records in order, acknowledged before returning; ``partition`` None: by key."""
    producer = AIOKafkaProducer(**_kw(bootstrap), acks="all", enable_idempotence=True, linger_ms=5,
                                max_request_size=DEFAULT_MAX_MESSAGE_BYTES,  # large rows' records
                                compression_type=compression)
    await producer.start()
    try:
        futures = [await producer.send(topic, key=k, value=v, partition=partition) for k, v in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def topic_partitions(bootstrap: str, topic: str) -> int:
    """Partition count of ``topic`` (0 while it does not exist)."""
    try:
        return len(await kafka.topic_partitions(_kw(bootstrap), topic, wait=False))
    except LookupError:
        return 0


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(**_kw(bootstrap))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(await topic_partitions(bootstrap, topic))]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def committed_offsets(bootstrap: str, group: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(**_kw(bootstrap))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return {tp.partition: meta.offset for tp, meta in offsets.items()}
    except KafkaError:  # the group does not exist yet (coordinator not available)
        return {}
    finally:
        await admin.close()


async def commit_offset(bootstrap: str, group: str, tp: TopicPartition, offset: int, metadata: str = "") -> None:
    """Commit ``group``'s offset of ``tp`` as another client would (the group has no member now)."""
    committer = AIOKafkaConsumer(**_kw(bootstrap), group_id=group, enable_auto_commit=False)
    await committer.start()
    try:
        committer.assign([tp])
        await committer.commit({tp: (offset, metadata)})
    finally:
        await committer.stop()


async def wait_caught_up(bootstrap: str, group: str, topic: str, *, within: float = 90, procs: Iterable[Any] = ()) -> None:
    """Until ``group``'s committed offsets reach ``topic``'s end (``procs``: checked alive meanwhile)."""
    target = await end_offsets(bootstrap, topic)
    deadline = time.monotonic() + within
    got: dict[int, int] = {}
    while time.monotonic() < deadline:
        got = await committed_offsets(bootstrap, group)
        if all(got.get(p, 0) >= off for p, off in target.items()):
            return
        for p in procs:
            p.check_alive()
        await asyncio.sleep(0.3)
    raise AssertionError(f"{group} did not catch up: committed {got}, {topic} ends at {target}")


async def read_records(
    bootstrap: str, topic: str, isolation_level: str = "read_committed", *, min_count: int = 0, timeout: float = 60.0
) -> list[Any]:
    """Every record of ``topic`` (all partitions, in partition then offset order), waiting until
    at least ``min_count`` exist."""
    consumer = AIOKafkaConsumer(**_kw(bootstrap), isolation_level=isolation_level, auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            tps = [TopicPartition(topic, p) for p in range(await topic_partitions(bootstrap, topic))]
            out: dict[TopicPartition, list[Any]] = {tp: [] for tp in tps}
            if tps:
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                ends = await consumer.end_offsets(tps)
                while any([await consumer.position(tp) < ends[tp] for tp in tps]):
                    assert time.monotonic() < deadline, f"reading {topic} timed out"
                    for tp, msgs in (await consumer.getmany(timeout_ms=500)).items():
                        out[tp].extend(m for m in msgs if m.offset < ends[tp])
            records = [m for tp in tps for m in out[tp]]
            if len(records) >= min_count:
                return records
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}: {len(records)} records after {timeout} s, expected at least {min_count}")
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()


async def read_topic(
    bootstrap: str, topic: str, *, min_count: int = 0, timeout: float = 60.0, isolation_level: str = "read_uncommitted"
) -> list[Record]:
    """:func:`read_records` as (key, value) pairs."""
    records = await read_records(bootstrap, topic, isolation_level, min_count=min_count, timeout=timeout)
    return [(m.key, m.value) for m in records]


async def read_ktable(*, client_kwargs: dict[str, Any], topic: str, timeout_s: float = 120.0) -> dict[bytes, dict[str, Any]]:
    """``{key: row}`` of a compacted per-table topic as of its end (committed records only)."""
    raw = await read_ktable_raw(client_kwargs=client_kwargs, topic=topic, timeout_s=timeout_s)
    return {k: orjson.loads(v) for k, v in raw.items()}


async def list_topics(bootstrap: str) -> set[str]:
    async with KafkaAdmin(client_kwargs=_kw(bootstrap)) as admin:
        return await admin.list_topics()


async def delete_topic(bootstrap: str, topic: str, *, within: float = 30) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it (no event says so)."""
    async with KafkaAdmin(client_kwargs=_kw(bootstrap)) as admin:
        await admin.delete_topics([topic])
        async with asyncio.timeout(within):  # polled: the broker has no event for a deletion done
            while True:
                if topic not in await admin.list_topics():
                    return
                await asyncio.sleep(0.1)


async def topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    async with KafkaAdmin(client_kwargs=_kw(bootstrap)) as admin:
        return await admin.topic_config(topic)
