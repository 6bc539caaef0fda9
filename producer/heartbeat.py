"""Heartbeats: a record on ``<topic>.heartbeat`` every ``--heartbeat-interval`` seconds, and the
optional ``--heartbeat-action-query`` (Debezium's ``heartbeat.interval.ms`` and
``heartbeat.action.query``).

A consumer tells an idle database from a dead producer by the heartbeat topic: records keep
coming while the producer streams, whether or not anything changes (README, operations).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import psycopg
from psycopg import sql

from producer.metrics import ProducerMetrics
from producer.progress import Progress
from producer.sink import KafkaSink
from walbus.contract import Heartbeat, heartbeat_topic

log = logging.getLogger("walbus.producer.heartbeat")

# With heartbeats off, the server's position is still confirmed this often while the captured
# tables are idle (WAL of other tables and databases must be recyclable).
IDLE_CONFIRM_S = 10.0
# A prompt beat (see Heartbeats.committed) waits for the stream to be quiet this long: a
# steady trickle of transactions tells its readers the same with its next events, and a beat
# after each one doubled its produce requests (p99 commit-to-append latency at 2,000 rows/s in
# 20-row transactions went from 20-25 ms to 68-70 ms).
PROMPT_QUIET_S = 0.02
# The action query's statement_timeout: its interval, within these bounds.
ACTION_TIMEOUT_MIN_S = 1.0
ACTION_TIMEOUT_MAX_S = 60.0


def confirm_interval(heartbeat_interval: float) -> float:
    """Seconds between confirmations of the server's position while the captured tables idle."""
    return heartbeat_interval if heartbeat_interval > 0 else IDLE_CONFIRM_S


def action_timeout(heartbeat_interval: float) -> float:
    """The action query's statement_timeout: it should be done before the next beat."""
    return min(max(heartbeat_interval, ACTION_TIMEOUT_MIN_S), ACTION_TIMEOUT_MAX_S)


class HeartbeatAction:
    """The action query on its own normal connection, in the background: a slow or failing
    query never holds up the stream. A beat while the previous query still runs is skipped."""

    def __init__(self, dsn: str, query: str, *, timeout_s: float, metrics: ProducerMetrics) -> None:
        self._dsn = dsn
        self._query = query.encode()
        self._timeout_ms = max(1, round(timeout_s * 1000))
        self._metrics = metrics
        self._conn: psycopg.AsyncConnection[tuple[object, ...]] | None = None
        self._task: asyncio.Task[None] | None = None

    def fire(self) -> None:
        if self._task is not None and not self._task.done():
            self._failed("skipped: the previous heartbeat action query still runs")
            return
        self._task = asyncio.create_task(self._run())

    async def _connection(self) -> psycopg.AsyncConnection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, connect_timeout=10, application_name="walbus-heartbeat",
            )
            await conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(self._timeout_ms)))
            self._conn = conn
        return self._conn

    async def _run(self) -> None:
        try:
            conn = await self._connection()
            await conn.execute(self._query)
        except Exception as e:  # whatever it is, the next beat tries again on a new connection: never fatal
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._conn.close()
            self._failed(f"{type(e).__name__}: {str(e).strip()}")
        else:
            self._metrics.heartbeat_actions.inc()

    def _failed(self, error: str) -> None:
        self._metrics.heartbeat_action_failures.inc()
        log.warning("heartbeat action query failed: tried again at the next heartbeat", extra={"error": error[:500]})

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None


class Heartbeats:
    """When a beat is due, and what it sends: the slot's confirmed position and the position read."""

    def __init__(
        self, *, interval: float, source_topic: str, slot: str, metrics: ProducerMetrics, action: HeartbeatAction | None,
    ) -> None:
        self.interval = interval
        self.topic = heartbeat_topic(source_topic)
        self.slot = slot
        self._metrics = metrics
        self._action = action
        self._next = 0.0  # the first beat goes out as soon as streaming starts
        self._owed: int | None = None  # end of a transaction no beat has reported confirmed yet
        self._data_at = 0.0  # when the stream last brought messages

    def due(self, now: float) -> bool:
        return self.interval > 0 and now >= self._next

    def committed(self, end_lsn: int) -> None:
        """A transaction with events was read: once Kafka acknowledges it, and the stream is
        idle, a beat reports it at once (:meth:`owed`), not at the next interval. A reader
        cannot tell the last event of a transaction from the records (the producer writes a
        large one over several batches); a confirmed position past its commit tells it that
        every event of it is in the topic (``Table.wait_until``)."""
        if self.interval > 0:
            self._owed = end_lsn

    @property
    def owing(self) -> bool:
        """A transaction waits for its acknowledgement to be reported."""
        return self._owed is not None

    def streaming(self, now: float) -> None:
        """The stream brought messages."""
        self._data_at = now

    def owed(self, confirmed_lsn: int, now: float) -> bool:
        """The transaction is acknowledged, no beat has said so yet, and the stream has been
        quiet for :data:`PROMPT_QUIET_S`."""
        return self._owed is not None and confirmed_lsn >= self._owed and now - self._data_at >= PROMPT_QUIET_S

    async def beat(self, sink: KafkaSink, progress: Progress, now: float, *, prompt: bool = False) -> None:
        """The record goes through the sink like transaction metadata: the slot is confirmed
        past a transaction only once everything sent before its end, this too, is acknowledged.
        A prompt beat (see :meth:`committed`) keeps the interval's schedule and does not run
        the action query: an action that writes a captured table would otherwise beat again
        at once, for ever."""
        if not prompt:
            self._next = now + self.interval
        wall = time.time()
        confirmed = progress.confirmed_lsn
        hb = Heartbeat(self.slot, confirmed, progress.read_lsn, int(wall * 1000))
        await sink.send_side_record(self.topic, hb.key(), hb.to_json())
        if self._owed is not None and confirmed >= self._owed:
            self._owed = None
        self._metrics.last_heartbeat.set(wall)
        if self._action is not None and not prompt:
            self._action.fire()

    async def close(self) -> None:
        if self._action is not None:
            await self._action.close()
