"""--key-columns (Debezium's message.key.columns, issue 18) end to end: producer -> demux ->
per-table topic, for keyless tables; and its start-up check."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from tests.support.kafka import list_topics, read_topic
from tests.support.pipeline import ROOT, running_demux, running_producer
from walbus.client import Table
from walbus.contract import table_topic

pytestmark = pytest.mark.integration


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


def strip_meta(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("__")}


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_keyless_tables_get_their_key_through_the_demux(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path, plugin: str,
) -> None:
    sql(
        pg_dsn,
        # keyless, REPLICA IDENTITY FULL: deletes carry the whole old row, so the key too
        'CREATE TABLE "Log Lines" (code text NOT NULL, "re,gion" text NOT NULL, n int)',
        'ALTER TABLE "Log Lines" REPLICA IDENTITY FULL',
        # keyless, identity on another column: a delete cannot name its key -> dead letter
        "CREATE TABLE audit (id int NOT NULL, code text NOT NULL)",
        "CREATE UNIQUE INDEX audit_id ON audit (id)",
        "ALTER TABLE audit REPLICA IDENTITY USING INDEX audit_id",
        "CREATE TABLE done (id int PRIMARY KEY)",
    )
    source = f"walbus.{unique_name}"
    key_columns = 'public.Log Lines:code,"re,gion";public.audit:code'
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source, key_columns=key_columns, plugin=plugin):
        with running_demux(kafka_bootstrap, source, tmp_path):
            sql(
                pg_dsn,
                """INSERT INTO "Log Lines" VALUES ('a', 'eu', 1), ('b', 'us', 2), ('c', 'eu', 3)""",
                """UPDATE "Log Lines" SET n = 20 WHERE code = 'b'""",
                """DELETE FROM "Log Lines" WHERE code = 'c'""",
                "INSERT INTO audit VALUES (1, 'x'), (2, 'y')",
                "DELETE FROM audit WHERE id = 2",
                "INSERT INTO done VALUES (1)",
            )
            evs = [orjson.loads(v) for _, v in await read_topic(kafka_bootstrap, source, min_count=9) if v is not None]
            last_commit = max(m["commit_lsn"] for m in evs)
            assert {m["table"]: m["pk"] for m in evs} == {
                "public.Log Lines": ["code", "re,gion"], "public.audit": ["code"], "public.done": ["id"],
            }
            async with asyncio.timeout(120), Table(table_topic("walbus", unique_name, "public", "Log Lines"), bootstrap_servers=kafka_bootstrap) as kt:
                await kt.wait_until(last_commit)
                got = {k: strip_meta(v) for k, v in kt.items()}
            assert got == {("a", "eu"): {"code": "a", "re,gion": "eu", "n": 1}, ("b", "us"): {"code": "b", "re,gion": "us", "n": 20}}
            async with asyncio.timeout(120), Table(table_topic("walbus", unique_name, "public", "audit"), bootstrap_servers=kafka_bootstrap) as kt:
                await kt.wait_until(last_commit)
                audit = {k: strip_meta(v) for k, v in kt.items()}
            # the delete of 'y' names its row by the index's column only: the demux finds its key in
            # its last-row store (it went to the dead-letter topic before, the row left in the topic)
            assert audit == {"x": {"id": 1, "code": "x"}}
            assert f"{source}.dlq" not in await list_topics(kafka_bootstrap)


def test_an_unknown_key_column_is_a_configuration_error(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE logs (code text)")
    res = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap,
         "--topic", unique_name, "--key-columns", "public.logs:code,nope"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 2 and "public.logs has no column 'nope'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


async def test_wal2json_losing_changes_of_a_table_without_identity_is_said_at_start(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """wal2json drops updates and deletes of such a table with only a server-side WARNING: the
    producer cannot see them, so it says so when it starts."""
    sql(pg_dsn, "CREATE TABLE keyless (code text)", "CREATE TABLE keyed (id int PRIMARY KEY)",
        "CREATE TABLE nothing (id int PRIMARY KEY)", "ALTER TABLE nothing REPLICA IDENTITY NOTHING")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, plugin="wal2json"):
        pass
    warned = {r.__dict__.get("table") for r in caplog.records if r.getMessage().startswith("wal2json does not decode")}
    assert warned == {"public.keyless", "public.nothing"}
