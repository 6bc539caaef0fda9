"""The producer's start against the real stack: refusals leave nothing behind (no topic for a
database that does not exist, no slot for a snapshot that cannot run), the initial snapshot
retries what streaming retries, and the idle producer's metrics say what the server says."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from producer import service
from producer.config import ProducerConfig
from producer.service import Producer
from tests.integration.test_ops_least_privilege import ROLE_PASSWORD, produce_once, role
from tests.support.kafka import create_topic, list_topics, read_topic
from tests.support.pipeline import running_producer
from walbus.kafka import KafkaAdmin

pytestmark = pytest.mark.integration
__all__ = ["role"]  # the fixture, imported for the test below


def sql_run(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


def slots_of(pg_dsn: str, database: str) -> list[str]:
    with psycopg.connect(pg_dsn) as conn:
        return [str(r[0]) for r in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (database,))]


def test_a_table_the_role_cannot_read_stops_the_start_before_the_slot(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, role: str,
) -> None:
    """REPLICATION and SELECT on one of two captured tables: the snapshot's COPY of the other
    ended the producer with exit 1, a traceback and a new slot left holding WAL, at every
    restart. Now a configuration error (exit 2) that names the GRANT, and no slot."""
    sql_run(pg_dsn, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)",
            f"CREATE ROLE \"{role}\" LOGIN REPLICATION PASSWORD '{ROLE_PASSWORD}'", f'GRANT SELECT ON a TO "{role}"',
            f"CREATE PUBLICATION walbus_{unique_name} FOR ALL TABLES")
    as_role = make_conninfo(pg_dsn, user=role, password=ROLE_PASSWORD)
    done = produce_once(as_role, kafka_bootstrap, "--topic", unique_name)
    assert done.returncode == 2, done.stderr
    assert f'GRANT SELECT ON "public"."b" TO "{role}"' in done.stderr and "public.a" not in done.stderr, done.stderr
    assert '"critical"' not in done.stderr and "Traceback" not in done.stderr
    assert slots_of(pg_dsn, unique_name) == []
    # Without a snapshot the role needs no SELECT right (pgoutput): streaming starts as before.
    sql_run(pg_dsn, f'GRANT SELECT ON b TO "{role}"')
    done = produce_once(as_role, kafka_bootstrap, "--topic", unique_name, "--snapshot-mode", "initial_only")
    assert done.returncode == 0, done.stderr


def test_a_snapshot_refused_after_creating_the_slot_drops_it(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """A row above the topic's limit stops the snapshot with exit 2 once the slot exists: the
    slot it created was left holding WAL until the next start dropped it."""
    asyncio.run(create_topic(kafka_bootstrap, unique_name, configs={"max.message.bytes": "20000"}))
    sql_run(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)", "INSERT INTO t VALUES (1, repeat('x', 50000))")
    done = produce_once(pg_dsn, kafka_bootstrap, "--topic", unique_name, "--slot", unique_name)
    assert done.returncode == 2 and "above the" in done.stderr, done.stderr
    assert slots_of(pg_dsn, unique_name) == []


def test_a_database_that_does_not_exist_leaves_no_topic(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """A mistyped database name: walbus.<typo> and its heartbeat topic were created before the
    exit-2 "does not exist"."""
    typo = f"{unique_name}_typo"
    done = produce_once(make_conninfo(pg_dsn, dbname=typo), kafka_bootstrap)
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr
    assert not [t for t in asyncio.run(list_topics(kafka_bootstrap)) if typo in t]


async def set_limit(bootstrap: str, topic: str, limit: int) -> None:
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        await admin.alter_topic_config(topic, {"max.message.bytes": str(limit)})


class LimitLoweredAtStart(Producer):
    """An operator lowers the topic's limit just after the producer read it: Kafka rejects
    the snapshot's batch of the large row (the producer checks records against the limit it
    read), as it rejects a streamed one."""

    async def _prepare_kafka(self, client_kwargs: dict[str, Any]) -> None:
        await super()._prepare_kafka(client_kwargs)
        await set_limit(client_kwargs["bootstrap_servers"], self.config.topic_name, 20000)


async def test_a_batch_kafka_rejects_during_the_initial_snapshot_is_retried(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The README says such a fault is retried as --retry-attempts says: in streaming it was,
    in the initial snapshot it ended the producer (exit 1, fatal)."""
    sql_run(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
            "INSERT INTO t SELECT g, 'small' FROM generate_series(1, 20) g", "INSERT INTO t VALUES (100, repeat('x', 50000))")
    cfg = ProducerConfig(pg_dsn=pg_dsn, kafka_bootstrap=kafka_bootstrap, topic=unique_name, slot=unique_name,
                         retry_max_delay=1.0, heartbeat_interval=0)
    producer = LimitLoweredAtStart(cfg)
    caplog.set_level(logging.WARNING, logger="walbus.producer")
    task = asyncio.create_task(producer.run())
    try:
        deadline = time.monotonic() + 60
        while not any("initial snapshot failed, retrying" in r.getMessage() for r in caplog.records):
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, "no retry of the initial snapshot"
            await asyncio.sleep(0.2)
        await set_limit(kafka_bootstrap, unique_name, 1 << 20)  # the operator puts it back
        await asyncio.wait_for(producer.ready.wait(), 60)
    finally:
        producer.stop()
        await asyncio.wait_for(task, 90)
    events = [orjson.loads(v) for _, v in await read_topic(kafka_bootstrap, unique_name) if v]
    reads = {e["values"][0] for e in events if e["operation"] == "read"}
    assert reads == {*range(1, 21), 100}
    assert len(slots_of(pg_dsn, unique_name)) == 1


