"""The producer against real PostgreSQL and Kafka: the message contract, types, identities,
large and odd changes, both plugins, heartbeats and configuration errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import orjson
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests.support.kafka import read_topic
from tests.support.pipeline import (
    ROOT,
    running_producer,
    slot_confirmed_lsn,
)
from walbus.config import ConfigError
from walbus.contract import decode_event, event_key, parse_event_key

pytestmark = pytest.mark.integration


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


def values(records: list[tuple[bytes | None, bytes | None]]) -> list[dict[str, Any]]:
    return [orjson.loads(v) for _, v in records if v is not None]


async def test_pgkafka_transactions_example(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name):
        sql(
            pg_dsn,
            "INSERT INTO transactions VALUES (54441, 36036, 2000)",
            "UPDATE transactions SET amount = 2500 WHERE transaction_id = 54441",
            "DELETE FROM transactions WHERE transaction_id = 54441",
        )
        records = await read_topic(kafka_bootstrap, unique_name, min_count=3)
    assert len(records) == 3
    ins, upd, dele = values(records)
    assert [m["operation"] for m in (ins, upd, dele)] == ["insert", "update", "delete"]
    for (key, _), m in zip(records, (ins, upd, dele), strict=True):
        assert key == event_key(m["commit_lsn"], m["seq"]) and m["seq"] == 0
        assert m["v"] == 1 and m["table"] == "public.transactions" and m["pk"] == ["transaction_id"]
        assert m["timestamp"].endswith("+00:00") and "." in m["timestamp"]
        assert isinstance(m["xid"], int) and m["lsn"] <= m["commit_lsn"]
    assert ins["columns"] == ["transaction_id", "user_id", "amount"] and ins["types"] == ["int4"] * 3
    assert ins["values"] == [54441, 36036, 2000] and "identity" not in ins
    assert upd["values"] == [54441, 36036, 2500]
    assert upd["identity"] == {"columns": ["transaction_id"], "types": ["int4"], "values": [54441]}
    assert "columns" not in dele and dele["identity"]["values"] == [54441]
    assert ins["commit_lsn"] < upd["commit_lsn"] < dele["commit_lsn"]
    assert [k for k, _ in records] == sorted(k for k, _ in records if k is not None)


TYPES_DDL = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE typed (
  id int8 PRIMARY KEY, i2 int2, i4 int4, n numeric, f4 float4, f8 float8, t text, b bytea, ok bool,
  d date, tm time, ts timestamp, tstz timestamptz, iv interval, u uuid, j json, jb jsonb,
  arr int4[], tarr text[], m mood, o oid
)"""


