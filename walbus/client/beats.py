"""A database topic's heartbeats, followed: how far its producers confirmed.

The events of a commit cannot say whether all of it is in the database topic yet: the producer
writes a large transaction over several batches, and v1 events carry no end-of-transaction
mark. A heartbeat can: its ``confirmed_lsn`` is a position the producer confirmed only once
Kafka acknowledged every event before it, and the producer sends one as soon as a transaction
is acknowledged and its stream idles. ``Table.wait_until`` and ``Feed.transactions()`` read
them through :class:`HeartbeatWatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from walbus.client._connect import topic_partitions
from walbus.client.metrics import ClientMetrics, client_metrics
from walbus.contract import ContractError, heartbeat_topic, heartbeats
from walbus.kafka import stop_consumer

log = logging.getLogger("walbus.client.beats")

# No heartbeat read for this long: the producers beat no more (stopped, heartbeats turned off,
# an interval longer than this), and a commit's events are taken for all of it again.
BEAT_WAIT_S = 30.0
# How often a feed without a heartbeat topic looks for one (a producer started later).
LOOK_AGAIN_S = 10.0


class HeartbeatWatch:
    """Follows ``<topic>.heartbeat`` from its last record on, in the background."""

    def __init__(self, client_kwargs: Mapping[str, Any], source_topic: str, *, metrics: ClientMetrics | None = None) -> None:
        self.topic = heartbeat_topic(source_topic)
        self._kwargs = dict(client_kwargs)
        self._metrics = metrics or client_metrics()
        self.confirmed = -1  # the highest confirmed position a heartbeat reported
        self.beats = 0  # heartbeats read
        self.advanced = asyncio.Event()  # set when ``confirmed`` rises; a waiter clears it
        self._last_at: float | None = None  # when a heartbeat was read (or the topic found)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Look for the topic once here (so :attr:`enabled` holds from the start), then follow
        it, or go on looking for it, in the background."""
        try:
            tps = await topic_partitions(self._kwargs, self.topic, wait=False)
            await self._open(tps)
        except LookupError:
            self._task = asyncio.create_task(self._follow(None))
            return
        except Exception as e:  # a reader goes on as without heartbeats, and looks again
            log.warning("could not follow the producers' heartbeats yet", extra={"topic": self.topic, "error": repr(e)})
            await self._close_consumer()
            self._task = asyncio.create_task(self._follow(None))
            return
        self._task = asyncio.create_task(self._follow(tps))

    async def _open(self, tps: list[TopicPartition]) -> None:
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, fetch_max_wait_ms=100)
        self._consumer = consumer  # kept before it starts: stop() closes one cut short
        await consumer.start()
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(ends[tp] - 1, 0))
        self._last_at = time.monotonic()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._close_consumer()

    async def _close_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await stop_consumer(consumer)

    @property
    def enabled(self) -> bool:
        """The heartbeat topic exists (the producers send heartbeats, or did)."""
        return self._last_at is not None

    def past(self, lsn: int) -> bool:
        """A heartbeat confirmed a position past ``lsn``: every event of a commit at or before
        it is in the database topic."""
        return self.confirmed > lsn

    def alive(self) -> bool:
        """A heartbeat was read within :data:`BEAT_WAIT_S` (or the topic found since)."""
        return self._last_at is not None and time.monotonic() - self._last_at < BEAT_WAIT_S

    async def _follow(self, tps: list[TopicPartition] | None) -> None:
        try:
            while tps is None:
                try:
                    tps = await self._find()
                    await self._open(tps)
                except Exception:  # the broker away: as without heartbeats meanwhile
                    tps = None
                    await self._close_consumer()
                    await asyncio.sleep(LOOK_AGAIN_S)
            consumer = self._consumer
            assert consumer is not None
            while True:
                batches = await consumer.getmany(timeout_ms=1000)
                for msgs in batches.values():
                    for m in msgs:
                        self._note(m.value, m.partition, m.offset)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the readers go on without heartbeats, as with none
            log.warning("stopped following the producers' heartbeats", extra={"topic": self.topic, "error": repr(e)})

    async def _find(self) -> list[TopicPartition]:
        while True:
            try:
                return await topic_partitions(self._kwargs, self.topic, wait=False)
            except LookupError:
                await asyncio.sleep(LOOK_AGAIN_S)  # heartbeats off, or a producer not started yet

    def _note(self, value: bytes | None, partition: int = 0, offset: int = -1) -> None:
        def invalid(value: bytes, error: ContractError) -> None:
            # Passed over (it tells nothing of the producers), but never in silence: a topic of
            # nothing else makes readers wait out BEAT_WAIT_S as if no producer beat.
            self._metrics.invalid_records.labels("heartbeat", self.topic).inc()
            log.error(
                "skipping a heartbeat topic record that is no walbus heartbeat",
                extra={"topic": self.topic, "partition": partition, "offset": offset, "value": repr(value[:80]), "error": str(error)},
            )

        for beat in heartbeats((value,), invalid):
            self.beats += 1
            self._last_at = time.monotonic()
            if beat.confirmed_lsn > self.confirmed:
                self.confirmed = beat.confirmed_lsn
                self.advanced.set()
