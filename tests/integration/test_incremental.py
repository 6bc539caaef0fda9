"""Incremental (watermark) snapshots against real PostgreSQL and Kafka, a writer churning the table.

The table exists before the slot and the producer runs with ``--snapshot-mode never``: its
rows are in no event until the ``execute-snapshot`` signal (a table "added to the capture
list" later, with the default FOR ALL TABLES publication).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import (
    kill9,
    running_producer,
    walbus_process,
)
from tests.support.snapshot import Churn, assert_same, log_events, wait_log, wait_slot_caught_up

pytestmark = pytest.mark.integration

ROWS = 20_000
SIGNAL = "public.walbus_signal"


def make_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE walbus_signal (id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, data text)")
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text, n int)")
        conn.execute("INSERT INTO orders SELECT g, md5(g::text), 0 FROM generate_series(0, %s - 1) g", (ROWS,))


def signal(dsn: str, sig_id: str, kind: str, tables: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO walbus_signal VALUES (%s, %s, %s)", (sig_id, kind, orjson.dumps({"data-collections": tables}).decode())
        )


async def test_incremental_snapshot_with_writer(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    make_tables(pg_dsn)
    churn = Churn(pg_dsn, "orders", ROWS, pause=0.001)
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, snapshot_mode="never",
        signal_table=SIGNAL, incremental_chunk_size=500, heartbeat_interval=0.5,
    ) as producer:
        churn.start()
        await asyncio.sleep(0.5)
        signal(pg_dsn, "sig-1", "execute-snapshot", ["public.orders"])
        deadline = time.monotonic() + 120
        reg = producer.registry
        while reg.get_sample_value("walbus_snapshot_completed", {"kind": "incremental"}) != 1:
            assert time.monotonic() < deadline, "incremental snapshot did not complete"
            await asyncio.sleep(0.2)
        assert reg.get_sample_value("walbus_snapshot_rows_scanned_total", {"kind": "incremental", "table": "public.orders"}) >= ROWS * 0.9
        assert reg.get_sample_value("walbus_snapshot_tables_remaining", {"kind": "incremental"}) == 0
        assert reg.get_sample_value("walbus_snapshot_running", {"kind": "incremental"}) == 0
        await asyncio.sleep(1)
        churn.finish()
        await wait_slot_caught_up(pg_dsn, unique_name)
    records = await read_topic(kafka_bootstrap, unique_name)
    events = [orjson.loads(v) for _, v in records if v]
    reads = [e for e in events if e["operation"] == "read"]
    assert reads and all(e["table"] == "public.orders" for e in reads)
    assert len({e["values"][0] for e in reads}) == len(reads)  # each row read once at most
    assert len(reads) < ROWS + churn.next_id  # rows changed in a window were not read
    assert [k for k, _ in records] == sorted(k for k, _ in records if k is not None)  # keys in topic order
    assert churn.transactions > 50
    assert_same(records, pg_dsn, "orders", "public.orders")


async def test_incremental_resumes_after_kill9(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    make_tables(pg_dsn)
    churn = Churn(pg_dsn, "orders", ROWS, pause=0.001)
    churn.start()
    log = tmp_path / "producer.log"
    args = [
        "produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--slot", unique_name,
        "--heartbeat-interval", "0.5", "--snapshot-mode", "never", "--signal-table", SIGNAL, "--incremental-chunk-size", "200",
    ]
    proc = walbus_process(args, log=log)
    try:
        await wait_log(log, "replication started")
        signal(pg_dsn, "sig-1", "execute-snapshot", ["public.orders"])
        deadline = time.monotonic() + 60
        while len(log_events(log, "incremental snapshot chunk")) < 15:
            assert time.monotonic() < deadline, "no incremental snapshot chunks"
            await asyncio.sleep(0.05)
        kill9(proc)
        before = len(log_events(log, "incremental snapshot chunk"))
        assert not log_events(log, "incremental snapshot completed")
        proc = walbus_process(args, log=log)
        await wait_log(log, "incremental snapshot completed")
        await asyncio.sleep(1)
        churn.finish()
        await wait_slot_caught_up(pg_dsn, unique_name)
    finally:
        proc.terminate()
        proc.wait(30)
    resumed = log_events(log, "incremental snapshot resumed")
    assert len(resumed) == 1 and resumed[0]["after_key"] is not None, resumed
    chunks = log_events(log, "incremental snapshot chunk")
    after_restart = chunks[before:]
    # The first chunk after the restart starts after the last saved chunk (not from the start) …
    assert after_restart[0]["from_key"] == resumed[0]["after_key"]
    done_before = [c["last_key"] for c in chunks[:before]]
    assert resumed[0]["after_key"] in done_before
    # … so at most the few chunks finished but not yet saved were read twice.
    assert len(chunks) <= ROWS // 200 + 1 + 5
    records = await read_topic(kafka_bootstrap, unique_name)
    assert_same(records, pg_dsn, "orders", "public.orders")


async def test_stop_snapshot(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    make_tables(pg_dsn)
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, snapshot_mode="never",
        signal_table=SIGNAL, incremental_chunk_size=10, heartbeat_interval=0.5,
    ) as producer:
        signal(pg_dsn, "sig-1", "execute-snapshot", ["public.orders"])
        reg = producer.registry
        deadline = time.monotonic() + 60
        while (reg.get_sample_value("walbus_snapshot_chunks_total", {"table": "public.orders"}) or 0) < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        signal(pg_dsn, "sig-2", "stop-snapshot", [])
        while reg.get_sample_value("walbus_snapshot_aborted", {"kind": "incremental"}) != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        chunks = reg.get_sample_value("walbus_snapshot_chunks_total", {"table": "public.orders"})
        await asyncio.sleep(1)
        assert reg.get_sample_value("walbus_snapshot_chunks_total", {"table": "public.orders"}) == chunks
        assert chunks is not None and chunks < ROWS // 10