async def test_types(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, TYPES_DDL)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name):
        sql(
            pg_dsn,
            "SET TIME ZONE 'UTC'",
            """INSERT INTO typed VALUES (1, -32768, 2147483647, 123456789012345678901234567890.123456789012345678901234567890,
               'NaN', 'Infinity', 'zürich ☃ 日本', '\\x00ff10', true, '2024-02-29', '13:14:15.123456',
               '2024-01-02 03:04:05.678901', '2024-01-02 03:04:05.678901+02', '1 day 02:03:04', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
               '{"a": [1, 2]}', '{"b": {"c": null}}', '{1,2,3}', '{"x y",z}', 'happy', 42)""",
            "INSERT INTO typed (id, f8) VALUES (2, '-Infinity')",
            "INSERT INTO typed (id, f4, f8, n) VALUES (3, 1.5, 0.1, 'NaN')",
        )
        records = await read_topic(kafka_bootstrap, unique_name, min_count=3)
    rows = [dict(zip(m["columns"], m["values"], strict=True)) for m in values(records)]
    types = dict(zip(values(records)[0]["columns"], values(records)[0]["types"], strict=True))
    assert types == {
        "id": "int8", "i2": "int2", "i4": "int4", "n": "numeric", "f4": "float4", "f8": "float8", "t": "text", "b": "bytea",
        "ok": "bool", "d": "date", "tm": "time", "ts": "timestamp", "tstz": "timestamptz", "iv": "interval", "u": "uuid",
        "j": "json", "jb": "jsonb", "arr": "_int4", "tarr": "_text", "m": "mood", "o": "oid",
    }
    r = rows[0]
    assert r["id"] == 1 and r["i2"] == -32768 and r["i4"] == 2147483647 and r["o"] == 42
    assert r["n"] == "123456789012345678901234567890.123456789012345678901234567890"
    assert r["f4"] == "NaN" and r["f8"] == "Infinity" and rows[1]["f8"] == "-Infinity"
    assert rows[2]["f4"] == 1.5 and rows[2]["f8"] == 0.1 and rows[2]["n"] == "NaN"
    assert r["t"] == "zürich ☃ 日本" and r["b"] == "\\x00ff10" and r["ok"] is True
    assert r["d"] == "2024-02-29" and r["tm"] == "13:14:15.123456" and r["ts"] == "2024-01-02 03:04:05.678901"
    assert r["tstz"] == "2024-01-02 01:04:05.678901+00" and r["iv"] == "1 day 02:03:04"
    assert r["u"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert r["j"] == '{"a": [1, 2]}' and r["jb"] == '{"b": {"c": null}}'
    assert r["arr"] == "{1,2,3}" and r["tarr"] == '{"x y",z}' and r["m"] == "happy"
    assert rows[1]["t"] is None and rows[1]["ok"] is None  # NULLs are null


async def test_identities_keys_copy_toast_ddl_truncate(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(
        pg_dsn,
        "CREATE TABLE full_t (id int PRIMARY KEY, a text, big text)",
        "ALTER TABLE full_t REPLICA IDENTITY FULL",
        "CREATE TABLE nothing_t (id int PRIMARY KEY, a text)",
        "ALTER TABLE nothing_t REPLICA IDENTITY NOTHING",
        "CREATE TABLE idx_t (id int PRIMARY KEY, code text NOT NULL, a text)",
        "CREATE UNIQUE INDEX idx_t_code ON idx_t (code)",
        "ALTER TABLE idx_t REPLICA IDENTITY USING INDEX idx_t_code",
        "CREATE TABLE nopk (a int, b text)",
        "CREATE TABLE comp (k1 int, k2 text, v int, big text, PRIMARY KEY (k2, k1))",
        "ALTER TABLE comp ALTER COLUMN big SET STORAGE EXTERNAL",
        "ALTER TABLE full_t ALTER COLUMN big SET STORAGE EXTERNAL",
    )
    big = "x" * 20000
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name) as producer:
        sql(
            pg_dsn,
            f"INSERT INTO full_t VALUES (1, 'a', '{big}')",
            "UPDATE full_t SET a = 'b' WHERE id = 1",  # big unchanged, filled from the old row
            "INSERT INTO nothing_t VALUES (1, 'a')",
            "INSERT INTO idx_t VALUES (1, 'c1', 'a')",
            "UPDATE idx_t SET a = 'b'",
            "DELETE FROM idx_t",
            "INSERT INTO nopk VALUES (1, 'a'), (2, 'b')",
            f"INSERT INTO comp VALUES (1, 'k', 10, '{big}')",
            "UPDATE comp SET v = 11",  # big unchanged under DEFAULT: listed in unchanged
            "UPDATE comp SET k1 = 2",  # key change
            "ALTER TABLE comp ADD COLUMN extra text DEFAULT 'e'",
            "UPDATE comp SET v = 12",
            "ALTER TABLE comp DROP COLUMN extra",
            "UPDATE comp SET v = 13",
            "COPY nopk (a) FROM PROGRAM 'seq 1 10000'",
            "TRUNCATE nopk",
        )
        records = await read_topic(kafka_bootstrap, unique_name, min_count=10014, timeout=90)
        assert producer.progress is not None
    msgs = values(records)
    assert len(msgs) == 10014
    keys = [k for k, _ in records]
    assert len(set(keys)) == len(keys), "(commit_lsn, seq) keys must be unique"
    assert keys == sorted(keys)  # type: ignore[type-var]
    by_table: dict[str, list[dict[str, Any]]] = {}
    for m in msgs:
        by_table.setdefault(m["table"], []).append(m)

    _, f_upd = by_table["public.full_t"]
    assert f_upd["values"] == [1, "b", big] and "unchanged" not in f_upd
    assert f_upd["identity"] == {"columns": ["id", "a", "big"], "types": ["int4", "text", "text"], "values": [1, "a", big]}

    # Under REPLICA IDENTITY NOTHING PostgreSQL itself refuses updates/deletes of a published table.
    (n_ins,) = by_table["public.nothing_t"]
    assert "identity" not in n_ins and n_ins["values"] == [1, "a"]

    _, i_upd, i_del = by_table["public.idx_t"]
    assert i_upd["identity"] == {"columns": ["code"], "types": ["text"], "values": ["c1"]}
    assert i_del["identity"]["values"] == ["c1"] and i_del["pk"] == ["id"]

    nopk = by_table["public.nopk"]
    assert nopk[0]["pk"] == [] and "identity" not in nopk[0]
    copied = [m for m in nopk if m["operation"] == "insert"][2:]
    assert len(copied) == 10000 and len({m["commit_lsn"] for m in copied}) == 1
    assert len({m["lsn"] for m in copied}) < 10000  # LSNs repeat inside a COPY; keys do not
    assert [m["seq"] for m in copied] == list(range(10000))
    assert nopk[-1]["operation"] == "truncate" and "columns" not in nopk[-1]

    c = by_table["public.comp"]
    assert c[0]["pk"] == ["k2", "k1"] and c[0]["values"] == [1, "k", 10, big]
    assert c[1]["unchanged"] == ["big"] and c[1]["columns"] == ["k1", "k2", "v"] and None not in c[1]["values"]
    assert c[2]["identity"]["columns"] == ["k1", "k2"] and c[2]["identity"]["values"] == [1, "k"]
    assert c[2]["values"][:3] == [2, "k", 11]
    assert c[3]["columns"][-1] == "extra" and c[3]["values"][-1] == "e"
    assert c[4]["columns"] == ["k1", "k2", "v"] and c[4]["values"] == [2, "k", 13]


WORKLOAD = [
    "CREATE TABLE w1 (id int PRIMARY KEY, name text, amount numeric(20,6), ts timestamptz, doc jsonb, flag bool, f float8, data bytea)",
    "CREATE TABLE w2 (a int, b text, c int, PRIMARY KEY (a, b))",
    "ALTER TABLE w2 REPLICA IDENTITY FULL",
]
WORKLOAD_DML = [
    "INSERT INTO w1 SELECT g, 'name ' || g, g * 1.000001, '2024-01-01'::timestamptz + g * interval '1 hour', "
    "jsonb_build_object('g', g), g % 2 = 0, g / 3.0, decode(lpad(to_hex(g), 4, '0'), 'hex') FROM generate_series(1, 200) g",
    "UPDATE w1 SET amount = amount * 2, doc = doc || '{\"u\": 1}' WHERE id % 3 = 0",
    "UPDATE w1 SET id = id + 1000 WHERE id % 10 = 0",
    "DELETE FROM w1 WHERE id % 7 = 0",
    "INSERT INTO w2 SELECT g, 'b' || g, g FROM generate_series(1, 50) g",
    "UPDATE w2 SET c = c + 1 WHERE a < 20",
    "DELETE FROM w2 WHERE a > 40",
    "TRUNCATE w2",
    "INSERT INTO w1 (id, name) VALUES (99999, NULL)",
]


async def test_pgoutput_and_wal2json_produce_identical_messages(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, *WORKLOAD)
    t_pg, t_wj = unique_name + "_pg", unique_name + "_wj"
    async with (
        running_producer(pg_dsn, kafka_bootstrap, topic=t_pg, plugin="pgoutput", slot=f"{unique_name}_pg"),
        running_producer(pg_dsn, kafka_bootstrap, topic=t_wj, plugin="wal2json", slot=f"{unique_name}_wj"),
    ):
        sql(pg_dsn, *WORKLOAD_DML)
        expected = 200 + 67 + 20 + 28 + 50 + 19 + 10 + 1 + 1
        a = await read_topic(kafka_bootstrap, t_pg, min_count=expected)
        b = await read_topic(kafka_bootstrap, t_wj, min_count=expected)
    assert len(a) == expected
    assert [k for k, _ in a] == [k for k, _ in b]
    for (ka, va), (_, vb) in zip(a, b, strict=True):
        assert va == vb, f"{ka!r}:\n pgoutput {va!r}\n wal2json {vb!r}"


async def test_heartbeat_advances_slot_while_captured_tables_idle(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE captured (id int PRIMARY KEY)", "CREATE TABLE other (id int PRIMARY KEY)")
    slot = unique_name
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=slot, tables=["public.captured"], heartbeat_interval=0.5):
        sql(pg_dsn, "INSERT INTO captured VALUES (1)")
        await read_topic(kafka_bootstrap, unique_name, min_count=1)
        await asyncio.sleep(2)
        before = slot_confirmed_lsn(pg_dsn, slot)
        for i in range(20):
            sql(pg_dsn, f"INSERT INTO other SELECT g FROM generate_series({i * 1000}, {i * 1000 + 999}) g")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
            assert row is not None
            wal_now = int(str(row[0]))
        for _ in range(60):
            await asyncio.sleep(0.5)
            if slot_confirmed_lsn(pg_dsn, slot) >= wal_now:
                break
        after = slot_confirmed_lsn(pg_dsn, slot)
    assert after >= wal_now > before, (before, after, wal_now)
    assert len(await read_topic(kafka_bootstrap, unique_name)) == 1  # nothing of `other` was emitted


async def test_filters_exclude_and_mask_columns(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE users (id int PRIMARY KEY, email text, password text, note text)", "CREATE TABLE audit (id int)")
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, exclude_tables=["public.audit"],
        exclude_columns=["public.users.note"], mask_columns=["*.password"],
    ):
        sql(pg_dsn, "INSERT INTO audit VALUES (1)", "INSERT INTO users VALUES (1, 'a@b.c', 'hunter2', 'n')")
        records = await read_topic(kafka_bootstrap, unique_name, min_count=1)
    (m,) = values(records)
    assert m["columns"] == ["id", "email", "password"] and m["values"] == [1, "a@b.c", "****"]


@pytest.mark.parametrize("rule", ["mask_columns", "exclude_columns"])
async def test_a_primary_key_column_cannot_be_masked_or_excluded(pg_dsn: str, kafka_bootstrap: str, unique_name: str,
                                                                  rule: str) -> None:
    # Masked, every row of the table had the key "****" and the demux's compacted topic kept one;
    # excluded, every event went to the demux's dead-letter topic (a configuration fuzz).
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    with pytest.raises(ConfigError, match=r"primary-key column\(s\) \['id'\] of public.t are excluded or masked"):
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, **{rule: ["public.t.id"]}):
            pass


