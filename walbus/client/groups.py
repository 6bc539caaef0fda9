"""Consumer groups on walbus topics and how far behind they are (``walbus groups``).

Lag in records: per partition, the end offset (last stable offset) minus the group's
committed offset. Lag in seconds: how long ago the oldest record the group has not consumed
(the one at its committed offset) was written (its Kafka timestamp); 0 when caught up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient


@dataclass(frozen=True, slots=True)
class PartitionLag:
    partition: int
    committed: int
    end: int
    records: int
    seconds: float


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: str
    topic: str
    partitions: tuple[PartitionLag, ...]

    @property
    def records(self) -> int:
        return sum(p.records for p in self.partitions)

    @property
    def seconds(self) -> float:
        return max((p.seconds for p in self.partitions), default=0.0)

    def to_json_obj(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "topic": self.topic,
            "lag_records": self.records,
            "lag_seconds": round(self.seconds, 3),
            "partitions": [
                {"partition": p.partition, "committed": p.committed, "end": p.end, "lag_records": p.records, "lag_seconds": round(p.seconds, 3)}
                for p in self.partitions
            ],
        }


def _wanted(topic: str, topics: Sequence[str], prefix: str) -> bool:
    return topic in topics if topics else topic.startswith(prefix)


async def group_lags(client_kwargs: Mapping[str, Any], *, topics: Sequence[str] = (), prefix: str = "walbus.") -> list[GroupLag]:
    """Every consumer group with committed offsets on ``topics`` (default: topics named ``prefix…``)."""
    kwargs = dict(client_kwargs)
    admin = AIOKafkaAdminClient(**kwargs)
    await admin.start()
    try:
        groups = sorted({g for g, *_ in await admin.list_consumer_groups()})
        # One OffsetFetch per group, a few in flight at once: a cluster with hundreds of
        # groups answers in a few round trips, not hundreds in a row.
        limit = asyncio.Semaphore(16)

        async def offsets_of(group: str) -> Any:
            async with limit:
                return await admin.list_consumer_group_offsets(group)

        committed: dict[tuple[str, str], dict[TopicPartition, int]] = {}
        for group, offsets in zip(groups, await asyncio.gather(*(offsets_of(g) for g in groups)), strict=True):
            for tp, om in offsets.items():
                if om.offset >= 0 and _wanted(tp.topic, topics, prefix):
                    committed.setdefault((group, tp.topic), {})[tp] = om.offset
    finally:
        await admin.close()
    if not committed:
        return []
    # earliest: a committed offset below the log start (records deleted before the group read
    # them) reads from the oldest record left, so its age shows; "latest" read nothing there
    # and showed that worst case as 0 s behind (an operations fuzz).
    consumer = AIOKafkaConsumer(**kwargs, enable_auto_commit=False, isolation_level="read_committed", auto_offset_reset="earliest")
    try:
        await consumer.start()
        all_tps = sorted({tp for offsets in committed.values() for tp in offsets})
        ends: dict[TopicPartition, int] = await consumer.end_offsets(all_tps)
        now_ms = time.time() * 1000
        out: list[GroupLag] = []
        ages: dict[tuple[TopicPartition, int], float] = {}  # groups at the same position: one fetch
        for (group, topic), offsets in sorted(committed.items()):
            parts = []
            for tp, offset in sorted(offsets.items()):
                behind = max(ends[tp] - offset, 0)
                if behind and (tp, offset) not in ages:
                    ages[tp, offset] = await _age_at(consumer, tp, offset, now_ms)
                seconds = ages[tp, offset] if behind else 0.0
                parts.append(PartitionLag(tp.partition, offset, ends[tp], behind, seconds))
            out.append(GroupLag(group, topic, tuple(parts)))
        return out
    finally:
        await consumer.stop()


async def _age_at(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, now_ms: float) -> float:
    """Seconds since the first record at or after ``offset`` was written (0 if none is there)."""
    consumer.assign([tp])
    consumer.seek(tp, offset)
    batch = await consumer.getmany(tp, timeout_ms=2000, max_records=1)
    records = batch.get(tp, [])
    if not records:
        return 0.0
    return float(max(now_ms - records[0].timestamp, 0.0)) / 1000.0
