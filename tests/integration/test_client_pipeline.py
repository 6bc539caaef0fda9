"""The real pipeline: PostgreSQL -> producer -> demux -> Table == SELECT *, and the balances example.

Runs once the demux service is in the tree (it is built on its own branch); skipped before.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.pipeline import ROOT, running_producer, walbus_process
from walbus.client import Feed, Table

pytestmark = pytest.mark.integration


def _select_all(dsn: str) -> dict[int, dict[str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT transaction_id, user_id, amount FROM transactions").fetchall()
    return {r[0]: {"transaction_id": r[0], "user_id": r[1], "amount": r[2]} for r in rows}


def _random_transaction(dsn: str, rng: random.Random, n: int) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for i in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.5:
                conn.execute(
                    "INSERT INTO transactions VALUES (%s, %s, %s) ON CONFLICT (transaction_id) DO UPDATE SET amount = excluded.amount",
                    (rng.randint(1, 40), rng.randint(1, 5), rng.randint(-100, 1000)),
                )
            elif roll < 0.75:
                conn.execute("DELETE FROM transactions WHERE transaction_id = %s", (rng.randint(1, 40),))
            else:
                # A primary-key change (tombstone for the old key), to a key no row has.
                conn.execute(
                    "UPDATE transactions SET transaction_id = %s WHERE transaction_id = %s", (1000 + 10 * n + i, rng.randint(1, 40))
                )
        # Every transaction ends with a row of `other`: the Feed (filtered to it) then yields
        # exactly one event per transaction, carrying its commit LSN.
        conn.execute("INSERT INTO other VALUES (%s)", (n,))


async def test_table_equals_select_and_wait_until(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT)")
        conn.execute("CREATE TABLE other (id INT PRIMARY KEY)")
    rng = random.Random(13)
    source = f"walbus.{unique_name}"  # the demux names table topics after <prefix>.<database>
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source):
        log = tmp_path / "demux.log"
        demux = walbus_process(
            ["demux", "--kafka-bootstrap", kafka_bootstrap, "--source-topic", source, "--state-dir", str(tmp_path / "state")],
            log=log,
        )
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO transactions VALUES (0, 1, 5)")  # the demux creates the topic
            async with (
                asyncio.timeout(120),
                Table(f"{source}.public.transactions", bootstrap_servers=kafka_bootstrap) as table,
                Feed(source, bootstrap_servers=kafka_bootstrap, tables=["public.other"], from_beginning=False) as feed,
            ):
                for n in range(15):
                    await asyncio.to_thread(_random_transaction, pg_dsn, rng, n)
                    event = await asyncio.wait_for(feed.__anext__(), 30)  # this transaction's `other` row
                    async with asyncio.timeout(30):
                        await table.wait_until(event.commit_lsn)
                    assert dict(table) == await asyncio.to_thread(_select_all, pg_dsn), f"after transaction {n}"
            # The balances example on the same pipeline: one sum per user, as SQL computes it.
            env = {**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_KAFKA_BOOTSTRAP": kafka_bootstrap, "WALBUS_TOPIC": source}
            example = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "examples" / "balances_ktable.py"), "--once",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            )
            out, err = await asyncio.wait_for(example.communicate(), 60)
            assert example.returncode == 0, err.decode()[-2000:]
            with psycopg.connect(pg_dsn) as conn:
                sums = conn.execute("SELECT user_id, sum(amount) FROM transactions GROUP BY user_id ORDER BY user_id").fetchall()
            assert json.loads(out) == {"balances": {str(u): int(total) for u, total in sums}}
        except BaseException:
            print(log.read_text()[-5000:])  # shown by pytest on failure
            raise
        finally:
            demux.send_signal(signal.SIGTERM)
            demux.wait(60)


async def test_wait_until_a_large_transactions_commit_waits_for_all_of_it(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path,
) -> None:
    # The producer writes a large transaction over several batches: wait_until(its commit LSN),
    # called as soon as its first event arrived, returned with a part of it in the table
    # (9,500-17,000 rows of 30,000 in a client fuzz). The producer's heartbeat after the
    # transaction, sent as soon as it is idle, now says when all of it is in the database topic
    # (the interval here is 60 s: only that prompt beat ends the wait within the timeout).
    rows = 30_000
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id INT PRIMARY KEY, pad TEXT)")
        conn.execute("INSERT INTO big VALUES (0, 'first')")  # the demux creates the topic
    source = f"walbus.{unique_name}"
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source, heartbeat_interval=60.0):
        log = tmp_path / "demux.log"
        demux = walbus_process(
            ["demux", "--kafka-bootstrap", kafka_bootstrap, "--source-topic", source, "--state-dir", str(tmp_path / "state")],
            log=log,
        )
        try:
            async with (
                asyncio.timeout(150),
                Table(f"{source}.public.big", bootstrap_servers=kafka_bootstrap) as table,
                Feed(source, bootstrap_servers=kafka_bootstrap, tables=["public.big"], from_beginning=False) as feed,
            ):
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("INSERT INTO big SELECT g, repeat('x', 200) FROM generate_series(1, %s) g", (rows,))
                event = await asyncio.wait_for(feed.__anext__(), 60)  # the transaction's first event
                async with asyncio.timeout(45):
                    await table.wait_until(event.commit_lsn)
                assert len(table) == rows + 1, f"{len(table) - 1} of the transaction's {rows} rows"
        except BaseException:
            print(log.read_text()[-5000:])
            raise
        finally:
            demux.send_signal(signal.SIGTERM)
            demux.wait(60)
