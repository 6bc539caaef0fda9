"""How far the pipeline upstream of a per-table topic has got, for ``Table.wait_until``.

A commit that touched other tables never shows up in a per-table topic, so the table topic
alone cannot say "commit X is reflected". The database topic can: its records are in commit
order, so once it holds an event with ``commit_lsn > X`` every commit up to X is in it. The
events of commit X itself cannot tell whether they are all there (the producer writes a large
transaction over several batches); the producer's heartbeats can: one whose confirmed position
is past X says Kafka acknowledged every event up to X, and the producer sends one as soon as
it is idle after a transaction. And the demux commits its consumer-group offsets on the database topic in the same Kafka
transaction as its output records, so once the demux group's committed offset has passed
every event of those commits, every per-table record derived from them is committed
(visible to ``read_committed`` readers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client import CollectorRegistry

from walbus.client._connect import topic_partitions
from walbus.client.beats import BEAT_WAIT_S, HeartbeatWatch
from walbus.client.metrics import client_metrics
from walbus.client.positions import Position, newest, valid_event
from walbus.contract import ContractError
from walbus.kafka import stop_consumer

log = logging.getLogger("walbus.client.progress")


class ProgressStopped(RuntimeError):
    """:meth:`SourceProgress.stop` was called while a wait was in progress."""


class SourceProgress:
    """Watches the database topic's newest positions and, optionally, the demux group's offsets."""

    def __init__(
        self,
        client_kwargs: Mapping[str, Any],
        topic: str,
        group: str | None,
        *,
        poll_interval: float = 0.05,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.topic = topic
        self._metrics = client_metrics(metrics_registry)
        self.group = group
        self._kwargs = dict(client_kwargs)
        self._poll = poll_interval
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._tps: list[TopicPartition] = []
        self._newest: dict[TopicPartition, Position] = {}
        self._beats: HeartbeatWatch | None = None
        self._probe: AIOKafkaConsumer | None = None  # random access to single records
        self._at: dict[tuple[TopicPartition, int], Position | None] = {}  # None: not a valid event
        self._cursor_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()

    async def start(self) -> None:
        # Each client is kept before it starts: stop() closes one whose start was cut short.
        consumer = AIOKafkaConsumer(
            **self._kwargs, enable_auto_commit=False, isolation_level="read_committed", fetch_max_wait_ms=50
        )
        self._consumer = consumer
        await consumer.start()
        self._beats = HeartbeatWatch(self._kwargs, self.topic, metrics=self._metrics)
        await self._beats.start()
        if self.group is not None:
            self._admin = AIOKafkaAdminClient(**self._kwargs)
            await self._admin.start()

    async def stop(self) -> None:
        consumer, admin, probe, beats = self._consumer, self._admin, self._probe, self._beats
        self._consumer = self._admin = self._probe = self._beats = None
        if beats is not None:
            await beats.stop()
        for c in (consumer, probe):
            if c is not None:
                await stop_consumer(c)
        if admin is not None:
            await admin.close()

    async def commit_reached(self, lsn: int) -> dict[TopicPartition, int]:
        """Wait until the database topic holds every event with ``commit_lsn <= lsn``.

        That is when it holds an event of a later commit, or a producer's heartbeat reports a
        confirmed position past ``lsn``; without heartbeats, when it holds an event of commit
        ``lsn`` itself (the rest of a large one may still be on its way). Returns, per
        partition, the offset after the last record read (at least the end offsets looked up
        before reading, after the heartbeats). Only the records written since the first call
        are read (from the last record then on), not the whole topic.
        """
        while True:
            # One reader of the cursor at a time; the lock is not held while sleeping, so a
            # waiter for a far LSN does not hold up the others.
            async with self._cursor_lock:
                consumer, beats = self._consumer, self._beats
                if consumer is None or beats is None:
                    raise ProgressStopped("SourceProgress not started or stopped")
                if not self._tps:
                    # Not waited for: the demux read this topic to write the table's, so a
                    # missing one is a wrong name (a producer's own --topic), and waiting for
                    # it stalled wait_until for good with one info line.
                    try:
                        tps = await topic_partitions(self._kwargs, self.topic, wait=False)
                    except LookupError:
                        raise LookupError(
                            f"the database topic {self.topic!r} does not exist: pass Table(source_topic=...), "
                            "the topic the demux reads"
                        ) from None
                    consumer.assign(tps)
                    ends = await consumer.end_offsets(tps)
                    for tp in tps:
                        consumer.seek(tp, max(ends[tp] - 1, 0))
                    self._tps = tps
                confirmed = beats.past(lsn)  # before the ends below: its events are within them
                ends = await consumer.end_offsets(self._tps)
                await self._read_to(consumer, ends)
                whole = confirmed or any(p[0] > lsn for p in self._newest.values())
                if not whole and any(p[0] == lsn for p in self._newest.values()) and not beats.alive():
                    if beats.enabled:
                        log.warning(
                            "no heartbeat from the producer: taking the commit's first event for the whole "
                            "commit (a large one may still be on its way)",
                            extra={"topic": self.topic, "commit_lsn": lsn, "waited_s": BEAT_WAIT_S},
                        )
                    whole = True  # heartbeats off (no topic), or none for BEAT_WAIT_S
                if whole:
                    # Not the ends looked up before reading: a fetch may bring records appended
                    # since, the target's among them, and the demux group's offset reaching
                    # those ends then said nothing of it (wait_until returned before the commit
                    # reached the table; a client fuzz found it).
                    return {tp: max(int(ends[tp]), await consumer.position(tp)) for tp in self._tps}
            await asyncio.sleep(self._poll)

    async def _read_to(self, consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> None:
        while True:
            behind = [tp for tp in self._tps if await consumer.position(tp) < ends[tp]]
            if not behind:
                return
            batches = await consumer.getmany(*behind, timeout_ms=200)
            for tp, msgs in batches.items():
                for m in msgs:
                    pos = self._position_of(m)
                    best = newest(self._newest.get(tp), pos)
                    if best is not None:
                        self._newest[tp] = best

    def _position_of(self, msg: Any) -> Position | None:
        """The record's position if it is a valid event keyed by it (a bad key must not count)."""
        try:
            return valid_event(msg.key, msg.value).position
        except ContractError as e:
            self._metrics.invalid_records.labels("wait_until", msg.topic).inc()
            log.error(
                "ignoring a record that is not a valid walbus v1 event",
                extra={"topic": msg.topic, "partition": msg.partition, "offset": msg.offset, "error": str(e)},
            )
            return None

    async def group_reached(self, lsn: int, ends: Mapping[TopicPartition, int]) -> None:
        """Wait until the demux group has consumed every commit up to ``lsn`` (no group: return).

        Per partition that is when its committed offset reaches ``ends`` (what
        :meth:`commit_reached` saw), or earlier when the record *at* the committed offset (the
        next one it will read) belongs to a later commit: in the database topic a later commit
        comes after every event of the earlier ones.
        """
        if self.group is None:
            return
        needed = {tp: end for tp, end in ends.items() if end > 0}
        loop = asyncio.get_running_loop()
        warn_at = loop.time() + 10.0
        while needed:
            if loop.time() > warn_at:
                # A wrong group id waits forever: say so once instead of hanging silently.
                log.warning(
                    "waiting for the demux group to consume the database topic; is it the demux's --group-id?",
                    extra={"group": self.group, "topic": self.topic},
                )
                warn_at = float("inf")
            admin = self._admin
            if admin is None:
                raise ProgressStopped("SourceProgress not started or stopped")
            committed = await admin.list_consumer_group_offsets(self.group, partitions=list(needed))
            for tp, om in committed.items():
                if tp not in needed or om.offset <= 0:
                    continue
                if om.offset >= needed[tp]:
                    del needed[tp]
                    continue
                upcoming = await self._position_at(tp, om.offset)
                if upcoming is not None and upcoming[0] > lsn:
                    del needed[tp]
            if needed:
                await asyncio.sleep(self._poll)

    async def _position_at(self, tp: TopicPartition, offset: int) -> Position | None:
        """The position in the key of the record at ``offset`` (cached: records never change)."""
        if (tp, offset) in self._at:
            return self._at[(tp, offset)]
        async with self._probe_lock:
            return await self._probe_position(tp, offset)

    async def _probe_position(self, tp: TopicPartition, offset: int) -> Position | None:
        if self._consumer is None:
            raise ProgressStopped("SourceProgress not started or stopped")  # no probe left behind
        if self._probe is None:
            self._probe = AIOKafkaConsumer(
                **self._kwargs, enable_auto_commit=False, isolation_level="read_committed", fetch_max_wait_ms=50
            )
            await self._probe.start()
        probe = self._probe
        probe.assign([tp])
        probe.seek(tp, offset)
        batches = await probe.getmany(tp, timeout_ms=1000, max_records=1)
        msgs = batches.get(tp, [])
        if not msgs or msgs[0].offset != offset:
            return None  # compacted away or not fetched in time: ask again later
        pos = self._position_of(msgs[0])
        if len(self._at) > 1024:
            self._at.clear()
        self._at[(tp, offset)] = pos
        return pos
