"""The client end to end: PostgreSQL -> producer -> Feed / `walbus tail` / the examples."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.cdc_data import (
    Change,
    table_records,
)
from tests.support.kafka import create_topic, produce, read_topic
from tests.support.pipeline import (
    ROOT,
    running_producer,
)
from walbus.client import Feed, Transaction

pytestmark = pytest.mark.integration

SCHEMA = """
CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT);
CREATE TABLE users (user_id INT PRIMARY KEY, name TEXT);
CREATE TABLE other (id INT PRIMARY KEY, v TEXT);
"""


def _write_workload(dsn: str, rng: random.Random) -> list[list[tuple[str, str, int]]]:
    """Random transactions; returns each one's (table, operation, key) in statement order."""
    txns: list[list[tuple[str, str, int]]] = []
    live: set[int] = set()
    next_id = 1
    with psycopg.connect(dsn) as conn:
        for n in range(25):
            txn: list[tuple[str, str, int]] = []
            with conn.transaction():
                for _ in range(rng.randint(1, 4)):
                    roll = rng.random()
                    if roll < 0.45 or not live:
                        ids = list(range(next_id, next_id + rng.randint(1, 3)))
                        next_id += len(ids)
                        rows = [(i, rng.randint(1, 5), rng.randint(-500, 2000)) for i in ids]
                        conn.execute(
                            "INSERT INTO transactions VALUES " + ",".join(["(%s,%s,%s)"] * len(rows)),
                            [v for r in rows for v in r],
                        )
                        live.update(ids)
                        txn += [("public.transactions", "insert", i) for i in ids]
                    elif roll < 0.65:
                        i = rng.choice(sorted(live))
                        conn.execute("UPDATE transactions SET amount = amount + 1 WHERE transaction_id = %s", (i,))
                        txn.append(("public.transactions", "update", i))
                    elif roll < 0.75:
                        i = rng.choice(sorted(live))
                        live.discard(i)
                        conn.execute("DELETE FROM transactions WHERE transaction_id = %s", (i,))
                        txn.append(("public.transactions", "delete", i))
                    elif roll < 0.9:
                        conn.execute(
                            "INSERT INTO users VALUES (%s, %s) ON CONFLICT (user_id) DO UPDATE SET name = excluded.name",
                            (n, f"user {n}"),
                        )
                        txn.append(("public.users", "insert", n))  # the first time; an update later
                    else:
                        conn.execute("INSERT INTO other VALUES (%s, 'x')", (n,))
                        txn.append(("public.other", "insert", n))
            txns.append(txn)
    return txns


def _key(event_row: dict[str, Any] | None, identity: dict[str, Any] | None, table: str) -> int:
    column = "transaction_id" if table.endswith("transactions") else ("user_id" if table.endswith("users") else "id")
    source = event_row if event_row is not None else identity
    assert source is not None
    return int(source[column])


async def test_feed_and_tail_from_postgres(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name):
        txns = await asyncio.to_thread(_write_workload, pg_dsn, random.Random(5))
        total = sum(len(t) for t in txns)
        await read_topic(kafka_bootstrap, unique_name, min_count=total)

    wanted = ("public.transactions", "public.users")
    expected = [[e for e in t if e[0] in wanted] for t in txns]
    expected = [t for t in expected if t]
    group = unique_name + "-g"
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, tables=["transactions", "users"], until_end=True) as feed:
        got: list[Transaction] = [t async for t in feed.transactions()]
    shape = [
        [(e.table, e.operation, _key(e.row(), e.identity.as_dict() if e.identity else None, e.table)) for e in t.events]
        for t in got
    ]
    # users' upserts of an existing key decode as updates: compare table and key, and operations elsewhere.
    assert [[(tb, k) for tb, _op, k in t] for t in shape] == [[(tb, k) for tb, _op, k in t] for t in expected]
    assert [[op for tb, op, _ in t if tb.endswith("transactions")] for t in shape] == [
        [op for tb, op, _ in t if tb.endswith("transactions")] for t in expected
    ]
    commit_lsns = [t.commit_lsn for t in got]
    assert commit_lsns == sorted(commit_lsns) and len(set(commit_lsns)) == len(commit_lsns)

    # walbus tail: the same events as JSON lines.
    tail = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "walbus.app.cli", "tail", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
        "--table", "transactions", "--operation", "insert", "--operation", "delete", "--from-beginning", "--until-end",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )
    out, err = await asyncio.wait_for(tail.communicate(), 60)
    assert tail.returncode == 0, err.decode()[-2000:]
    lines = [json.loads(line) for line in out.decode().splitlines()]
    flat = [e for t in txns for e in t if e[0] == "public.transactions" and e[1] in ("insert", "delete")]
    assert [(d["table"], d["operation"]) for d in lines] == [(tb, op) for tb, op, _ in flat]
    assert all(d["v"] == 1 and "commit_lsn" in d for d in lines)

    limited = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "walbus.app.cli", "tail", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
         "--from-beginning", "--max-events", "3"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert limited.returncode == 0 and len(limited.stdout.splitlines()) == 3


