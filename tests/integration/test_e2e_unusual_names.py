"""Names PostgreSQL accepts but Kafka and Spark do not take as they are, end to end.

A schema with a dot, tables named ``Order Items``, ``a.b`` beside ``a_b``, ``say "hi"``, a
63-byte unicode name and one ending in a newline, columns named ``a.b``, ``Qty "x"`` and ``ö``, a 1.5 MB value left
unchanged by a later update, and an ADD COLUMN inside a transaction that already wrote to the
table: through the real producer, demux, ``Feed``, ``Table`` and warehouse load, every change
arrives once with its exact names and values.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.support.pipeline import running_demux, running_producer
from tests.support.warehouse import kafka_options
from walbus.client import Feed, Table
from walbus.contract import qualify_table, table_topic
from warehouse import layout
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.integration, pytest.mark.spark]

LONG = "ü" * 31 + "t"  # 63 bytes, PostgreSQL's limit
LONG_COL = "ö" * 31 + "c"
TABLES: dict[tuple[str, str], list[str]] = {
    ("public", "Order Items"): ["id", "a.b", 'Qty "x"', "ö", "big"],
    ("public", "a.b"): ["id", "v"],
    ("public", "a_b"): ["id", "v"],
    ("Sales.EU", 'say "hi"'): ["id", "v"],
    ("public", LONG): ["id", LONG_COL],
    ("public", "orders\n"): ["id", "v"],  # "$" also matched before a final newline: Kafka refused the topic
}


def _ident(schema: str, table: str) -> sql.Composable:
    return sql.Identifier(schema, table)


def _setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA "Sales.EU"')
        for (schema, table), cols in TABLES.items():
            defs = sql.SQL(", ").join(
                sql.SQL("{} int PRIMARY KEY").format(sql.Identifier(c)) if c == "id" else
                sql.SQL("{} int").format(sql.Identifier(c)) if c == 'Qty "x"' else
                sql.SQL("{} text").format(sql.Identifier(c))
                for c in cols
            )
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(_ident(schema, table), defs))
        conn.execute("CREATE TABLE done (id int PRIMARY KEY)")


def _insert(conn: psycopg.Connection[Any], schema: str, table: str, values: dict[str, Any]) -> None:
    conn.execute(
        sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            _ident(schema, table),
            sql.SQL(", ").join(sql.Identifier(c) for c in values),
            sql.SQL(", ").join(sql.Placeholder() * len(values)),
        ),
        list(values.values()),
    )


def _workload(dsn: str, big: str) -> None:
    oi = ("public", "Order Items")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(1, 6):
            _insert(conn, *oi, {"id": i, "a.b": f"dot {i}", 'Qty "x"': i, "ö": "ü" * i, "big": big if i == 1 else "s"})
            for schema, table in [("public", "a.b"), ("public", "a_b"), ("Sales.EU", 'say "hi"'), ("public", "orders\n")]:
                _insert(conn, schema, table, {"id": i, "v": f"{table} {i}"})
            _insert(conn, "public", LONG, {"id": i, LONG_COL: f"long {i}"})
        # an update leaving the 1.5 MB TOASTed value unchanged, a delete, a key change
        conn.execute(sql.SQL('UPDATE {} SET "Qty ""x""" = 99, "a.b" = NULL WHERE id = 1').format(_ident(*oi)))
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = 2").format(_ident(*oi)))
        conn.execute(sql.SQL("UPDATE {} SET id = 50 WHERE id = 3").format(_ident("public", "a_b")))
        conn.execute(sql.SQL("UPDATE {} SET v = 'dup' WHERE id = 3").format(_ident("Sales.EU", 'say "hi"')))
        # ADD COLUMN inside a transaction that already wrote to the table
        with conn.transaction():
            _insert(conn, "public", "a.b", {"id": 10, "v": "before"})
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN n int").format(_ident("public", "a.b")))
            _insert(conn, "public", "a.b", {"id": 11, "v": "after", "n": 8})
        conn.execute("INSERT INTO done VALUES (1)")


def _select(dsn: str, schema: str, table: str) -> dict[int, dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM {}").format(_ident(schema, table)))
        names = [d.name for d in cur.description or []]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}


def _strip_meta(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("__")}


def _as_streamed(want: dict[int, dict[str, Any]], got: dict[Any, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The source rows as a change stream has them: a column added after a row's last change
    (NULL in the row, never sent for it) is absent from that row's image."""
    return {k: {c: v for c, v in row.items() if c in got.get(k, row) or v is not None} for k, row in want.items()}


async def test_unusual_names_end_to_end(
    spark: Any, pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    await asyncio.to_thread(_setup, pg_dsn)
    big = "".join(random.Random(7).choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(1_500_000))
    source = f"walbus.{unique_name}"
    quoted = qualify_table("Sales.EU", 'say "hi"')
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source):
        with running_demux(kafka_bootstrap, source, tmp_path):
            await asyncio.to_thread(_workload, pg_dsn, big)
            events = []
            async with asyncio.timeout(180), Feed(source, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
                async for event in feed:
                    events.append(event)
                    if event.table == "public.done":
                        break
            last_commit = events[-1].commit_lsn
            positions = [e.position for e in events]
            assert len(set(positions)) == len(positions)
            async with Feed(source, bootstrap_servers=kafka_bootstrap, start="earliest", tables=[quoted], until_end=True) as feed:
                only = [e async for e in feed]
            assert [e.position for e in only] == [e.position for e in events if e.table == quoted]
            assert len(only) == 6  # five inserts and one update
            assert {(e.schema_name, e.table_name) for e in only} == {("Sales.EU", 'say "hi"')}
            assert [e.row() for e in only if e.operation == "update"] == [{"id": 3, "v": "dup"}]

            for (schema, table) in TABLES:
                want = await asyncio.to_thread(_select, pg_dsn, schema, table)
                topic = table_topic("walbus", unique_name, schema, table)
                async with asyncio.timeout(120), Table(topic, bootstrap_servers=kafka_bootstrap) as kt:
                    await kt.wait_until(last_commit)
                    got = {k: _strip_meta(v) for k, v in kt.items()}
                    assert got == _as_streamed(want, got), (schema, table, {k: str(v)[:200] for k, v in got.items()})

    # The warehouse: current tables equal the source, names kept exactly.
    spec = LoadSpec(kafka_options(kafka_bootstrap), source, str(tmp_path / "wh"))
    await asyncio.to_thread(run_load, spark, spec)
    for (schema, table) in TABLES:
        want = await asyncio.to_thread(_select, pg_dsn, schema, table)
        paths = layout.table_paths(str(tmp_path / "wh"), source, schema, table)
        current = spark.read.format("delta").load(paths.current).where("NOT _walbus_deleted")
        cols = list(TABLES[(schema, table)]) + (["n"] if (schema, table) == ("public", "a.b") else [])
        got = {r["id"]: {c: r[c] for c in cols} for r in current.collect()}
        assert got == want, (schema, table)
