"""How far the pipeline upstream of a per-table topic has got, for ``Table.wait_until``.

A commit that touched other tables never shows up in a per-table topic, so the table topic
alone cannot say "commit X is reflected". The database topic can: its records are in commit
order, so once it holds an event with ``commit_lsn >= X`` every commit up to X is in it. And
the demux commits its consumer-group offsets on the database topic in the same Kafka
transaction as its output records, so once the demux group's committed offsets reach the
database topic's end offsets seen at that moment, every per-table record derived from those
commits is committed (visible to ``read_committed`` readers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from walbus.client._connect import topic_partitions
from walbus.client.positions import Position, newest, position_of_key

log = logging.getLogger("walbus.client.progress")


class SourceProgress:
    """Watches the database topic's newest positions and, optionally, the demux group's offsets."""

    def __init__(self, client_kwargs: Mapping[str, Any], topic: str, group: str | None, *, poll_interval: float = 0.05) -> None:
        self.topic = topic
        self.group = group
        self._kwargs = dict(client_kwargs)
        self._poll = poll_interval
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._tps: list[TopicPartition] = []
        self._newest: dict[TopicPartition, Position] = {}
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, isolation_level="read_committed")
        await consumer.start()
        self._consumer = consumer
        if self.group is not None:
            self._admin = AIOKafkaAdminClient(**self._kwargs)
            await self._admin.start()

    async def stop(self) -> None:
        consumer, admin = self._consumer, self._admin
        self._consumer = self._admin = None
        if consumer is not None:
            await consumer.stop()
        if admin is not None:
            await admin.close()

    async def commit_reached(self, lsn: int) -> dict[TopicPartition, int]:
        """Wait until the database topic holds an event with ``commit_lsn >= lsn``.

        Returns the topic's end offsets observed at that moment. Only the records written
        since the first call are read (from the last record then on), not the whole topic.
        """
        async with self._lock:  # one reader of the cursor consumer at a time
            consumer = self._consumer
            if consumer is None:
                raise RuntimeError("SourceProgress not started")
            if not self._tps:
                self._tps = await topic_partitions(self._kwargs, self.topic)
                consumer.assign(self._tps)
                ends = await consumer.end_offsets(self._tps)
                for tp in self._tps:
                    consumer.seek(tp, max(ends[tp] - 1, 0))
            target = (lsn, 0)
            while True:
                ends = await consumer.end_offsets(self._tps)
                await self._read_to(consumer, ends)
                if any(p >= target for p in self._newest.values()):
                    return {tp: int(end) for tp, end in ends.items()}
                await asyncio.sleep(self._poll)

    async def _read_to(self, consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> None:
        while True:
            behind = [tp for tp in self._tps if await consumer.position(tp) < ends[tp]]
            if not behind:
                return
            batches = await consumer.getmany(*behind, timeout_ms=200)
            for tp, msgs in batches.items():
                for m in msgs:
                    pos = position_of_key(m.key)
                    best = newest(self._newest.get(tp), pos)
                    if best is not None:
                        self._newest[tp] = best

    async def group_reached(self, ends: Mapping[TopicPartition, int]) -> None:
        """Wait until the demux group's committed offsets reach ``ends`` (no group: return)."""
        if self.group is None or self._admin is None:
            return
        needed = {tp: end for tp, end in ends.items() if end > 0}
        while needed:
            committed = await self._admin.list_consumer_group_offsets(self.group, partitions=list(needed))
            for tp, om in committed.items():
                if tp in needed and om.offset >= needed[tp]:
                    del needed[tp]
            if needed:
                await asyncio.sleep(self._poll)
