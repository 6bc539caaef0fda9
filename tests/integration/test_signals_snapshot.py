"""Incremental snapshot signals against real PostgreSQL and Kafka: additional-conditions
(filters that work, filters that fail), pause-snapshot/resume-snapshot across a restart.

As in test_incremental.py the tables exist before the slot (``--snapshot-mode never``):
their rows reach the topic only through the snapshot the signal asks for.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import psycopg
import pytest
from prometheus_client import CollectorRegistry
from psycopg.conninfo import make_conninfo

from tests.integration.test_ops_least_privilege import ROLE_PASSWORD, role  # noqa: F401  (a fixture)
from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer
from tests.support.snapshot import assert_same, wait_slot_caught_up

pytestmark = pytest.mark.integration

SIGNAL = "public.walbus_signal"


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


def signal(dsn: str, sig_id: str, kind: str, data: dict[str, Any]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO walbus_signal VALUES (%s, %s, %s)", (sig_id, kind, orjson.dumps(data).decode()))


async def wait_sample(reg: CollectorRegistry, name: str, labels: dict[str, str], want: float, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while (reg.get_sample_value(name, labels) or 0) < want:
        assert time.monotonic() < deadline, f"{name}{labels} did not reach {want}"
        await asyncio.sleep(0.1)


def producer_options(slot: str, chunk: int) -> dict[str, Any]:
    return {"topic": slot, "slot": slot, "snapshot_mode": "never", "signal_table": SIGNAL,
            "incremental_chunk_size": chunk, "heartbeat_interval": 0.5}


async def events_of(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [orjson.loads(v) for _, v in await read_topic(bootstrap, topic) if v]


def least_privileged(pg_dsn: str, name: str, unique_name: str, readable: str) -> str:
    """A producer role with REPLICATION and SELECT on the signal table and ``readable`` only,
    a publication of all tables for it; its DSN."""
    sql(pg_dsn, f'CREATE ROLE "{name}" LOGIN REPLICATION PASSWORD \'{ROLE_PASSWORD}\'',
        f'GRANT SELECT ON walbus_signal, {readable} TO "{name}"', f"CREATE PUBLICATION walbus_{unique_name} FOR ALL TABLES")
    return make_conninfo(pg_dsn, user=name, password=ROLE_PASSWORD)


SIGNAL_DDL = "CREATE TABLE walbus_signal (id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, data text)"


async def test_additional_conditions_read_only_matching_rows(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    rows = 3000
    sql(pg_dsn, SIGNAL_DDL,
        "CREATE TABLE orders (id int PRIMARY KEY, color text NOT NULL, n int)",
        f"INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'blue' ELSE 'red' END, 0 FROM generate_series(0, {rows - 1}) g")
    async with running_producer(pg_dsn, kafka_bootstrap, **producer_options(unique_name, 100)) as producer:
        signal(pg_dsn, "sig-1", "execute-snapshot", {
            "data-collections": ["public.orders"], "type": "incremental",
            "additional-conditions": [{"data-collection": "public.orders", "filter": "color = 'blue' AND n % 100 = 0"}],
        })
        reg = producer.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        # Later changes of rows the filter left out stream as always.
        sql(pg_dsn, "UPDATE orders SET n = 7 WHERE id IN (1, 3)")
        await wait_slot_caught_up(pg_dsn, unique_name)
    events = await events_of(kafka_bootstrap, unique_name)
    reads = [e for e in events if e["operation"] == "read"]
    assert sorted(e["values"][0] for e in reads) == list(range(0, rows, 3))
    assert {e["values"][1] for e in reads} == {"blue"}
    updates = {e["values"][0]: e["values"] for e in events if e["operation"] == "update"}
    assert updates == {1: [1, "red", 7], 3: [3, "blue", 7]}


async def test_a_bad_filter_fails_its_table_only(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """Filters that do not parse, name no column, fail on a row, try a second statement or a
    write, or run too long: each fails its own table (metric + log line, not retried); the others are read,
    nothing is written, streaming goes on."""
    tables = ["unknown_col", "div_zero", "two_statements", "writes", "sleeps", "fine"]
    sql(pg_dsn, SIGNAL_DDL, "CREATE TABLE victim (id int PRIMARY KEY)", "CREATE TABLE side (x int)",
        "CREATE FUNCTION walbus_write() RETURNS boolean LANGUAGE sql AS 'INSERT INTO side VALUES (1) RETURNING true'",
        *[f"CREATE TABLE {t} (id int PRIMARY KEY, v text)" for t in tables],
        *[f"INSERT INTO {t} SELECT g, 'v' || g FROM generate_series(1, 50) g" for t in tables])
    filters = {
        "unknown_col": "no_such_column = 1",
        "div_zero": "1 / (id - id) = 1",
        "two_statements": "true) ; DROP TABLE victim; SELECT (1",
        "writes": "walbus_write()",
        "sleeps": "pg_sleep(600) IS NOT NULL",  # cancelled by --incremental-filter-timeout
        "fine": "id <= 10",
    }
    options = {**producer_options(unique_name, 20), "incremental_filter_timeout": 1.0}
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as producer:
        signal(pg_dsn, "sig-1", "execute-snapshot", {
            "data-collections": [f"public.{t}" for t in tables],
            "additional-conditions": [{"data-collection": f"public.{t}", "filter": f} for t, f in filters.items()],
        })
        reg = producer.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        for t in tables[:-1]:
            assert reg.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": f"public.{t}"}) == 1, t
        assert reg.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": "public.fine"}) is None
        assert producer.incremental is not None and producer.incremental.position is None  # done, not retrying
        sql(pg_dsn, "INSERT INTO unknown_col VALUES (1000, 'after')")
        await wait_slot_caught_up(pg_dsn, unique_name)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM victim").fetchone() == (0,)  # the table is still there
        assert conn.execute("SELECT count(*) FROM side").fetchone() == (0,)  # the filter's write was refused
    events = await events_of(kafka_bootstrap, unique_name)
    reads = [(e["table"], e["values"][0]) for e in events if e["operation"] == "read"]
    assert sorted(reads) == [("public.fine", i) for i in range(1, 11)]
    assert [e["values"] for e in events if e["operation"] == "insert" and e["table"] == "public.unknown_col"] == [[1000, "after"]]


async def test_pause_survives_a_restart_and_resume_completes(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    rows = 5000
    sql(pg_dsn, SIGNAL_DDL, "CREATE TABLE orders (id int PRIMARY KEY, v text, n int)",
        f"INSERT INTO orders SELECT g, md5(g::text), 0 FROM generate_series(0, {rows - 1}) g")
    options = producer_options(unique_name, 100)
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as first:
        signal(pg_dsn, "sig-1", "execute-snapshot", {"data-collections": ["public.orders"]})
        await wait_sample(first.registry, "walbus_snapshot_chunks_total", {"table": "public.orders"}, 3)
        signal(pg_dsn, "sig-2", "pause-snapshot", {})
        await wait_sample(first.registry, "walbus_snapshot_paused", {"kind": "incremental"}, 1)
        await wait_slot_caught_up(pg_dsn, unique_name)
        assert first.registry.get_sample_value("walbus_snapshot_completed", {"kind": "incremental"}) == 0
    sql(pg_dsn, "UPDATE orders SET n = 1 WHERE id % 7 = 0", "DELETE FROM orders WHERE id % 11 = 0")
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as second:
        reg = second.registry
        assert second.incremental is not None
        pos = second.incremental.position
        assert pos is not None and pos.paused and pos.last_key is not None
        resumed_after = int(pos.last_key[0])
        assert reg.get_sample_value("walbus_snapshot_paused", {"kind": "incremental"}) == 1
        sql(pg_dsn, "UPDATE orders SET n = 42 WHERE id = 4999", f"INSERT INTO orders VALUES ({rows}, 'new', 0)")
        await wait_slot_caught_up(pg_dsn, unique_name)
        # Paused: the writes streamed, no chunk was read.
        streamed = await events_of(kafka_bootstrap, unique_name)
        assert [e["values"][2] for e in streamed if e["operation"] == "update" and e["values"][0] == 4999] == [42]
        assert reg.get_sample_value("walbus_snapshot_chunks_total", {"table": "public.orders"}) is None
        signal(pg_dsn, "sig-3", "resume-snapshot", {})
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        assert reg.get_sample_value("walbus_snapshot_paused", {"kind": "incremental"}) == 0
        # Resumed from the saved chunk position, not from the start.
        scanned = reg.get_sample_value("walbus_snapshot_rows_scanned_total", {"kind": "incremental", "table": "public.orders"})
        assert scanned is not None and 0 < scanned < rows - resumed_after
        await wait_slot_caught_up(pg_dsn, unique_name)
    assert_same(await read_topic(kafka_bootstrap, unique_name), pg_dsn, "orders", "public.orders")


async def test_filters_of_a_least_privileged_producer(pg_dsn: str, kafka_bootstrap: str, unique_name: str, role: str) -> None:  # noqa: F811
    """A producer role with REPLICATION and SELECT only runs filters as itself: the good one
    reads, the writing one fails its table (read only, and no INSERT right)."""
    sql(pg_dsn, SIGNAL_DDL, "CREATE TABLE side (x int)",
        "CREATE FUNCTION walbus_write() RETURNS boolean LANGUAGE sql AS 'INSERT INTO side VALUES (1) RETURNING true'",
        "CREATE TABLE good (id int PRIMARY KEY)", "CREATE TABLE bad (id int PRIMARY KEY)",
        "INSERT INTO good SELECT generate_series(1, 30)", "INSERT INTO bad SELECT generate_series(1, 30)")
    as_role = least_privileged(pg_dsn, role, unique_name, "good, bad")
    async with running_producer(as_role, kafka_bootstrap, **producer_options(unique_name, 10)) as producer:
        signal(pg_dsn, "sig-1", "execute-snapshot", {
            "data-collections": ["public.good", "public.bad"],
            "additional-conditions": [{"data-collection": "public.good", "filter": "id % 2 = 0"},
                                      {"data-collection": "public.bad", "filter": "walbus_write()"}],
        })
        reg = producer.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        assert reg.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": "public.bad"}) == 1
        await wait_slot_caught_up(pg_dsn, unique_name)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM side").fetchone() == (0,)
    events = await events_of(kafka_bootstrap, unique_name)
    assert sorted(e["values"][0] for e in events if e["operation"] == "read") == list(range(2, 31, 2))


async def test_a_table_the_role_cannot_read_fails_without_blocking_the_queue(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, role: str,  # noqa: F811
) -> None:
    """No SELECT right on a queued table (no filter): the chunk query fails the same way every
    time, so the table fails (metric, log line) and the tables behind it are read. It used to
    be retried every 2 s forever, and the snapshot never completed."""
    sql(pg_dsn, SIGNAL_DDL,
        "CREATE TABLE secret (id int PRIMARY KEY)", "CREATE TABLE open_one (id int PRIMARY KEY)",
        "INSERT INTO secret SELECT generate_series(1, 20)", "INSERT INTO open_one SELECT generate_series(1, 25)")
    as_role = least_privileged(pg_dsn, role, unique_name, "open_one")
    async with running_producer(as_role, kafka_bootstrap, **producer_options(unique_name, 10)) as producer:
        signal(pg_dsn, "sig-1", "execute-snapshot", {"data-collections": ["public.secret", "public.open_one"]})
        reg = producer.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1, within=60)
        assert reg.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": "public.secret"}) == 1
        assert reg.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": "public.open_one"}) is None
        # Streaming of the unreadable table goes on (pgoutput needs no SELECT right).
        sql(pg_dsn, "INSERT INTO secret VALUES (100)")
        await wait_slot_caught_up(pg_dsn, unique_name)
    events = await events_of(kafka_bootstrap, unique_name)
    assert sorted(e["values"][0] for e in events if e["operation"] == "read") == list(range(1, 26))
    assert [e["values"] for e in events if e["operation"] == "insert" and e["table"] == "public.secret"] == [[100]]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_a_partitioned_signal_table_is_refused_at_start(pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str) -> None:
    # A partitioned table's rows are decoded under their partition's name (wal2json, and
    # pgoutput without publish_via_partition_root): signals are recognised by the signal
    # table's name, so the producer started and passed over every signal row, without a word.
    from walbus.config import ConfigError

    sql(pg_dsn, "CREATE TABLE walbus_signal (id varchar(64), type varchar(32) NOT NULL, data text, PRIMARY KEY (id, type)) "
                "PARTITION BY LIST (type)", "CREATE TABLE walbus_signal_all PARTITION OF walbus_signal DEFAULT")
    with pytest.raises(ConfigError) as err:
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, snapshot_mode="never",
                                    signal_table=SIGNAL, plugin=plugin):
            pass
    assert "partitioned" in str(err.value) and "public.walbus_signal" in str(err.value)
