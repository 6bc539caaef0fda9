"""Helpers for the snapshot tests: a KTable from the database topic, writers, log polling."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg

from tests.support.pipeline import slot_confirmed_lsn

Records = list[tuple[bytes | None, bytes | None]]


def ktable(records: Records, table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The latest row per primary key of ``table``, by topic order (what the demux keeps):
    insert/update/read set the row, delete and an update's old key remove it, truncate clears."""
    state: dict[tuple[Any, ...], dict[str, Any]] = {}
    for _, value in records:
        if value is None:
            continue
        ev = orjson.loads(value)
        if ev["table"] != table:
            continue
        op = ev["operation"]
        if op == "truncate":
            state.clear()
            continue
        pk = ev["pk"]
        ident = ev.get("identity")
        if ident is not None:
            old = dict(zip(ident["columns"], ident["values"], strict=True))
            state.pop(tuple(old[c] for c in pk), None)
        if op in ("insert", "update", "read"):
            row = dict(zip(ev["columns"], ev["values"], strict=True))
            state[tuple(row[c] for c in pk)] = row
    return state


def db_table(dsn: str, table: str, key: str = "id") -> dict[tuple[Any, ...], dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(f"SELECT * FROM {table}").fetchall()  # type: ignore[arg-type]
    return {(r[key],): dict(r) for r in rows}


def assert_same(records: Records, dsn: str, table: str, qualified: str) -> None:
    got = ktable(records, qualified)
    want = db_table(dsn, table)
    missing = want.keys() - got.keys()
    extra = got.keys() - want.keys()
    stale = [k for k in want.keys() & got.keys() if want[k] != got[k]]
    assert not missing and not extra and not stale, (
        f"{qualified}: {len(missing)} missing {sorted(missing)[:5]}, {len(extra)} extra {sorted(extra)[:5]}, "
        f"{len(stale)} stale {[(want[k], got[k]) for k in stale[:3]]}"
    )


class Churn(threading.Thread):
    """Small transactions of updates, deletes and inserts on ``table (id int pk, v text, n int)``."""

    def __init__(self, dsn: str, table: str, max_id: int, *, first_new_id: int = 10_000_000, pause: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.dsn, self.table, self.max_id, self.next_id, self.pause = dsn, table, max_id, first_new_id, pause
        self.stop_flag = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rnd = random.Random(7)
        try:
            with psycopg.connect(self.dsn, autocommit=False) as conn:
                while not self.stop_flag.is_set():
                    ids = [rnd.randrange(self.max_id) for _ in range(5)]
                    conn.execute(f"UPDATE {self.table} SET v = md5(random()::text), n = n + 1 WHERE id = ANY(%s)", (ids[:3],))  # type: ignore[arg-type]
                    conn.execute(f"DELETE FROM {self.table} WHERE id = %s", (ids[3],))  # type: ignore[arg-type]
                    conn.execute(f"INSERT INTO {self.table} VALUES (%s, 'new', 0) ON CONFLICT DO NOTHING", (self.next_id,))  # type: ignore[arg-type]
                    self.next_id += 1
                    conn.commit()
                    self.transactions += 1
                    time.sleep(self.pause)
        except BaseException as e:  # surfaced by the test
            self.error = e

    def finish(self) -> None:
        self.stop_flag.set()
        self.join(30)
        assert self.error is None, self.error


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
    assert row is not None
    return int(str(row[0]))


async def wait_slot_caught_up(dsn: str, slot: str, timeout: float = 120) -> None:
    """Until the slot confirmed everything written so far (Kafka acknowledged it)."""
    target = current_lsn(dsn)
    deadline = time.monotonic() + timeout
    while slot_confirmed_lsn(dsn, slot) < target:
        assert time.monotonic() < deadline, "the producer did not catch up"
        await asyncio.sleep(0.3)


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


async def wait_log(path: Path, text: str, timeout: float = 120, *, after: int = 0) -> int:
    """Until ``text`` appears in the log (from byte ``after``); returns the offset after it."""
    deadline = time.monotonic() + timeout
    while True:
        data = _read(path)
        at = data.find(text.encode(), after)
        if at >= 0:
            return at + len(text)
        assert time.monotonic() < deadline, f"{text!r} not in the log after {timeout} s:\n{data[-3000:].decode(errors='replace')}"
        await asyncio.sleep(0.1)


def log_events(path: Path, msg: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        if line.startswith(b"{"):
            rec = orjson.loads(line)
            if rec.get("msg") == msg:
                out.append(rec)
    return out