async def test_an_idle_producer_with_heartbeats_has_no_events_in_flight(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """walbus_producer_in_flight_events read 1 on an idle producer: it was sampled just after
    each heartbeat was sent, and counted it."""
    sql_run(pg_dsn, "CREATE TABLE a (id int PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, heartbeat_interval=0.3) as producer:
        in_flight = []
        for _ in range(40):  # idle for 2 s: several beats
            in_flight.append(producer.registry.get_sample_value("walbus_producer_in_flight_events"))
            await asyncio.sleep(0.05)
    assert set(in_flight) == {0.0}, in_flight


async def test_the_slot_lag_metric_is_the_servers(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """walbus_producer_slot_lag_bytes read 0 on an idle producer while pg_replication_slots
    showed megabytes: it was the stream's wal_end minus the position just confirmed from it."""
    monkeypatch.setattr(service, "SLOT_LAG_CHECK_S", 0.2)
    other = f"{unique_name}_w"  # WAL of another database: the slot holds it until the next confirmation
    admin = make_conninfo(pg_dsn, dbname="postgres")
    sql_run(admin, f'CREATE DATABASE "{other}"')
    try:
        sql_run(make_conninfo(pg_dsn, dbname=other), "CREATE TABLE w (v text)")
        sql_run(pg_dsn, "CREATE TABLE a (id int PRIMARY KEY)")
        # Without heartbeats an idle producer confirms the server's position every 10 s.
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, heartbeat_interval=0) as producer:
            seen: list[tuple[float | None, int]] = []
            for _ in range(10):
                sql_run(make_conninfo(pg_dsn, dbname=other), "INSERT INTO w SELECT repeat('x', 1000) FROM generate_series(1, 4000)")
                for _ in range(8):
                    await asyncio.sleep(0.1)
                    seen.append((producer.registry.get_sample_value("walbus_producer_slot_lag_bytes"), server_lag(pg_dsn, unique_name)))
                if any(m is not None and m >= 2_000_000 for m, _ in seen):
                    break
            assert any(m is not None and m >= 2_000_000 for m, _ in seen), seen
    finally:
        with contextlib.suppress(psycopg.Error):
            sql_run(admin, f'DROP DATABASE "{other}" WITH (FORCE)')


def server_lag(pg_dsn: str, slot: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 FROM pg_replication_slots "
                           "WHERE slot_name = %s", (slot,)).fetchone()
        return int(str(row[0])) if row else -1


async def test_unlogged_and_temp_tables_do_not_stop_a_restart(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """PostgreSQL neither publishes nor decodes UNLOGGED and TEMP tables: the publication check
    counted them, and every restart stopped with exit 2 naming an ALTER PUBLICATION that cannot
    work (a warehouse fuzz: an UNLOGGED table, or another session's TEMP table)."""
    from walbus.config import ConfigError

    sql_run(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE UNLOGGED TABLE scratch (x int)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, tables=["public.*"]):
        sql_run(pg_dsn, "INSERT INTO t VALUES (1)", "INSERT INTO scratch VALUES (1)")
        await read_topic(kafka_bootstrap, unique_name, min_count=1)
    with psycopg.connect(pg_dsn) as other:
        other.execute("CREATE TEMP TABLE tmp (x int)")  # another session's: pg_temp_N.tmp
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, tables=["public.*"]):
            sql_run(pg_dsn, "INSERT INTO t VALUES (2)")
            records = await read_topic(kafka_bootstrap, unique_name, min_count=2)
    assert sorted(orjson.loads(v or b"")["table"] for _, v in records) == ["public.t", "public.t"]
    with pytest.raises(ConfigError, match="UNLOGGED"):
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=f"{unique_name}_2",
                                    tables=["public.scratch"]):
            pass
