"""`walbus demo`: the whole pipeline on the embedded default, in one command.

Starts the local stack unless ``WALBUS_PG_DSN``/``WALBUS_KAFKA_BOOTSTRAP`` point elsewhere,
creates pgkafka's ``transactions`` table in a scratch database, runs the producer and the
demux, writes a short stream of inserts, updates and deletes, shows the database topic and the
compacted table topic, loads the warehouse with Spark and prints its history and current
tables, then stops (and removes) everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from walbus.contract import database_topic
from walbus.contract import table_topic as contract_table_topic
from walbus.logs import redact_dsn

DATABASE_PREFIX = "walbus_demo"
DEMO_MAX_ROWS = 1_000_000  # the demo holds its rows and the table in memory
TABLE_DDL = "CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT)"


class Ticker:
    """Shows that a long step is alive: a counter on a terminal, a dot every few seconds elsewhere."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tty = sys.stdout.isatty()

    def _run(self) -> None:
        start = time.monotonic()
        for spin in itertools.cycle("|/-\\"):
            if self._stop.wait(0.2 if self._tty else 5.0):
                return
            elapsed = time.monotonic() - start
            if self._tty:
                print(f"\r  {spin} {self.label} … {elapsed:4.0f} s", end="", flush=True)
            else:
                print(f"  … {self.label}: {elapsed:.0f} s", flush=True)

    def __enter__(self) -> Ticker:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        done = "failed" if exc[0] else "done"
        end = "\r" if self._tty else ""
        print(f"{end}  ✓ {self.label}: {done} in {time.monotonic() - self._start:.1f} s" + " " * 10, flush=True)


def step(n: int, total: int, text: str) -> None:
    print(f"\n[{n}/{total}] {text}", flush=True)


def endpoints_text(dsn: str, bootstrap: str) -> str:
    """Where the demo's stack listens, for the terminal: the password stays out (`walbus dev
    env` prints the whole DSN for whoever asks for it)."""
    return f"  postgres {redact_dsn(dsn)}\n  kafka    {bootstrap}"


@contextlib.contextmanager
def endpoints(state_dir: Path | None) -> Iterator[tuple[str, str]]:
    dsn, bootstrap = os.environ.get("WALBUS_PG_DSN"), os.environ.get("WALBUS_KAFKA_BOOTSTRAP")
    if dsn and bootstrap:
        print(f"  using WALBUS_PG_DSN / WALBUS_KAFKA_BOOTSTRAP ({bootstrap})")
        yield dsn, bootstrap
        return
    from walbus.app.dev import LocalStack, default_state_dir

    stack = LocalStack.load(state_dir or default_state_dir())
    # A stack of the demo's own is purged at the end; the directory itself goes only if the demo
    # made it (`--state-dir .` keeps the directory and everything in it that is not walbus's).
    created = not stack.record.exists()
    new_dir = not stack.state_dir.exists()
    was_running = stack.postgres.running() and stack.kafka.running()
    try:
        with Ticker("local PostgreSQL + Kafka" + (" (running already)" if was_running else " (the first run fetches Kafka's jars)")):
            stack.up()
        print(endpoints_text(stack.postgres.dsn, stack.kafka.bootstrap))
        yield stack.postgres.dsn, stack.kafka.bootstrap
    finally:
        release(stack, was_running=was_running, created=created, new_dir=new_dir)


def release(stack: Any, *, was_running: bool, created: bool, new_dir: bool = False) -> None:
    """Leave the local stack as the demo found it: a running one runs on, a stopped one is
    stopped again, and one the demo created is purged (its state directory removed when the
    demo made that too)."""
    if was_running:
        return
    # No stack.json: `up` failed before it set anything up (a purge would refuse the directory).
    stack.down(purge=created and stack.record.is_file(), remove_dir=new_dir)
    removed = created and new_dir and not stack.state_dir.exists()
    print("  stopped the local stack" + (f" and removed {stack.state_dir}" if removed else ""))


