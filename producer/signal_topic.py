"""The Kafka signal channel (``--signal-topic``), Debezium's KafkaSignalChannel for the producer.

A record keyed with the producer's database topic name (``walbus.<database>``; Debezium
uses its topic prefix) carries one signal as its value, ``{"type": …, "data": {…}}``, with
``data`` what the signal table's ``data`` column holds (an object, or that object as JSON
text). Records with another key belong to another producer sharing the topic and are
passed over. The topic has one partition (signals are applied in its order); no consumer
group: the next offset to read is saved in the progress record together with the
position the signals changed, so each signal takes effect exactly once across restarts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from walbus.config import ConfigError
from walbus.kafka import METADATA_WAIT_S, KafkaAdmin, TopicSpec

log = logging.getLogger("walbus.producer.signals")

POLL_RECORDS = 100


@dataclass(frozen=True)
class TopicSignal:
    """One record of the signal topic, read: a signal, a foreign record or a malformed one."""

    offset: int
    sig_id: str
    type: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # malformed: why (logged, counted, skipped)
    foreign: bool = False  # keyed for another producer


def read_signal(topic: str, offset: int, key: bytes | None, value: bytes | None, *, own_key: bytes) -> TopicSignal:
    """A signal topic record as a signal. Its id is the record's place (``<topic>@<offset>``):
    unique, and the same when the record is read again."""
    sig_id = f"{topic}@{offset}"
    if key != own_key:
        return TopicSignal(offset, sig_id, foreign=True)
    try:
        doc = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return TopicSignal(offset, sig_id, problem="the value is not JSON")
    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str) or not doc["type"]:
        return TopicSignal(offset, sig_id, problem='the value is not {"type": "<signal>", "data": {…}}')
    data = doc.get("data")
    if isinstance(data, str):
        try:
            data = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            return TopicSignal(offset, sig_id, problem="data is neither a JSON object nor JSON text of one")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return TopicSignal(offset, sig_id, problem="data is neither a JSON object nor JSON text of one")
    return TopicSignal(offset, sig_id, doc["type"], data)


class KafkaSignalChannel:
    """Reads the signal topic from a given offset; :meth:`poll` never waits."""

    def __init__(self, client_kwargs: dict[str, Any], topic: str, *, own_key: str, replication_factor: int | None = None) -> None:
        self._kwargs = client_kwargs
        self.topic = topic
        self._own_key = own_key.encode()
        self._rf = replication_factor
        self._tp = TopicPartition(topic, 0)
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self, offset: int | None) -> None:
        async with KafkaAdmin(client_kwargs=self._kwargs) as admin:
            await admin.ensure_topic(TopicSpec(self.topic, 1, self._rf))
            partitions = await admin.partitions(self.topic, wait=METADATA_WAIT_S)
        if partitions != 1:
            raise ConfigError(f"--signal-topic {self.topic} has {partitions} partitions: signals need one order, give it one partition")
        # read_committed: a signal written in a Kafka transaction that was then aborted was never
        # sent (read uncommitted, it snapshotted its tables all the same).
        consumer = self._consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, auto_offset_reset="earliest",
                                                     isolation_level="read_committed")
        await consumer.start()
        consumer.assign([self._tp])
        await self.seek(offset)
        log.info("reading signals from Kafka", extra={"signal_topic": self.topic, "offset": offset, "key": self._own_key.decode()})

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def seek(self, offset: int | None) -> None:
        """Read from ``offset`` on (None: the topic's beginning): the saved one, after a reset."""
        assert self._consumer is not None, "start() first"
        if offset is None:
            await self._consumer.seek_to_beginning(self._tp)
        else:
            self._consumer.seek(self._tp, offset)

    async def poll(self) -> list[TopicSignal]:
        """The records fetched since the last poll (none: at once)."""
        assert self._consumer is not None, "start() first"
        batch = await self._consumer.getmany(self._tp, timeout_ms=0, max_records=POLL_RECORDS)
        return [read_signal(self.topic, m.offset, m.key, m.value, own_key=self._own_key) for m in batch.get(self._tp, [])]
