"""A type of another schema named like a built-in one (``s.int4``, ``s.bool``) is not taken
for it: its values stay its text output, and ``types`` names it ``schema.name``, in snapshot
rows and streamed changes, with either plugin.

Value conversion went by ``pg_type.typname`` alone: an enum ``s.int4`` went through ``int()``
and the producer stopped (``ValueError: invalid literal for int() with base 10: b'two'``, in
the initial snapshot and in the stream), and an enum ``s.bool`` would read ``false`` for any
label but ``t``.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import stop_process, walbus_process

pytestmark = pytest.mark.integration

DDL = (
    "CREATE SCHEMA s",
    "CREATE TYPE s.int4 AS ENUM ('one', 'two')",
    "CREATE TYPE s.bool AS ENUM ('yes', 'no')",
    "CREATE TYPE s.float8 AS (x int, y text)",
    "CREATE TYPE mood AS ENUM ('ok')",  # no built-in's name: named as before
    'CREATE TABLE t (id int PRIMARY KEY, i s.int4, b s.bool, f s.float8, ia s.int4[], m mood, n int4)',
)
ROW = "({}, 'two', 'yes', ROW(1, 'x'), '{{one,two}}', 'ok', 7)"
TYPES = ["int4", "s.int4", "s.bool", "s.float8", "s._int4", "mood", "int4"]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_a_type_named_like_a_builtin_one_keeps_its_text(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str, tmp_path: Path
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO t VALUES " + ROW.format(1))
    log = tmp_path / "producer.log"
    proc = walbus_process(["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
                           "--slot", unique_name, "--plugin", plugin, "--drop-slot-on-exit"], log=log)
    try:
        await read_topic(kafka_bootstrap, unique_name, min_count=1, timeout=60)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES " + ROW.format(2))
            # a type created while the producer streams (pgoutput names it in a Type message)
            conn.execute("CREATE TYPE s.int8 AS ENUM ('eight')")
            conn.execute("ALTER TABLE t ADD COLUMN e s.int8")
            conn.execute("INSERT INTO t VALUES " + ROW.format(3)[:-1] + ", 'eight')")
        records = await read_topic(kafka_bootstrap, unique_name, min_count=3, timeout=60)
    finally:
        stop_process(proc)
    events = [orjson.loads(v) for _, v in records]
    assert [e["operation"] for e in events] == ["read", "insert", "insert"], log.read_text()[-2000:]
    expected = [1, "two", "yes", "(1,x)", "{one,two}", "ok", 7]
    for i, event in enumerate(events[:2]):
        assert event["types"] == TYPES
        assert event["values"] == [i + 1, *expected[1:]]
    assert events[2]["types"] == [*TYPES, "s.int8"]
    assert events[2]["values"] == [3, *expected[1:], "eight"]


QUOTED_DDL = (
    'CREATE SCHEMA "My S"',
    "CREATE TYPE \"My S\".e AS ENUM ('b')",
    "CREATE TYPE \"Mood\" AS ENUM ('ok', 'it''s')",
    "CREATE TYPE \"a\"\"b\" AS ENUM ('q')",
    'CREATE TABLE q (id int PRIMARY KEY, e "My S".e, m "Mood", ma "Mood"[], ab "a""b", n numeric(6,2))',
)


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_types_whose_names_sql_quotes(pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str, tmp_path: Path) -> None:
    # wal2json quotes a column's type only when its text does not start with a double quote:
    # '"type":"My S".e' and '"type":"Mood"[]' are no JSON, and the producer stopped at the
    # first such change (fatal JSONDecodeError).
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in QUOTED_DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO q VALUES (1, 'b', 'ok', '{ok,it''s,NULL}', 'q', 1.5)")
    log = tmp_path / "producer.log"
    proc = walbus_process(["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
                           "--slot", unique_name, "--plugin", plugin, "--drop-slot-on-exit"], log=log)
    try:
        await read_topic(kafka_bootstrap, unique_name, min_count=1, timeout=60)  # the snapshot's row
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO q VALUES (2, 'b', 'ok', '{ok,it''s,NULL}', 'q', 1.5)")
            conn.execute("UPDATE q SET m = 'it''s' WHERE id = 2")
        records = await read_topic(kafka_bootstrap, unique_name, min_count=3, timeout=60)
    finally:
        stop_process(proc)
    events = [orjson.loads(v) for _, v in records]
    assert [e["operation"] for e in events] == ["read", "insert", "update"], log.read_text()[-2000:]
    for event in events:
        assert event["types"] == ["int4", "e", "Mood", "_Mood", 'a"b', "numeric"]
        assert event["typmods"] == {"n": [6, 2]}
    assert [e["values"] for e in events] == [
        [1, "b", "ok", "{ok,it's,NULL}", "q", "1.50"],
        [2, "b", "ok", "{ok,it's,NULL}", "q", "1.50"],
        [2, "b", "it's", "{ok,it's,NULL}", "q", "1.50"],
    ]
