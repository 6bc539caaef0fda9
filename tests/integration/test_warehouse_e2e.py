"""PostgreSQL -> producer -> topic -> warehouse, on a randomized workload (CI-sized).

The current tables must equal ``SELECT *`` of the source tables, and each history table must
hold exactly one row per change event of its table (re-sent duplicates counted once).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import random
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import confirmed_past, running_producer
from tests.support.warehouse import kafka_options, produce_records, table_paths
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

DDL = """
CREATE TABLE orders (id int8 PRIMARY KEY, customer text, amount numeric(12,2), paid bool,
                     created timestamptz, tags text[], note text);
CREATE TABLE lines (order_id int8, line int4, qty int2, price float8, sku uuid, data jsonb, d date,
                    PRIMARY KEY (order_id, line));
CREATE TABLE kv (k text PRIMARY KEY, v bytea, n int4[], ts timestamp);
CREATE TABLE done (id int PRIMARY KEY);
"""
TABLES = ("public.orders", "public.lines", "public.kv")
# the source as Python values comparable with Spark's: uuid and jsonb as PostgreSQL text
SELECTS = {
    "public.orders": "SELECT id, customer, amount, paid, created, tags, note FROM orders",
    "public.lines": "SELECT order_id, line, qty, price, sku::text, data::text, d FROM lines",
    "public.kv": "SELECT k, v, n, ts FROM kv",
}
KEYS = {"public.orders": 1, "public.lines": 2, "public.kv": 1}


def _note(rng: random.Random) -> str:
    # incompressible and > 2 kB: stored out of line (TOAST), so updates that leave it
    # alone send it as unchanged
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3000))


def _workload(conn: psycopg.Connection[Any], rng: random.Random, phase: int) -> None:
    base = phase * 10_000
    with conn.transaction():  # a large transaction
        for i in range(base, base + 300):
            conn.execute(
                "INSERT INTO orders VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (i, rng.choice(["ann", "bob", None]), Decimal(rng.randint(0, 10**8)) / 100, rng.random() < 0.5,
                 dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=rng.randint(0, 10**7), microseconds=rng.randint(0, 999999)),
                 rng.choice([["a", "b c"], [], None, ['q"uote', None]]), _note(rng) if rng.random() < 0.3 else "short"),
            )
    with conn.cursor() as cur, cur.copy("COPY lines FROM STDIN") as copy:  # COPY: LSNs repeat
        for i in range(base, base + 300):
            for line in range(rng.randint(1, 2)):
                copy.write_row((i, line, rng.randint(-5, 5), rng.choice([1.5, -0.1, 1e300, None]),
                                f"00000000-0000-0000-0000-{i:012d}", orjson.dumps({"i": i, "x": [1, None]}).decode(),
                                dt.date(2024, 1, 1) + dt.timedelta(days=rng.randint(0, 400))))
    for i in range(base, base + 100):
        conn.execute("INSERT INTO kv VALUES (%s, %s, %s, %s)",
                     (f"k{i}", rng.randbytes(rng.randint(0, 8)) if rng.random() < 0.8 else None,
                      [rng.randint(-9, 9), None], dt.datetime(2023, 5, 6, 7, 8, 9, rng.randint(0, 999999))))
    for _ in range(150):  # small random transactions
        with conn.transaction():
            op = rng.random()
            i = base + rng.randrange(300)
            if op < 0.35:  # leaves the TOASTed note unchanged
                conn.execute("UPDATE orders SET paid = NOT paid, amount = amount + 1 WHERE id = %s", (i,))
            elif op < 0.5:
                conn.execute("UPDATE lines SET qty = qty + 1, data = NULL WHERE order_id = %s", (i,))
            elif op < 0.6:
                conn.execute("DELETE FROM orders WHERE id = %s", (i,))
            elif op < 0.7:
                conn.execute("DELETE FROM lines WHERE order_id = %s AND line = 0", (i,))
            elif op < 0.8:  # key update
                conn.execute("UPDATE kv SET k = k || 'x', ts = NULL WHERE k = %s", (f"k{base + rng.randrange(100)}",))
            elif op < 0.9:
                conn.execute("UPDATE lines SET line = line + 10 WHERE order_id = %s", (i,))
            else:
                conn.execute("UPDATE orders SET note = %s WHERE id = %s", (_note(rng), i))


def _resent_transactions(records: list[tuple[bytes | None, bytes | None]]) -> list[tuple[bytes, bytes]]:
    """The records of two whole transactions, as a producer that restarted its stream sends
    them again (same keys): the first one (inserts) and the first update of orders."""
    events = [(k, v, orjson.loads(v)) for k, v in records if k is not None and v is not None]
    first = events[0][2]["commit_lsn"]
    update = next(e["commit_lsn"] for _, _, e in events if e["table"] == "public.orders" and e["operation"] == "update")
    return [(k, v) for k, v, e in events if e["commit_lsn"] in (first, update)]


def _norm(value: Any) -> Any:
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    if isinstance(value, Decimal):
        return value.normalize()
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-15)
    return bool(a == b)


async def test_postgres_to_warehouse_randomized(
    spark: Any, pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(20240601)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(DDL)  # type: ignore[arg-type]
    spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name):
        for phase in range(2):
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                _workload(conn, rng, phase)
                conn.execute("INSERT INTO done VALUES (%s)", (phase,))
            records = await read_topic(kafka_bootstrap, unique_name, min_count=1)
            while not any(b'"table":"public.done"' in (v or b"") and f'"values":[{phase}]'.encode() in (v or b"")
                          for _, v in records):
                records = await read_topic(kafka_bootstrap, unique_name, min_count=len(records) + 1)
            if phase == 0:
                resent = _resent_transactions(records)
                await asyncio.to_thread(produce_records, kafka_bootstrap, unique_name, resent)
                records = await read_topic(kafka_bootstrap, unique_name, min_count=len(records) + len(resent))
            # A load ends after the last commit a heartbeat confirmed (a nightly load of a
            # quiet database sees the beat that followed it): the phase's last one.
            done = max(orjson.loads(v)["commit_lsn"] for _, v in records if v is not None)
            await confirmed_past(kafka_bootstrap, unique_name, done)
            run_load(spark, spec)  # one load per phase: the second is incremental
    events = [orjson.loads(v) for _, v in records if v is not None]
    # a producer that restarted its stream re-sends whole transactions with the same
    # positions: legal duplicates, one history row each
    unique = {(e["commit_lsn"], e["seq"]): e for e in events}
    assert len(unique) < len(events), "the topic should hold re-sent transactions"
    per_table = Counter(e["table"] for e in unique.values())
    assert any(e.get("unchanged") for e in events), "the workload should produce unchanged TOAST values"
    with psycopg.connect(pg_dsn) as conn:
        for table in TABLES:
            paths = table_paths(tmp_path, unique_name, table)
            hist = spark.read.format("delta").load(paths.history)
            assert hist.count() == per_table[table], table
            cols = [c.name for c in conn.execute(SELECTS[table]).description or []]  # type: ignore[union-attr]
            source = sorted((tuple(_norm(v) for v in row) for row in conn.execute(SELECTS[table]).fetchall()),
                            key=repr)
            live = spark.read.format("delta").load(paths.current).where("NOT _walbus_deleted").select(
                *[c.split("::")[0] for c in cols]
            ).collect()
            loaded = sorted((tuple(_norm(v) for v in row) for row in live), key=repr)
            assert len(loaded) == len(source), table
            for want, got in zip(source, loaded, strict=True):
                assert all(_same(a, b) for a, b in zip(want, got, strict=True)), (table, want, got)
