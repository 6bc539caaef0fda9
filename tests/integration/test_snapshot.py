"""The initial snapshot against real PostgreSQL and Kafka, writers running throughout.

The issue asks for 200,000 rows; CI uses WALBUS_SNAPSHOT_TEST_ROWS (default 50,000) to stay
within the shared machine's budget: ``WALBUS_SNAPSHOT_TEST_ROWS=200000 pytest …`` runs it whole.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import psycopg
import pytest

from producer.snapshot import SnapshotOutdated, check_unchanged, lock_tables
from tests.support.kafka import end_offsets, read_topic
from tests.support.pipeline import (
    kill9,
    walbus_process,
)
from tests.support.snapshot import Churn, assert_same, log_events, wait_log, wait_slot_caught_up
from walbus.contract import event_key

pytestmark = pytest.mark.integration

ROWS = int(os.environ.get("WALBUS_SNAPSHOT_TEST_ROWS", "50000"))


def make_tables(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text, n int)")
        conn.execute("CREATE TABLE small (id int PRIMARY KEY, v text, n int)")
        conn.execute("INSERT INTO big SELECT g, md5(g::text), 0 FROM generate_series(0, %s - 1) g", (rows,))
        conn.execute("INSERT INTO small SELECT g, 'tab\there\\back\nline', 0 FROM generate_series(0, 999) g")
        conn.execute("INSERT INTO small VALUES (5000, NULL, NULL)")
        conn.execute("ANALYZE")


def produce_args(dsn: str, bootstrap: str, topic: str, *extra: str) -> list[str]:
    return [
        "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap, "--topic", topic, "--slot", topic,
        "--heartbeat-interval", "0.5", "--snapshot-workers", "2", *extra,
    ]


async def test_initial_snapshot_with_writers(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    make_tables(pg_dsn, ROWS)
    churn_big, churn_small = Churn(pg_dsn, "big", ROWS), Churn(pg_dsn, "small", 1000)
    churn_big.start()
    churn_small.start()
    log = tmp_path / "producer.log"
    proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, unique_name), log=log)
    try:
        await wait_log(log, "initial snapshot completed")
        await wait_log(log, "replication started")
        await asyncio.sleep(2)  # some streaming on top of the snapshot
        churn_big.finish()
        churn_small.finish()
        await wait_slot_caught_up(pg_dsn, unique_name)
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0
    records = await read_topic(kafka_bootstrap, unique_name)
    reads = [orjson.loads(v) for _, v in records if v and b'"operation":"read"' in v]
    assert len(reads) == len({(r["table"], r["values"][0]) for r in reads})  # each row once
    cp = reads[0]["commit_lsn"]
    assert all(r["lsn"] == r["commit_lsn"] == cp for r in reads)
    assert [r["seq"] for r in reads] == list(range(len(reads)))
    assert [k for k, _ in records] == sorted(k for k, _ in records if k is not None)  # keys in topic order
    assert records[0][0] == event_key(cp, 0)
    assert churn_big.transactions > 50
    assert_same(records, pg_dsn, "big", "public.big")
    assert_same(records, pg_dsn, "small", "public.small")
    small_rows = {r["values"][0]: r["values"] for r in reads if r["table"] == "public.small"}
    assert small_rows[5000] == [5000, None, None]


async def test_kill9_mid_snapshot_redoes_it(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    rows = ROWS * 4  # read in well over a second even as fast as the snapshot goes (CI: once in 0.5 s at ROWS)
    make_tables(pg_dsn, rows)
    churn = Churn(pg_dsn, "big", rows, pause=0.0005)
    churn.start()
    log = tmp_path / "producer.log"
    # Small batches and one batch in flight: the snapshot takes long enough to be killed in the middle.
    args = produce_args(pg_dsn, kafka_bootstrap, unique_name, "--snapshot-fetch-rows", "200", "--max-in-flight", "1", "--max-batch-bytes", "16384")
    proc = walbus_process(args, log=log)
    try:
        await wait_log(log, "initial snapshot started")
        # Killed as soon as Kafka holds some of its reads: mid-snapshot by what it did, not by a clock.
        deadline = asyncio.get_running_loop().time() + 120
        while sum((await end_offsets(kafka_bootstrap, unique_name)).values()) < 500:
            assert asyncio.get_running_loop().time() < deadline, "the snapshot wrote nothing"
            await asyncio.sleep(0.02)
        kill9(proc)
        assert not log_events(log, "initial snapshot completed"), "the snapshot finished before the kill: make it bigger"
        # Rows the first attempt emitted, deleted before the second: it must emit their deletes.
        first = [orjson.loads(v) for _, v in await read_topic(kafka_bootstrap, unique_name) if v]
        gone = sorted({e["values"][0] for e in first if e["table"] == "public.big"})[:10]
        assert len(gone) == 10
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM big WHERE id = ANY(%s)", (gone,))
        proc = walbus_process(args, log=log)
        await wait_log(log, "the initial snapshot was interrupted before completion: redoing it")
        await wait_log(log, "initial snapshot completed")
        await wait_log(log, "replication started")
        await asyncio.sleep(1)
        churn.finish()
        await wait_slot_caught_up(pg_dsn, unique_name)
    finally:
        proc.terminate()
        proc.wait(30)
    records = await read_topic(kafka_bootstrap, unique_name)
    first_cp = orjson.loads(records[0][1] or b"{}")["commit_lsn"]
    attempts = {orjson.loads(v)["commit_lsn"] for _, v in records if v and b'"operation":"read"' in v}
    assert len(attempts) == 2 and first_cp == min(attempts)
    completed = log_events(log, "initial snapshot completed")
    assert len(completed) == 1 and completed[0]["attempt"] == 2
    assert completed[0]["deletes_of_vanished_rows"] >= len(gone)
    assert_same(records, pg_dsn, "big", "public.big")
    assert_same(records, pg_dsn, "small", "public.small")


async def test_initial_only_and_never(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    make_tables(pg_dsn, 2000)
    log = tmp_path / "producer.log"
    proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, unique_name, "--snapshot-mode", "initial_only"), log=log)
    assert proc.wait(120) == 0, log.read_text()[-3000:]
    records = await read_topic(kafka_bootstrap, unique_name)
    assert len(records) == 2000 + 1001
    # A completed snapshot is not redone: a second initial_only start exits at once, adding nothing.
    proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, unique_name, "--snapshot-mode", "initial_only"), log=log)
    assert proc.wait(120) == 0
    assert len(await read_topic(kafka_bootstrap, unique_name)) == 3001
    # never: a new slot, no snapshot.
    other = unique_name + "_n"
    proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, other, "--snapshot-mode", "never"), log=log)
    try:
        await wait_log(log, "replication started", after=0)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO small VALUES (7000, 'x', 1)")
        records = await read_topic(kafka_bootstrap, other, min_count=1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert [orjson.loads(v or b"")["operation"] for _, v in records] == ["insert"]


async def wait_snapshot_blocked(dsn: str, timeout: float = 60) -> None:
    """Until a snapshot connection of the producer waits for a table lock."""
    deadline = asyncio.get_running_loop().time() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not conn.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'walbus-snapshot-%' AND wait_event_type = 'Lock' "
            "AND datname = current_database()"
        ).fetchone():
            assert asyncio.get_running_loop().time() < deadline, "the snapshot never waited for the table's lock"
            await asyncio.sleep(0.05)


async def test_table_rewritten_after_the_export_is_read_whole(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    """A table rewritten after the snapshot was exported and before it was read: PostgreSQL's
    rewrites are not MVCC-safe, and the snapshot read it as empty (its 100 rows lost for good:
    an ALTER … TYPE streams no row change). Deterministic: the ALTER holds its lock from before
    the export (an existing slot's, --snapshot-mode always: taken at once) and commits once the
    snapshot waits for that lock, after the export and before the read."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE victim (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO victim SELECT g, g FROM generate_series(1, 100) g")
    log = tmp_path / "producer.log"
    proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, unique_name, "--snapshot-mode", "never"), log=log)
    try:
        await wait_log(log, "replication started")
    finally:
        proc.terminate()
        proc.wait(30)
    alter = psycopg.connect(pg_dsn)
    try:
        alter.execute("ALTER TABLE victim ALTER COLUMN v TYPE bigint")  # a rewrite, its lock held until the commit
        proc = walbus_process(produce_args(pg_dsn, kafka_bootstrap, unique_name, "--snapshot-mode", "always", "--snapshot-workers", "1"), log=log)
        try:
            await wait_snapshot_blocked(pg_dsn)
            alter.commit()
            await wait_log(log, "initial snapshot completed")
            await wait_log(log, "replication started", after=log.read_bytes().rfind(b"initial snapshot completed"))
            await wait_slot_caught_up(pg_dsn, unique_name)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        alter.close()
    records = await read_topic(kafka_bootstrap, unique_name)
    assert_same(records, pg_dsn, "victim", "public.victim")
    assert log_events(log, "tables to snapshot were rewritten (TRUNCATE, ALTER TABLE … TYPE, VACUUM FULL, CLUSTER) or "
                           "replaced after the snapshot's consistent point, which cannot read them: taking the snapshot again")