def _example_env(pg_dsn: str, kafka_bootstrap: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_PG_DSN": pg_dsn, "WALBUS_KAFKA_BOOTSTRAP": kafka_bootstrap, **extra}


async def test_notify_service_example(pg_dsn: str, kafka_bootstrap: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    database = conninfo_to_dict(pg_dsn)["dbname"]
    async with running_producer(pg_dsn, kafka_bootstrap):
        # History from before the service's first run, in the topic before it starts: not printed.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO transactions VALUES (99, 99, 99)")
        async with Feed(f"walbus.{database}", bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            async with asyncio.timeout(60):
                await anext(aiter(feed))
        service = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "examples" / "notify_service.py"), "--max-events", "3",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_example_env(pg_dsn, kafka_bootstrap),
        )
        assert service.stderr is not None
        async with asyncio.timeout(60):
            while b"listening" not in await service.stderr.readline():
                pass
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO transactions VALUES (54441, 36036, 2000)")
            conn.execute("UPDATE transactions SET amount = 2500 WHERE transaction_id = 54441")
            conn.execute("INSERT INTO other VALUES (1, 'not for us')")
            conn.execute("DELETE FROM transactions WHERE transaction_id = 54441")
            conn.execute("INSERT INTO transactions VALUES (1, 7, 10), (2, 8, 20)")
        out, err = await asyncio.wait_for(service.communicate(), 90)
    assert service.returncode == 0, err.decode()[-2000:]
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [(d["notify_user"], d["transaction_id"], d["amount"]) for d in lines] == [(36036, 54441, 2000), (7, 1, 10), (8, 2, 20)]
    assert database  # the example found its topic from WALBUS_PG_DSN's database name


async def _read_json_line(stream: asyncio.StreamReader) -> dict[str, Any]:
    line = await asyncio.wait_for(stream.readline(), 30)
    assert line, "the example ended early"
    result: dict[str, Any] = json.loads(line)
    return result


async def test_balances_ktable_example(kafka_bootstrap: str, unique_name: str) -> None:
    rng = random.Random(9)
    changes: list[Change] = []
    live: dict[int, dict[str, int]] = {}
    for n in range(120):
        lsn = 0x2000_0000 + n * 100
        if live and rng.random() < 0.2:
            tid = rng.choice(sorted(live))
            changes.append(Change(lsn, 0, n, "public.transactions", "delete", None, {"id": tid}))
            del live[tid]
        elif live and rng.random() < 0.3:
            tid = rng.choice(sorted(live))
            live[tid] = {**live[tid], "amount": rng.randint(-100, 1000)}
            changes.append(Change(lsn, 0, n, "public.transactions", "update", {"id": tid, **live[tid]}, {"id": tid}))
        else:
            tid = n + 1
            live[tid] = {"user_id": rng.randint(1, 6), "amount": rng.randint(-100, 1000)}
            changes.append(Change(lsn, 0, n, "public.transactions", "insert", {"id": tid, **live[tid]}))

    def balances(rows: dict[int, dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in rows.values():
            out[str(r["user_id"])] = out.get(str(r["user_id"]), 0) + r["amount"]
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    topic = f"walbus.{unique_name}.public.transactions"
    await create_topic(kafka_bootstrap, topic, compact=True)
    # The test rows carry an "id" column: rename it to the real table's key.
    def records(cs: list[Change]) -> list[tuple[bytes | None, bytes | None]]:
        out = []
        for key, value in table_records(cs, "public.transactions"):
            assert key is not None
            k = key.replace(b'"id"', b'"transaction_id"')
            out.append((k, value.replace(b'"id"', b'"transaction_id"') if value is not None else None))
        return out

    await produce(kafka_bootstrap, topic, records(changes[:80]))
    env = _example_env("", kafka_bootstrap, WALBUS_TOPIC=f"walbus.{unique_name}")
    once = await asyncio.to_thread(subprocess.run, [sys.executable, str(ROOT / "examples" / "balances_ktable.py"), "--once"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert once.returncode == 0, once.stderr[-2000:]
    rows_80: dict[int, dict[str, int]] = {}
    for c in changes[:80]:
        if c.row is None:
            assert c.old_key is not None
            rows_80.pop(c.old_key["id"])
        else:
            rows_80[c.row["id"]] = {"user_id": c.row["user_id"], "amount": c.row["amount"]}
    assert json.loads(once.stdout) == {"balances": balances(rows_80)}

    follower = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "balances_ktable.py"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )
    try:
        assert follower.stdout is not None
        assert await _read_json_line(follower.stdout) == {"balances": balances(rows_80)}
        await produce(kafka_bootstrap, topic, records(changes[80:]))
        final = balances(live)
        latest: dict[str, int] = dict(balances(rows_80))
        async with asyncio.timeout(30):
            while {u: b for u, b in latest.items() if u in final or b != 0} != final:
                update = await _read_json_line(follower.stdout)
                latest[str(update["user_id"])] = update["balance"]
    finally:
        follower.terminate()
        await follower.communicate()
