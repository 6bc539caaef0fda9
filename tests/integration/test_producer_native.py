"""The producer's native hot path (producer.native) against its pure-Python path on a real
pgoutput or wal2json stream: slots at the same position, one producer each (WALBUS_NATIVE=0, the
default, and the default writing LZ4 batches), the same records in every topic, byte for byte."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import slot_confirmed_lsn, walbus_process

pytestmark = pytest.mark.integration

ODD = 'quo"te \\ back\nline\ttab \x01 ä 日本 😀 \u2028'
SCHEMA = '''
CREATE TABLE "Odd ""Table"".x" (
    id int8 PRIMARY KEY, small int2, n int4, o oid, r float4, d float8, b bool,
    t text, v varchar(20), num numeric, ts timestamptz, j jsonb, "köl ""q""" text
);
ALTER TABLE "Odd ""Table"".x" REPLICA IDENTITY FULL;
CREATE TABLE plain (id int PRIMARY KEY, big text);
CREATE PUBLICATION native_ab FOR ALL TABLES;
'''
ROW = ("INSERT INTO \"Odd \"\"Table\"\".x\" VALUES "
       "(%s, -32768, 2147483647, 4294967295, %s, %s, %s, %s, 'v', 123456789012345678901234567890.5, "
       "'2024-01-02 03:04:05.97269+00', '{\"a\": [1, null]}', NULL)")
FLOATS = ["NaN", "Infinity", "-Infinity", "-0", "1e16", "1.5e-07", "3.4028235e+38", "0.1"]


def write_changes(dsn: str) -> None:
    """Every value kind the decoders convert, NULLs, unchanged TOAST, updates and deletes."""
    with psycopg.connect(dsn) as conn:
        for i, f in enumerate(FLOATS):
            conn.execute(ROW, (i, f, f, i % 2 == 0, ODD * (i + 1)))
        conn.execute("INSERT INTO plain SELECT g, repeat(md5(g::text), 4000) FROM generate_series(1, 3) g")  # TOASTed
        conn.execute("INSERT INTO plain SELECT g, 'row ' || g FROM generate_series(4, 500) g")
        conn.commit()
        conn.execute("UPDATE plain SET id = id + 1000 WHERE id <= 3")  # big stays TOASTed: unchanged
        conn.execute("UPDATE \"Odd \"\"Table\"\".x\" SET t = NULL, \"köl \"\"q\"\"\" = 'x' WHERE id < 4")
        conn.execute("DELETE FROM \"Odd \"\"Table\"\".x\" WHERE id >= 6")
        conn.execute("DELETE FROM plain WHERE id BETWEEN 10 AND 20")
        conn.execute("UPDATE plain SET big = 'changed ' || id WHERE id BETWEEN 30 AND 40")  # every column
        conn.execute("UPDATE plain SET id = id + 2000 WHERE id BETWEEN 50 AND 55")  # the key changes
        conn.commit()
        # DDL inside a transaction, several rows of each version: a run's shape changes with it
        conn.execute("INSERT INTO plain SELECT g, 'before ' || g FROM generate_series(600, 605) g")
        conn.execute("ALTER TABLE plain ADD COLUMN extra numeric(10,2)")
        conn.execute("INSERT INTO plain SELECT g, 'added ' || g, g / 4.0 FROM generate_series(606, 611) g")
        conn.execute("ALTER TABLE plain ALTER COLUMN extra TYPE numeric(12,4)")
        conn.execute("INSERT INTO plain SELECT g, 'retyped \"x\" ' || g, g / 4.0 FROM generate_series(612, 617) g")
        conn.execute("UPDATE plain SET extra = -extra WHERE id >= 606")
        conn.commit()


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


VARIANTS = {  # name: the producer's settings
    "pure": {"WALBUS_NATIVE": "0"},
    "native": {"WALBUS_NATIVE": "1"},
    "native-lz4": {"WALBUS_NATIVE": "1", "WALBUS_COMPRESSION": "lz4"},  # walbus_native's LZ4 record batches
}


async def drain(
    dsn: str, bootstrap: str, slot: str, topic: str, end: int, *, native: str, plugin: str, log: Path
) -> list[tuple[bytes | None, bytes | None]]:
    args = ["produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap, "--topic", topic, "--slot", slot, "--plugin", plugin,
            "--publication", "native_ab", "--snapshot-mode", "never", "--heartbeat-interval", "0"]
    proc = walbus_process(args, env=VARIANTS[native], log=log)
    try:
        deadline = time.monotonic() + 90
        while slot_confirmed_lsn(dsn, slot) < end:
            assert proc.poll() is None, f"the producer ({native}) exited {proc.returncode}: {tail(log)}"
            assert time.monotonic() < deadline, f"the producer ({native}) did not reach the end"
            await asyncio.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)
    return await read_topic(bootstrap, topic)


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_native_and_pure_python_producers_write_the_same_records(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path, plugin: str
) -> None:
    slots = {name: f"{unique_name}_{name.replace('-', '_')}"[-63:].lower() for name in VARIANTS}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA "Odd ""Table"""')
        conn.execute(SCHEMA)
        for slot in slots.values():
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (slot, plugin))
    write_changes(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
    assert row is not None
    end = int(row[0])
    records = {native: await drain(pg_dsn, kafka_bootstrap, slot, f"{unique_name}.{native}", end, native=native, plugin=plugin,
                                      log=tmp_path / f"producer-{native}.log")
               for native, slot in slots.items()}
    assert len(records["pure"]) == 8 + 500 + 3 + 4 + 2 + 11 + 11 + 6 + 18 + 21, [v for _, v in records["pure"]][:3]
    assert records["native"] == records["pure"]
    assert records["native-lz4"] == records["pure"]
