"""Settings of the database or the producer's role that change a value's text must not change
an event's value: the producer's connections pin them (producer/session.py)."""

from __future__ import annotations

from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from tests.support.kafka import read_records
from tests.support.pipeline import running_producer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_reg_values_keep_their_text_when_the_search_path_changes(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    """regclass, regtype, regproc… are written relative to search_path ('t' or 's.t'), their
    names quoted under quote_all_identifiers ('"s"."t"'): a database (or role) whose settings
    changed between the snapshot and a change gave one value two texts, so a regclass key two
    keys."""
    source, slot = f"walbus.{unique_name}", f"{unique_name}_s"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA s")
        conn.execute("CREATE TABLE s.t (id int4)")
        conn.execute("CREATE TYPE s.ty AS ENUM ('a')")
        conn.execute("CREATE FUNCTION s.f() RETURNS int4 LANGUAGE sql AS 'SELECT 1'")
        conn.execute("CREATE TABLE k (rc regclass PRIMARY KEY, rt regtype, rp regproc, n int4)")
        conn.execute("INSERT INTO k VALUES ('s.t', 's.ty', 's.f', 1)")
    options: dict[str, Any] = {"topic": source, "slot": slot, "plugin": plugin}
    async with running_producer(pg_dsn, kafka_bootstrap, **options):
        await read_records(kafka_bootstrap, source, min_count=1)  # the snapshot's read
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET search_path = s, public").format(sql.Identifier(unique_name)))
        conn.execute(sql.SQL("ALTER DATABASE {} SET quote_all_identifiers = on").format(sql.Identifier(unique_name)))
    async with running_producer(pg_dsn, kafka_bootstrap, **options):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE k SET n = 2")
        records = await read_records(kafka_bootstrap, source, min_count=2)
    seen = []
    for r in records:
        e = orjson.loads(r.value)
        if e.get("table") == "public.k":
            row = dict(zip(e["columns"], e["values"], strict=True))
            seen.append((e["operation"], row["rc"], row["rt"], row["rp"]))
    assert [s[0] for s in seen] == ["read", "update"]
    assert {s[1:] for s in seen} == {("s.t", "s.ty", "s.f")}, seen
