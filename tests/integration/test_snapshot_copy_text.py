"""The initial snapshot's COPY text read of awkward values equals a row-by-row ``SELECT``.

Every COPY escape class (backslash, tab, newline, carriage return, backspace, form feed,
vertical tab, a literal ``\\N``), NULLs, arrays, json, bytea, numeric, timestamps, a 2 MB text
value and a 63-byte unicode column name with a space and a quote: each read event's values
are what the stream's converters make of the value's own text output, fetched row by row.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import orjson
import psycopg
import pytest
from psycopg import sql

from producer.codec import text_converter
from producer.tablescan import CopyStopped, copy_out_blocks, fetch_fields
from tests.support.kafka import read_topic
from tests.support.pipeline import walbus_process

pytestmark = pytest.mark.integration

ODD_COL = 'ü "x' + "ö" * 28 + "cc"  # 63 bytes: a space and a quote in it
assert len(ODD_COL.encode()) == 63

TEXTS = [
    "plain", "back\\slash", "tab\there", "new\nline", "cr\rhere", "bs\bhere", "ff\fhere", "vt\vhere", "\\N", "\\",
    "\\x41\\101", '"quoted" \'single\'', "é😀", "", "x" * 2_000_000,
]


def _setup(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE TABLE odd (id int PRIMARY KEY, {} text, arr text[], doc jsonb, bin bytea, num numeric, "
            "ts timestamptz, f float8, flag bool)"
        ).format(sql.Identifier(ODD_COL)))
        for i, text in enumerate(TEXTS):
            conn.execute(
                "INSERT INTO odd VALUES (%s, %s, %s, %s::jsonb, %s, %s::numeric, %s::timestamptz, %s::float8, %s)",
                (i, text, [text[:50], None, "a,b"], orjson.dumps({"t": text[:50], "n": [1, None]}).decode(), text[:50].encode(),
                 "12345678901234567890.000100" if i % 2 else "NaN", "2024-02-29 23:59:59.999999+05", "-Infinity" if i % 3 else "1.5e300",
                 i % 2 == 0),
            )
        conn.execute("INSERT INTO odd (id) VALUES (999)")  # every other column NULL
        cols = conn.execute(
            "SELECT t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = 'odd'::regclass AND a.attnum > 0 ORDER BY a.attnum"
        ).fetchall()
        return [str(c[0]) for c in cols]


def _selected(dsn: str, types: list[str]) -> dict[int, list[object]]:
    convs = [text_converter(t) for t in types]
    with psycopg.connect(dsn) as conn:
        rows = fetch_fields(conn, sql.SQL("SELECT * FROM odd ORDER BY id").format())
    return {int(r[0] or b""): [None if f is None else conv(f) for conv, f in zip(convs, r, strict=True)] for r in rows}


async def test_snapshot_of_awkward_values_equals_select(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    types = _setup(pg_dsn)
    expected = _selected(pg_dsn, types)
    proc = walbus_process(
        ["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--slot", unique_name,
         "--snapshot-mode", "initial_only", "--drop-slot-on-exit"],
        log=tmp_path / "producer.log",
    )
    try:
        assert proc.wait(180) == 0, (tmp_path / "producer.log").read_text()
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    records = await read_topic(kafka_bootstrap, unique_name, min_count=len(expected))
    events = [orjson.loads(v) for _, v in records]
    got = {e["values"][0]: e["values"] for e in events if e["operation"] == "read"}
    assert events[0]["columns"][1] == ODD_COL
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert got[key] == values, key
    assert len(got[len(TEXTS) - 1][1]) == 2_000_000


def test_an_error_in_the_middle_of_a_copy_is_raised(pg_dsn: str) -> None:
    """Rows already sent, then the server fails: the read raises the server's error (no
    silent short read), and the connection is usable after a rollback."""
    with psycopg.connect(pg_dsn) as conn:
        blocks = copy_out_blocks(conn, b"COPY (SELECT 1 / (5000 - g) FROM generate_series(1, 6000) g) TO STDOUT", 100)
        lines: list[bytes] = []
        with pytest.raises(psycopg.errors.DivisionByZero):
            for block in blocks:
                lines.extend(block)
        assert len(lines) < 5000
        conn.rollback()
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert sum(len(b) for b in copy_out_blocks(conn, b"COPY (SELECT g FROM generate_series(1, 5000) g) TO STDOUT", 100)) == 5000


def test_a_copy_waiting_for_a_lock_stops_when_asked(pg_dsn: str) -> None:
    """The snapshot's COPY waits on a table another session holds locked: setting its stop
    ends the read (the COPY is cancelled) instead of a wait that lasts as long as the lock.
    The wait used to have no timeout, so a producer stopped mid-snapshot hung there."""
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE locked (id int)")
        setup.execute("INSERT INTO locked SELECT generate_series(1, 10)")
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn) as reader:
        holder.execute("LOCK TABLE locked IN ACCESS EXCLUSIVE MODE")
        stop = threading.Event()
        outcome: list[BaseException | int] = []

        def read() -> None:
            try:
                outcome.append(sum(len(b) for b in copy_out_blocks(reader, b"COPY locked TO STDOUT", 100, stop)))
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive()  # waiting for the lock
        stop.set()
        thread.join(60)  # not a speed check: before the fix it waited until the lock went
        alive = thread.is_alive()
        holder.rollback()  # releases the lock either way, so the thread ends
        thread.join(60)
        assert not alive
        assert len(outcome) == 1 and isinstance(outcome[0], CopyStopped)
        reader.rollback()
        assert reader.execute("SELECT count(*) FROM locked").fetchone() == (10,)  # the connection is usable
