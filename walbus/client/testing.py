"""Test a subscriber against the real pipeline: a fresh database, a running producer, a Feed.

Either as a pytest fixture::

    pytest_plugins = ["walbus.client.testing"]  # in your root conftest.py or the test module

    @pytest.mark.asyncio  # pytest-asyncio runs async tests (or asyncio_mode = "auto" in its config)
    async def test_my_subscriber(walbus_pipeline):
        async with walbus_pipeline.feed(group_id="notify", tables=["public.orders"]) as feed:
            walbus_pipeline.execute("CREATE TABLE orders (id int PRIMARY KEY, total numeric)",
                                    "INSERT INTO orders VALUES (1, 12.50)")
            event = await walbus_pipeline.next_event(feed)
            assert event.typed_row() == {"id": 1, "total": Decimal("12.50")}

or as an async context manager: ``async with pipeline() as p: ...``.

It needs a PostgreSQL server with ``wal_level=logical`` and Kafka: ``WALBUS_PG_DSN`` and
``WALBUS_KAFKA_BOOTSTRAP`` (``eval "$(walbus dev env)"`` after ``walbus dev up``) or the
arguments. Each pipeline creates its own database (``walbus_test_<random>``) on that server and
runs ``walbus produce`` for it as a child process (this interpreter, so your installed walbus);
at the end it stops the producer, drops the database, its slot, its topic, the topic's side
topics (``.progress``, ``.heartbeat``, …) and its groups' dead-letter and replay topics. The
fixture is async: the tests that use it need
pytest-asyncio (``@pytest.mark.asyncio`` on each, or ``asyncio_mode = "auto"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import IO, Any

import psycopg
import pytest_asyncio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from walbus.client._connect import topic_partitions
from walbus.client.deadletters import GROUP_TOPIC_MARK
from walbus.client.event import FeedEvent
from walbus.client.feed import Feed
from walbus.contract import SIDE_TOPIC_SUFFIXES, database_topic, side_topic
from walbus.kafka import KafkaAdmin

READY_TIMEOUT = 60.0


@dataclass
class Pipeline:
    """One test's database, its producer and where its events go."""

    dsn: str  # to the test's own database
    bootstrap: str
    database: str
    topic: str

    def execute(self, *statements: str, params: Iterable[Any] | None = None) -> None:
        """Run SQL statements on the test database, each in its own committed transaction."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement.encode(), params)  # type: ignore[arg-type]  # bytes: no LiteralString check

    def feed(self, *, group_id: str | None = None, **options: Any) -> Feed:
        """A Feed on this database's topic; by default from the earliest event (the whole test)."""
        options.setdefault("start", "earliest")
        return Feed(self.topic, group_id=group_id, bootstrap_servers=self.bootstrap, **options)

    async def next_event(self, feed: Feed, timeout: float = 30.0) -> FeedEvent:
        """The feed's next event, or ``TimeoutError``."""
        async with asyncio.timeout(timeout):
            return await anext(feed)

    async def events(self, feed: Feed, count: int, timeout: float = 30.0) -> list[FeedEvent]:
        """The feed's next ``count`` events (acked as they are taken), or ``TimeoutError``."""
        out: list[FeedEvent] = []
        async with asyncio.timeout(timeout):
            while len(out) < count:
                out.append(await anext(feed))
        return out


def _env(name: str, given: str | None) -> str:
    value = given or os.environ.get(name)
    if not value:
        raise RuntimeError(f"walbus.client.testing needs {name} (or the argument): eval \"$(walbus dev env)\" after `walbus dev up`")
    return value


@contextlib.asynccontextmanager
async def pipeline(pg_dsn: str | None = None, kafka_bootstrap: str | None = None) -> AsyncIterator[Pipeline]:
    """A fresh database with a producer streaming it to Kafka, removed afterwards."""
    server_dsn = _env("WALBUS_PG_DSN", pg_dsn)
    bootstrap = _env("WALBUS_KAFKA_BOOTSTRAP", kafka_bootstrap)
    database = f"walbus_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    dsn = make_conninfo(server_dsn, dbname=database)
    topic = database_topic("walbus", database)
    with tempfile.TemporaryFile() as log:  # the producer's log, shown if it fails to start
        producer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "walbus.app.cli", "produce", "--drop-slot-on-exit",
            env={**os.environ, "WALBUS_PG_DSN": dsn, "WALBUS_KAFKA_BOOTSTRAP": bootstrap},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
        try:
            await _until_streaming(producer, log, dsn, bootstrap, topic)
            yield Pipeline(dsn=dsn, bootstrap=bootstrap, database=database, topic=topic)
        finally:
            await _stop(producer)
            _drop_database(server_dsn, database)
            await _delete_topic(bootstrap, topic)


async def _delete_topic(bootstrap: str, topic: str) -> None:
    """The database topic, the side topics the producer made beside it and the dead-letter and
    replay topics of the test's consumer groups (one per test: left, they pile up on a shared
    broker; the groups' were left before)."""
    mine = {topic, *(side_topic(topic, suffix) for suffix in SIDE_TOPIC_SUFFIXES)}
    groups = f"{topic}.{GROUP_TOPIC_MARK}"  # <topic>.group--<group>.dlq / .replay
    with contextlib.suppress(Exception):  # cleanup only: a leftover topic harms no later test
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
            await admin.delete_topics([t for t in await admin.list_topics() if t in mine or t.startswith(groups)])


async def _until_streaming(producer: asyncio.subprocess.Process, log: IO[bytes], dsn: str, bootstrap: str, topic: str) -> None:
    """Until the producer's slot is active (changes from now on are captured) and its topic exists."""
    async with asyncio.timeout(READY_TIMEOUT):
        while not _slot_active(dsn):
            if producer.returncode is not None:
                log.seek(0)
                err = log.read().decode(errors="replace")
                raise RuntimeError(f"walbus produce exited with {producer.returncode}: {err[-2000:]}")
            await asyncio.sleep(0.2)
        await topic_partitions({"bootstrap_servers": bootstrap}, topic, poll_interval=0.2)


def _slot_active(dsn: str) -> bool:
    database = conninfo_to_dict(dsn).get("dbname")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT bool_or(active) FROM pg_replication_slots WHERE database = %s", (database,)).fetchone()
    return bool(row and row[0])


async def _stop(producer: asyncio.subprocess.Process) -> None:
    if producer.returncode is None:
        producer.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(producer.wait(), 60)
        except TimeoutError:
            producer.kill()
            await producer.wait()


def _drop_database(server_dsn: str, database: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (database,)).fetchall():
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(database)))


@pytest_asyncio.fixture
async def walbus_pipeline() -> AsyncIterator[Pipeline]:
    """pytest fixture: a :class:`Pipeline` for this test (see the module's docstring)."""
    async with pipeline() as p:
        yield p