def _produce_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "produce", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def test_configuration_errors_exit_at_once_with_a_message(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    bad_dsn = make_conninfo(pg_dsn, dbname="no_such_db_" + unique_name)
    res = _produce_cli("--pg-dsn", bad_dsn, "--kafka-bootstrap", kafka_bootstrap)
    assert res.returncode == 2 and "cannot connect to PostgreSQL" in res.stderr and "does not exist" in res.stderr
    res = _produce_cli("--kafka-bootstrap", kafka_bootstrap)
    assert res.returncode == 2 and "--pg-dsn" in res.stderr and "WALBUS_PG_DSN" in res.stderr
    res = _produce_cli("--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--tables", "public.nope", "--topic", unique_name)
    assert res.returncode == 2 and "public.nope" in res.stderr
    sql(pg_dsn, f"SELECT pg_create_logical_replication_slot('{unique_name}', 'wal2json')")
    res = _produce_cli("--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--slot", unique_name, "--topic", unique_name)
    assert res.returncode == 2 and "plugin wal2json" in res.stderr
    res = _produce_cli("--pg-dsn", pg_dsn, "--kafka-bootstrap", "127.0.0.1:1", "--topic", unique_name)
    assert res.returncode == 2 and "cannot reach Kafka" in res.stderr
    assert "Traceback" not in res.stderr


def test_event_keys_sort_in_event_order() -> None:
    keys = [event_key(c, s) for c, s in [(1, 0), (1, 1), (0xFFFF, 0), (0x1_0000_0000, 2), (0x1_0000_0000, 10)]]
    assert keys == sorted(keys)
    assert parse_event_key(keys[-1]) == (0x1_0000_0000, 10)
    assert decode_event(b'{"v":1,"lsn":1,"commit_lsn":2,"seq":0,"xid":3,"operation":"truncate","table":"a.b","timestamp":"t","pk":[]}').table_name == "b"


async def test_transaction_metadata_topic(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, transaction_metadata=True):
        with psycopg.connect(pg_dsn) as conn:
            conn.execute("INSERT INTO a SELECT generate_series(1, 3)")
            conn.execute("INSERT INTO b VALUES (1)")
        meta = await read_topic(kafka_bootstrap, unique_name + ".transaction", min_count=2)
    begin, end = values(meta)
    assert begin["status"] == "BEGIN" and end["status"] == "END" and begin["id"] == end["id"]
    assert end["event_count"] == 4
    assert end["data_collections"] == [{"data_collection": "public.a", "event_count": 3}, {"data_collection": "public.b", "event_count": 1}]
