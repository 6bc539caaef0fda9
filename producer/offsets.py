"""The producer's own small state, kept in Kafka: ``<topic>.progress``, compacted, keyed by slot.

Kafka is the producer's offset store (as Debezium's offsets topic): what the replication
slot cannot say — whether the initial snapshot completed, where an incremental snapshot
stands — lives next to the data it describes, so it survives the host and needs no disk.
One JSON document per slot; the last record of a key wins (compaction keeps just it):

    {"v": 1, "slot": "walbus_db",
     "initial": {"status": "running" | "completed", "attempt": 2, "consistent_point": 123,
                 "from_offsets": [0]},            # the topic's end before the first attempt
     "incremental": {...} | null}                 # see producer.incremental.Position

Writes are acknowledged (acks=all) before the caller goes on.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from walbus.contract import ContractError, parse_event_key, side_topic
from walbus.kafka import KafkaAdmin, TopicSpec

log = logging.getLogger("walbus.producer.offsets")

COMPACTED = (("cleanup.policy", "compact"),)


def progress_topic(topic: str) -> str:
    return side_topic(topic, "progress")


class OffsetStore:
    """The progress document of one slot: :meth:`load` once at start, :meth:`save` as it changes."""

    def __init__(self, client_kwargs: dict[str, Any], topic: str, slot: str, *, replication_factor: int | None = None) -> None:
        self._kwargs = client_kwargs
        self.topic = progress_topic(topic)
        self.slot = slot
        self._rf = replication_factor
        self._producer: AIOKafkaProducer | None = None
        self.doc: dict[str, Any] = {}
        self.others: dict[str, dict[str, Any]] = {}  # the other slots' documents: other producers of the topic

    async def start(self) -> None:
        async with KafkaAdmin(client_kwargs=self._kwargs) as admin:
            await admin.ensure_topic(TopicSpec(self.topic, 1, self._rf, COMPACTED))
        self._producer = AIOKafkaProducer(**self._kwargs, acks="all", enable_idempotence=True)
        await self._producer.start()
        self.doc = await self._load()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _load(self) -> dict[str, Any]:
        doc, self.others = await self._read()
        return doc

    async def _read(self, until: int | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """This slot's document and the others', from the progress topic's start to its end
        (or to ``until``, not included)."""
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        try:
            tp = TopicPartition(self.topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp] if until is None else until
            key = self.slot.encode()
            doc: dict[str, Any] = {}
            others: dict[str, dict[str, Any]] = {}
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                for m in batch.get(tp, []):
                    if m.offset >= end:
                        break
                    if m.key == key:
                        doc = orjson.loads(m.value) if m.value else {}
                    elif m.key is not None:
                        other = orjson.loads(m.value) if m.value else None
                        name = m.key.decode(errors="replace")
                        if isinstance(other, dict):
                            others[name] = other
                        else:
                            others.pop(name, None)  # a tombstone: that slot's record was removed
            return doc, others
        finally:
            await consumer.stop()

    async def save(self) -> int:
        """Write the whole document (acknowledged by every in-sync replica before returning);
        its offset in the progress topic."""
        assert self._producer is not None, "OffsetStore.start() first"
        self.doc["v"] = 1
        self.doc["slot"] = self.slot
        md = await self._producer.send_and_wait(self.topic, key=self.slot.encode(), value=orjson.dumps(self.doc))
        return int(md.offset)

    async def delete(self) -> None:
        """Remove this slot's document (a tombstone)."""
        assert self._producer is not None, "OffsetStore.start() first"
        self.doc = {}
        await self._producer.send_and_wait(self.topic, key=self.slot.encode(), value=None)

    async def claims_before(self, offset: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """This slot's document and the others' as the progress topic had them before ``offset``."""
        return await self._read(until=offset)

    async def others_now(self) -> dict[str, dict[str, Any]]:
        """The other slots' documents as the progress topic has them now."""
        _, others = await self._read()
        return others

    async def latest(self) -> dict[str, Any]:
        """This slot's document as the progress topic has it now (another producer of the same
        slot name, of another cluster, may have written it since :meth:`start`)."""
        doc, _ = await self._read()
        return doc

    async def topic_last_position(self, topic: str, partitions: int, *, tail: int = 100) -> tuple[int, int] | None:
        """The highest event position (commit LSN, seq) among the last ``tail`` records of each
        of ``topic``'s partitions (records whose key is no event position are passed over);
        None when there is none."""
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False)
        await consumer.start()
        highest: tuple[int, int] | None = None
        try:
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            consumer.assign(tps)
            starts, ends = await consumer.beginning_offsets(tps), await consumer.end_offsets(tps)
            for tp in tps:
                if ends[tp] <= starts[tp]:
                    continue
                consumer.seek(tp, max(starts[tp], ends[tp] - tail))
                while await consumer.position(tp) < ends[tp]:
                    for m in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                        try:
                            position = parse_event_key(m.key or b"")
                        except ContractError:
                            continue
                        if highest is None or position > highest:
                            highest = position
            return highest
        finally:
            await consumer.stop()

    async def topic_end_offsets(self, topic: str, partitions: int) -> list[int]:
        """Where ``topic``'s partitions end now (a snapshot attempt's first record comes after)."""
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            ends = await consumer.end_offsets(tps)
            return [int(ends[tp]) for tp in tps]
        finally:
            await consumer.stop()
