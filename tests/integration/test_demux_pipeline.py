"""End to end: PostgreSQL -> producer -> demux (killed -9 several times) -> KTable == SELECT *."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from tests.support.demux import (  # noqa: F401 (autouse fixture)
    DemuxProc,
    _reap_demux_processes,
    demux_args,
    wait_for_log,
)
from tests.support.kafka import read_ktable, read_records, wait_caught_up
from tests.support.pipeline import running_producer
from walbus.contract import demux_group

pytestmark = pytest.mark.integration

BIG_TXN_ROWS = 100_000
COPY_ROWS = 10_000

DDL = [
    """CREATE TABLE accounts (id int4 PRIMARY KEY, name text, balance numeric(20,2), doc text,
                              at timestamptz, meta jsonb)""",
    "CREATE TABLE lines (order_id text, line int4, qty int4, note text, PRIMARY KEY (order_id, line))",
    "CREATE TABLE events (id int8 PRIMARY KEY, payload jsonb, flag bool, ts timestamptz)",
]
KEYS = {"accounts": ["id"], "lines": ["order_id", "line"], "events": ["id"]}
# A value PostgreSQL stores out of line (random, so it does not compress below the TOAST limit).
BIG_DOC = "(SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 200) g)"


def _norm(v: Any) -> Any:
    """One comparable form for a JSON value of the contract and a psycopg value."""
    if v is None or isinstance(v, bool | int):
        return v
    if isinstance(v, Decimal):
        return v
    if isinstance(v, datetime):
        return v.timestamp()
    if isinstance(v, dict | list):
        return orjson.dumps(v, option=orjson.OPT_SORT_KEYS)
    if isinstance(v, str):
        try:
            return datetime.fromisoformat(v).timestamp() if v[:4].isdigit() and v[4:5] == "-" else v
        except ValueError:
            return v
    return v


def _norm_kafka(table: str, row: dict[str, Any]) -> tuple[Any, ...]:
    out = []
    for col, v in sorted(row.items()):
        if col.startswith("__"):
            continue
        if col == "balance" and v is not None:
            v = Decimal(v)
        elif col in ("meta", "payload") and v is not None:
            v = json.loads(v)
        out.append((col, _norm(v)))
    return tuple(out)


def _select_all(dsn: str, table: str) -> dict[bytes, tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(f"SELECT * FROM {table}")
        out = {}
        for row in cur:
            key = orjson.dumps({c: row[c] for c in KEYS[table]})
            out[key] = tuple((c, _norm(v)) for c, v in sorted(row.items()))
        return out


def _workload(dsn: str, seed: int, enough: threading.Event) -> None:
    """Random transactions: TOAST updates leaving ``doc`` unchanged, key changes, deletes, NULLs, COPY,
    a truncate, and one transaction of BIG_TXN_ROWS rows. The random part goes on (at least 260
    transactions) until ``enough`` is set: the faults the test injects happen during the load."""
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # (The producer has no initial snapshot yet: every row is inserted while it streams.)
        conn.execute(f"INSERT INTO accounts SELECT g, 'first', g, {BIG_DOC}, now(), NULL FROM generate_series(1, 200) g")
        with conn.cursor().copy("COPY lines (order_id, line, qty, note) FROM STDIN") as copy:
            for i in range(COPY_ROWS):
                copy.write_row((f"C{i // 10}", i % 10, rnd.randint(1, 9), None if i % 7 == 0 else f"n{i}"))
        with conn.transaction():
            conn.execute(
                """INSERT INTO events SELECT g, jsonb_build_object('g', g, 's', md5(g::text)), g %% 2 = 0,
                          '2024-01-01T00:00:00Z'::timestamptz + g * interval '1 second'
                   FROM generate_series(1, %s) g""",
                (BIG_TXN_ROWS,),
            )
        next_id = 10_000
        n = 0
        while n < 260 or not enough.is_set():
            n += 1
            with conn.transaction():
                for _ in range(rnd.randint(1, 12)):
                    r = rnd.random()
                    if r < 0.25:
                        next_id += 1
                        doc = BIG_DOC if rnd.random() < 0.5 else "'short'"
                        conn.execute(
                            f"INSERT INTO accounts VALUES (%s, %s, %s, {doc}, now(), %s)",
                            (next_id, rnd.choice(["ann", None, "zoë"]), Decimal(rnd.randint(-99999, 99999)) / 100,
                             None if rnd.random() < 0.3 else json.dumps({"k": rnd.random()})),
                        )
                    elif r < 0.55:  # doc untouched: an unchanged TOAST value in the event
                        conn.execute("UPDATE accounts SET balance = balance + 1, at = now() WHERE id = "
                                     "(SELECT id FROM accounts ORDER BY random() LIMIT 1)")
                    elif r < 0.62:
                        conn.execute(f"UPDATE accounts SET doc = {BIG_DOC} WHERE id = "
                                     "(SELECT id FROM accounts ORDER BY random() LIMIT 1)")
                    elif r < 0.70:  # primary-key change, doc untouched
                        next_id += 1
                        conn.execute("UPDATE accounts SET id = %s WHERE id = "
                                     "(SELECT id FROM accounts ORDER BY random() LIMIT 1)", (next_id,))
                    elif r < 0.76:
                        conn.execute("DELETE FROM accounts WHERE id = (SELECT id FROM accounts ORDER BY random() LIMIT 1)")
                    elif r < 0.86:
                        conn.execute(
                            "INSERT INTO lines VALUES (%s, %s, %s, %s) ON CONFLICT (order_id, line) "
                            "DO UPDATE SET qty = excluded.qty, note = excluded.note",
                            (f"R{rnd.randint(1, 50)}", rnd.randint(0, 5), rnd.randint(1, 9), rnd.choice([None, "x"])),
                        )
                    elif r < 0.92:
                        conn.execute("UPDATE events SET flag = NOT flag, payload = NULL WHERE id = %s",
                                     (rnd.randint(1, BIG_TXN_ROWS),))
                    else:
                        conn.execute("DELETE FROM events WHERE id = %s", (rnd.randint(1, BIG_TXN_ROWS),))
            if n == 130:
                conn.execute("TRUNCATE lines")
            time.sleep(0.01)


async def test_postgres_producer_demux_ktable_equals_select(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in DDL:
            conn.execute(stmt)
    source = f"walbus.{unique_name}"
    group = demux_group(source)
    args = demux_args(kafka_bootstrap, source, tmp_path / "state", "--txn-max-ms", "500")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source):
        proc = DemuxProc(args, tmp_path / "demux.log").start()
        enough = threading.Event()
        work = asyncio.create_task(asyncio.to_thread(_workload, pg_dsn, 5, enough))
        rnd = random.Random(3)
        kills = 0
        try:
            while kills < 3:
                await wait_for_log(proc, "partition opened", count=kills + 1, within=90)
                await asyncio.sleep(rnd.uniform(1.0, 3.0))
                proc.kill9()
                kills += 1
                proc.start()
        finally:
            enough.set()
            await work
        # The last restart must be up before "caught up" means anything (see test_demux_exactly_once).
        await wait_for_log(proc, "partition opened", count=kills + 1, within=90)
        # Eventually equal: the producer may still be shipping the tail.
        deadline = time.monotonic() + 120
        while True:
            await wait_caught_up(kafka_bootstrap, group, source, procs=[proc], within=120)
            mismatched = []
            for table in KEYS:
                got = await read_ktable(client_kwargs={"bootstrap_servers": kafka_bootstrap},
                                        topic=f"{source}.public.{table}")
                if {k: _norm_kafka(table, v) for k, v in got.items()} != _select_all(pg_dsn, table):
                    mismatched.append(table)
            if not mismatched:
                break
            assert time.monotonic() < deadline, f"KTable != SELECT * for {mismatched}\n{proc.log_tail()}"
            await asyncio.sleep(1)
    assert proc.stop() == 0, proc.log_tail()
    source_values = [r.value for r in await read_records(kafka_bootstrap, source)]
    assert sum(1 for v in source_values if b'"unchanged":["doc"]' in v) > 50, "no unchanged TOAST values exercised"

    for table in KEYS:
        records = await read_records(kafka_bootstrap, f"{source}.public.{table}")
        last: dict[bytes, tuple[int, int] | None] = {}
        for r in records:
            assert r.key is not None
            prev = last.get(r.key, (-1, -1))
            if r.value is None:
                assert prev is not None, f"{table} {r.key!r}: two tombstones in a row"
                last[r.key] = None
                continue
            v = orjson.loads(r.value)
            pos = (v["__commit_lsn"], v["__seq"])
            assert prev is None or pos > prev, f"{table} {r.key!r}: event {pos} after {prev} (duplicate or reorder)"
            last[r.key] = pos
