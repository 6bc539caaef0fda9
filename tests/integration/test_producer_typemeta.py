"""Column metadata (not_null, typmods) from both plugins against real PostgreSQL and Kafka:
what a table declares arrives on every event, and an ALTER TABLE shows from the next event,
also inside the transaction that runs it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import psycopg
import pytest
from jsonschema import Draft202012Validator

from producer.catalog import modifiers_from_text, type_modifiers
from tests.integration.test_producer import sql
from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer
from walbus.contract import decode_event
from walbus.contract_schema import SCHEMA_PATH

pytestmark = pytest.mark.integration

DDL = """CREATE TABLE meta (
  a int, b text, amount numeric(12,2) NOT NULL, name varchar(40), at timestamp(3), plain numeric,
  tags numeric(6,1)[], note text NOT NULL DEFAULT '', PRIMARY KEY (a, b)
)"""
ROW = "(%s, 'k', %s, 'n', '2026-01-02 03:04:05.123456', 1.5, '{1.25,NULL}', 'x')"
BEFORE = {"amount": [12, 2], "name": [40], "at": [3], "tags": [6, 1]}


def _in_one_transaction(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


async def _events(pg_dsn: str, kafka_bootstrap: str, topic: str, plugin: str) -> list[dict[str, Any]]:
    """The events of a workload in phases, each read before the next runs: pgoutput reads
    nullability from the catalog when a Relation message arrives (docs/contract.md), so a
    later phase's ALTER must not have committed by then."""
    sql(pg_dsn, DDL)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, slot=topic):
        sql(pg_dsn, "INSERT INTO meta VALUES " + ROW % (1, "12.5"), "UPDATE meta SET name = 'm' WHERE a = 1",
            "DELETE FROM meta WHERE a = 1")
        await read_topic(kafka_bootstrap, topic, min_count=3)
        sql(pg_dsn, "ALTER TABLE meta ALTER COLUMN amount TYPE numeric(14,4)", "INSERT INTO meta VALUES " + ROW % (2, "1.23456"))
        await read_topic(kafka_bootstrap, topic, min_count=4)
        _in_one_transaction(
            pg_dsn,
            "INSERT INTO meta VALUES " + ROW % (3, "3"),
            "ALTER TABLE meta ALTER COLUMN name TYPE varchar(50), ALTER COLUMN at TYPE timestamp(6)",
            "INSERT INTO meta VALUES " + ROW % (4, "4"),
        )
        await read_topic(kafka_bootstrap, topic, min_count=6)
        sql(pg_dsn, "ALTER TABLE meta ALTER COLUMN amount DROP NOT NULL, ALTER COLUMN name SET NOT NULL",
            "UPDATE meta SET plain = 2 WHERE a = 3", "TRUNCATE meta")
        records = await read_topic(kafka_bootstrap, topic, min_count=8)
    assert len(records) == 8
    return [orjson.loads(v) for _, v in records if v is not None]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_types_nullability_and_keys_arrive_and_follow_alter_table(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    events = await _events(pg_dsn, kafka_bootstrap, unique_name, plugin)
    validator = Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
    for e in events:
        validator.validate(e)
    assert [e["operation"] for e in events] == ["insert", "update", "delete", "insert", "insert", "insert", "update", "truncate"]
    assert all(e["pk"] == ["a", "b"] for e in events)
    after_alter = {**BEFORE, "amount": [14, 4]}
    in_txn = {**after_alter, "name": [50], "at": [6]}  # from the event after the ALTER in its transaction
    assert [e.get("typmods") for e in events] == [BEFORE] * 3 + [after_alter] * 2 + [in_txn] * 3
    assert [e.get("not_null") for e in events] == [["a", "b", "amount", "note"]] * 6 + [["a", "b", "name", "note"]] * 2
    ins = decode_event(orjson.dumps(events[0]))
    types = ins.column_types()
    assert (types["amount"].declared, types["amount"].nullable) == ("numeric(12,2)", False)
    assert (types["name"].length, types["at"].precision, types["plain"].modifiers) == (40, 3, ())
    assert (types["a"].primary_key, types["a"].nullable, types["b"].primary_key, types["note"].nullable) == (True, False, True, False)
    assert ins.row() is not None and ins.row()["amount"] == "12.50"  # type: ignore[index]
    assert events[3]["values"][2] == "1.2346"  # numeric(14,4) rounds on insert


async def test_both_plugins_write_the_same_metadata(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    pg = await _events(pg_dsn, kafka_bootstrap, unique_name + "_pg", "pgoutput")
    sql(pg_dsn, "DROP TABLE meta")
    wj = await _events(pg_dsn, kafka_bootstrap, unique_name + "_wj", "wal2json")
    strip = ("lsn", "commit_lsn", "xid", "timestamp")
    assert [{k: v for k, v in e.items() if k not in strip} for e in pg] == [
        {k: v for k, v in e.items() if k not in strip} for e in wj
    ]


def test_modifiers_match_format_type_for_every_modified_type(pg_dsn: str) -> None:
    """Decoding atttypmod (pgoutput) and parsing format_type (wal2json) agree with PostgreSQL."""
    sql(pg_dsn, """CREATE TABLE mods (
      n1 numeric(12,2), n2 numeric(12), n3 numeric, n4 numeric(5,-2), n5 numeric(3,5), v1 varchar(40), v2 varchar,
      c1 char(3), c2 char, b1 bit(8), b2 bit varying(20), t1 timestamp(3), t2 timestamptz(0), t3 timestamptz,
      t4 time(6), t5 timetz(2), i1 interval(3), i2 interval day to second(2), i3 interval hour, a1 numeric(10,3)[],
      a2 varchar(7)[], x text
    )""")
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT a.attname, t.typname, a.atttypmod, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "JOIN pg_type t ON t.oid = a.atttypid WHERE a.attrelid = 'mods'::regclass AND a.attnum > 0 ORDER BY a.attnum"
        ).fetchall()
    got = {name: type_modifiers(typname, typmod) for name, typname, typmod, _ in rows}
    assert got == {
        "n1": [12, 2], "n2": [12, 0], "n3": None, "n4": [5, -2], "n5": [3, 5], "v1": [40], "v2": None, "c1": [3],
        "c2": [1], "b1": [8], "b2": [20], "t1": [3], "t2": [0], "t3": None, "t4": [6], "t5": [2], "i1": [3],
        "i2": [2], "i3": None, "a1": [10, 3], "a2": [7], "x": None,
    }
    for name, typname, _, declared in rows:
        assert modifiers_from_text(typname, declared) == got[name], (name, declared)
