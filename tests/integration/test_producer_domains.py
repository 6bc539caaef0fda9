"""A domain column is typed by its base type, alike in snapshot rows and streamed changes,
with either plugin.

pgoutput names a domain column by its base type (its Relation message sends getBaseType), so
its changes of an ``int`` domain carry ``int4`` and JSON integers. The snapshot named the
domain itself and sent its values as text, so a row read by the snapshot had another key in
the compacted topic (``{"id":"1"}``) than its later changes (``{"id":1}``): a delete after the
snapshot left the snapshot's row behind. wal2json names the domain too and quotes its values
(only its base types' oids are numbers or booleans to it).
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from tests.support.pipeline import running_producer
from walbus.client import Feed

pytestmark = pytest.mark.integration

DDL = (
    "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
    "CREATE DOMAIN dom2 AS posint",  # a domain over a domain: the base type at the bottom
    "CREATE DOMAIN flag AS bool",
    "CREATE DOMAIN ratio AS float8",
    "CREATE DOMAIN money2 AS numeric(12,2)",
    "CREATE DOMAIN short AS varchar(5)",
    "CREATE DOMAIN big AS int8",
    'CREATE TABLE d (id posint PRIMARY KEY, n dom2, ok flag, f ratio, m money2, s short, b big, "p\u00e9" posint[])',
)
TYPES = ("int4", "int4", "bool", "float8", "numeric", "varchar", "int8", "_posint")


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_domain_columns_are_their_base_types_in_snapshot_and_stream(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO d VALUES (1, 5, true, 1.5, 12.50, 'abc', 9223372036854775807, '{1,2}')")
    topic = f"walbus.{unique_name}"
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO d VALUES (2, 6, false, 'NaN', 0.10, 'x', -1, NULL)")
            conn.execute("UPDATE d SET ok = false, f = '-0' WHERE id = 1")
            conn.execute("DELETE FROM d WHERE id = 2")
        async with asyncio.timeout(60), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            events = []
            async for event in feed:
                events.append(event)
                if len(events) == 4:
                    break
    read, insert, update, delete = events
    assert [e.operation for e in events] == ["read", "insert", "update", "delete"]
    for event in (read, insert, update):
        assert event.new is not None and event.new.types == TYPES
    assert read.row() == {"id": 1, "n": 5, "ok": True, "f": 1.5, "m": "12.50", "s": "abc", "b": 9223372036854775807, "p\u00e9": "{1,2}"}
    assert insert.row() == {"id": 2, "n": 6, "ok": False, "f": "NaN", "m": "0.10", "s": "x", "b": -1, "p\u00e9": None}
    assert update.row()["ok"] is False and str(update.row()["f"]) == "-0.0"
    # the same key, whichever part wrote the row: a compacted topic holds one row per key
    assert read.key_values() == update.key_values() == {"id": 1}
    assert delete.key_values() == insert.key_values() == {"id": 2}


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_a_bytea_domain_and_a_generated_column_alike_in_snapshot_and_stream(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    # wal2json drops the \x of a bytea (oid 17) only: a domain over bytea came as "\\x\\x0102".
    # And wal2json sends STORED generated columns, which pgoutput and the snapshots leave out:
    # its events had column g, the others not (a types fuzz).
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE DOMAIN blob AS bytea")
        conn.execute("CREATE TABLE g (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 2) STORED, b blob)")
        conn.execute("ALTER TABLE g REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO g (id, a, b) VALUES (1, 1, '\\x00')")
    topic = f"walbus.{unique_name}"
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO g (id, a, b) VALUES (2, 2, '\\x0102')")
            conn.execute("UPDATE g SET a = 3 WHERE id = 2")
            conn.execute("DELETE FROM g WHERE id = 1")
        async with asyncio.timeout(60), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            events = []
            async for event in feed:
                events.append(event)
                if len(events) == 4:
                    break
    read, insert, update, delete = events
    assert read.row() == {"id": 1, "a": 1, "b": "\\x00"}
    assert insert.row() == {"id": 2, "a": 2, "b": "\\x0102"}
    assert update.row() == {"id": 2, "a": 3, "b": "\\x0102"}
    assert update.identity is not None and tuple(update.identity.columns) == ("id", "a", "b")
    assert delete.identity is not None
    assert dict(zip(delete.identity.columns, delete.identity.values, strict=True)) == {"id": 1, "a": 1, "b": "\\x00"}


async def test_a_wal2json_update_written_before_replica_identity_full_keeps_its_row(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    # An update written under REPLICA IDENTITY DEFAULT and decoded after ALTER TABLE … FULL:
    # its key-only identity was taken for the whole old row, and the event kept only the key
    # (pgoutput sends the row; a re-fuzz).
    topic = f"walbus.{unique_name}"
    slot = f"{unique_name}_s"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE f (k int PRIMARY KEY, a text, n int)")
        conn.execute("INSERT INTO f VALUES (1, 'a', 1)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin="wal2json", slot=slot):
        pass  # the slot exists from here on
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("UPDATE f SET a = 'b', n = 2 WHERE k = 1")
        conn.execute("ALTER TABLE f REPLICA IDENTITY FULL")
    async with (running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin="wal2json", slot=slot), asyncio.timeout(60),
                Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed):
        async for event in feed:
            if event.operation == "update":
                break
    assert event.row() == {"k": 1, "a": "b", "n": 2}