def fresh_database(admin_dsn: str, database: str) -> str:
    """A new database of this run's own (and a new topic name with it: no old events show)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    dsn = make_conninfo(admin_dsn, dbname=database)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE_DDL)
    return dsn


def drop_database(admin_dsn: str, database: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (database,)).fetchall():
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))


async def drop_demo_topics(bootstrap: str, database: str) -> None:
    """This run's topics: the demo leaves nothing behind on a shared broker."""
    from walbus.kafka import KafkaAdmin

    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        mine = [t for t in await admin.list_topics() if t == f"walbus.{database}" or t.startswith(f"walbus.{database}.")]
        await admin.delete_topics(mine)


def write_stream(dsn: str, rows: int) -> int:
    """pgkafka's example first, then random inserts, updates and deletes, one change per
    transaction. Returns the number of changes."""
    rnd = random.Random(54441)
    changes: list[tuple[str, tuple[Any, ...]]] = [
        ("INSERT INTO transactions VALUES (%s, %s, %s)", (54441, 36036, 2000)),
        ("UPDATE transactions SET amount = %s WHERE transaction_id = %s", (2500, 54441)),
        ("DELETE FROM transactions WHERE transaction_id = %s", (54441,)),
    ]
    ids = list(range(1, rows + 1))
    changes += [("INSERT INTO transactions VALUES (%s, %s, %s)", (i, rnd.randint(1, 5), rnd.randint(1, 100) * 10)) for i in ids]
    changes += [("UPDATE transactions SET amount = amount + %s WHERE transaction_id = %s", (rnd.randint(1, 9) * 5, i)) for i in rnd.sample(ids, rows // 3)]
    changes += [("DELETE FROM transactions WHERE transaction_id = %s", (i,)) for i in rnd.sample(ids, rows // 6)]
    tty = sys.stdout.isatty()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n, (statement, params) in enumerate(changes, 1):
            conn.execute(statement, params)
            if tty:
                print(f"\r  committed {n}/{len(changes)} changes", end="", flush=True)
            elif n % 10 == 0 or n == len(changes):
                print(f"  committed {n}/{len(changes)} changes", flush=True)
            time.sleep(0.01)
    if tty:
        print()
    return len(changes)


async def pipeline(dsn: str, database: str, bootstrap: str, rows: int, warehouse_dir: Path | None, state: Path) -> None:
    from demux.config import DemuxConfig
    from demux.service import Demux
    from producer.config import ProducerConfig
    from producer.service import Producer
    from walbus.client import Feed, Table

    topic = database_topic("walbus", database)
    table_topic = contract_table_topic("walbus", database, "public", "transactions")
    total = 6 if warehouse_dir else 5

    step(2, total, f"producer (slot walbus_{database} -> {topic}) and demux (-> {table_topic})")
    producer = Producer(ProducerConfig(pg_dsn=dsn, kafka_bootstrap=bootstrap, drop_slot_on_exit=True, log_level="warning"))
    demux = Demux(DemuxConfig(kafka_bootstrap=bootstrap, source_topic=topic, state_dir=str(state / "demux"), txn_max_ms=100))
    tasks = [asyncio.create_task(producer.run())]
    try:
        with Ticker("producer streaming"):
            ready = asyncio.create_task(producer.ready.wait())
            done, _ = await asyncio.wait([ready, tasks[0]], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done:
                tasks[0].result()
            if ready not in done:
                raise RuntimeError("the producer did not start within 60 s")
        tasks.append(asyncio.create_task(demux.run()))  # its source topic exists now

        step(3, total, "writing pgkafka's example and a short random stream of inserts, updates and deletes")
        expected = await asyncio.to_thread(write_stream, dsn, rows)

        step(4, total, f"the database topic {topic} (the first 12 events, in commit order)")
        shown = 0
        last_commit = 0
        async with Feed(topic, bootstrap_servers=bootstrap, start="earliest") as feed:
            async with asyncio.timeout(120):
                async for event in feed:
                    last_commit = max(last_commit, event.commit_lsn)
                    if shown < 12:
                        row = event.row() if event.new is not None else (event.identity.as_dict() if event.identity else {})
                        print(f"  {event.key.decode()}  {event.operation:<6} {event.table}  {row}")
                    shown += 1
                    if shown >= expected:
                        break
        print(f"  … {shown} events in all, one per committed change")

        step(5, total, f"the compacted table topic {table_topic} (KTable: latest row per key)")
        async with Table(table_topic, bootstrap_servers=bootstrap) as table:
            with Ticker("waiting for the demux to reflect the last commit"):
                await asyncio.wait_for(table.wait_until(last_commit), 120)
            state_rows = dict(table.items())
        with psycopg.connect(dsn) as conn:
            db_rows = {r[0]: {"transaction_id": r[0], "user_id": r[1], "amount": r[2]} for r in conn.execute("SELECT * FROM transactions")}
        live = {k: {c: v for c, v in row.items() if not c.startswith("__")} for k, row in state_rows.items()}
        for key in sorted(live)[:8]:
            print(f'  {{"transaction_id":{key}}}  ->  {live[key]}')
        print(f"  … {len(live)} live keys; 54441 deleted (tombstone): {54441 not in live}")
        print(f"  KTable == SELECT * FROM transactions: {live == db_rows}")
    finally:
        producer.stop()
        demux.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)

    if warehouse_dir is not None:
        step(6, total, f"warehouse load with Spark (local[2]) into {warehouse_dir}")
        await asyncio.to_thread(warehouse, bootstrap, topic, warehouse_dir)


def warehouse(bootstrap: str, topic: str, root: Path) -> None:
    from walbus.kafka import KafkaOptions
    from warehouse.cli import print_table, run_sql
    from warehouse.job import LoadSpec, run_load
    from warehouse.spark import build_session

    with Ticker("starting Spark (the first run fetches the Kafka and Delta jars)"):
        spark = build_session(master="local[2]", conf={"spark.driver.memory": "1g", "spark.ui.enabled": "false"}, shuffle_partitions=2)
    try:
        with Ticker("loading history and current tables"):
            result = run_load(spark, LoadSpec(KafkaOptions(kafka_bootstrap=bootstrap), topic, str(root), (), 18))
        for line in result.lines():
            print(f"  {line}")
        print("\n  history (every change, deduplicated, sorted by LSN):")
        cols, rows = run_sql(
            spark, str(root), topic,
            "SELECT pg_commit_lsn, pg_seq, pg_operation, transaction_id, user_id, amount FROM public_transactions_history "
            "ORDER BY pg_commit_lsn, pg_seq", 10,
        )
        print_table(cols, [list(r) for r in rows])
        print("\n  current (live rows only):")
        cols, rows = run_sql(
            spark, str(root), topic, "SELECT transaction_id, user_id, amount, pg_operation, pg_commit_lsn, pg_seq FROM public_transactions "
            "ORDER BY transaction_id", 10,
        )
        print_table(cols, [list(r) for r in rows])
    finally:
        spark.stop()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="walbus demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=30, help="rows of the random stream (default: 30)")
    parser.add_argument("--state-dir", type=Path, default=None, help="the local stack's state directory (default: WALBUS_DEV_STATE_DIR or ./.walbus); removed at the end when the demo created it")
    parser.add_argument("--no-warehouse", action="store_true", help="skip the Spark step")
    args = parser.parse_args(argv)
    if not 1 <= args.rows <= DEMO_MAX_ROWS:
        parser.error(f"--rows must be between 1 and {DEMO_MAX_ROWS}")
    from walbus.logs import setup_logging
    from warehouse.extra import spark_missing

    missing = None if args.no_warehouse else spark_missing()
    if missing is not None:
        print(f"walbus demo: error: {missing} (or run the demo with --no-warehouse)", file=sys.stderr)
        return 2

    from walbus.app.dev.processes import exit_on_sigterm

    exit_on_sigterm()  # a stop runs the cleanups: a stack the demo started is not left running
    setup_logging("warning")
    total = 5 if args.no_warehouse else 6
    work = Path(tempfile.mkdtemp(prefix="walbus-demo-"))
    try:
        step(1, total, "PostgreSQL and Kafka")
        with endpoints(args.state_dir) as (admin_dsn, bootstrap):
            database = f"{DATABASE_PREFIX}_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
            dsn = fresh_database(admin_dsn, database)
            try:
                asyncio.run(pipeline(dsn, database, bootstrap, args.rows, None if args.no_warehouse else work / "warehouse", work))
            finally:
                drop_database(admin_dsn, database)
                asyncio.run(drop_demo_topics(bootstrap, database))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nwalbus demo: done")
    return 0