def test_lock_and_check_of_the_tables_to_read(pg_dsn: str) -> None:
    """check_unchanged sees a partition rewritten and a table replaced under its name after
    the snapshot was taken; lock_tables gives up on a table another session keeps locked,
    leaving the snapshot's transaction usable."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE parted (id int) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (10)")
        conn.execute("CREATE TABLE parted_2 PARTITION OF parted FOR VALUES FROM (10) TO (20)")
        conn.execute("CREATE TABLE t (id int)")
        conn.execute("CREATE TABLE kept (id int)")
    tables = [("public", "parted"), ("public", "t"), ("public", "kept")]
    with psycopg.connect(pg_dsn, autocommit=True) as reader, psycopg.connect(pg_dsn, autocommit=True) as ddl:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        reader.execute("SELECT 1")  # the snapshot
        lock_tables(reader, tables)
        check_unchanged(reader, tables)
        reader.execute("ROLLBACK")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        reader.execute("SELECT 1")
        ddl.execute("TRUNCATE parted_2")
        ddl.execute("ALTER TABLE t RENAME TO t_old")
        ddl.execute("CREATE TABLE t (id int)")
        lock_tables(reader, tables)
        with pytest.raises(SnapshotOutdated, match=r"public\.parted, public\.t$"):
            check_unchanged(reader, tables)
        reader.execute("ROLLBACK")
        ddl.execute("BEGIN")
        ddl.execute("LOCK TABLE kept IN ACCESS EXCLUSIVE MODE")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        reader.execute("SELECT 1")
        with pytest.raises(SnapshotOutdated, match=r"public\.kept stayed locked"):
            lock_tables(reader, tables)
        assert reader.execute("SELECT count(*) FROM parted").fetchone() == (0,)  # still in its transaction
        ddl.execute("ROLLBACK")
