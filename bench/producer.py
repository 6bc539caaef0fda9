"""Producer benchmark: throughput against pg_recvlogical's ceiling, latency, memory.

Prints JSON lines. Every figure is measured in the same run on the same services:

* ``throughput``: W1 (the transactions table, --rows rows in --txns transactions) and W2 (a
  wider table with inserts, updates and deletes) committed before the producer starts (a
  backlog in the slot); rows/s until Kafka acknowledged all of it (the slot's confirmed
  position reaches the end), per plugin, beside ``pg_recvlogical`` draining an identical
  slot to /dev/null with the same plugin (the decode ceiling), and their ratio.
* ``latency``: commit -> Kafka append p50/p99 under a steady write load (the topic uses
  LogAppendTime, so the broker stamps each record when it appends it).
* ``rss``: the producer's peak RSS for a small and for a large single transaction.

    python bench/producer.py [--rows 1000000] [--big-rows 5000000] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import psycopg

from bench.common import ROOT, Stopwatch, current_lsn, emit, peak_rss_mb, scratch_database, services

W1_DDL = "CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT)"
W2_DDL = (
    "CREATE TABLE wide (id int8 PRIMARY KEY, name text, amount numeric(18,4), created timestamptz, "
    "doc jsonb, ref uuid, active bool)"
)


def load_w1(dsn: str, rows: int, txns: int) -> int:
    per = rows // txns
    with psycopg.connect(dsn) as conn:
        for t in range(txns):
            conn.execute(
                "INSERT INTO transactions SELECT g, g %% 50000, (g * 7) %% 10000 FROM generate_series(%s::int, %s::int) g",
                (t * per, (t + 1) * per - 1),
            )
            conn.commit()
    return per * txns


def load_w2(dsn: str, rows: int, txns: int) -> int:
    per = rows // txns
    events = 0
    with psycopg.connect(dsn) as conn:
        for t in range(txns):
            lo, hi = t * per, (t + 1) * per - 1
            conn.execute(
                "INSERT INTO wide SELECT g, 'name-' || g, g * 1.2345, now() - g * interval '1 second', "
                "jsonb_build_object('g', g, 'tags', jsonb_build_array('a', 'b')), gen_random_uuid(), g %% 2 = 0 "
                "FROM generate_series(%s::int8, %s::int8) g",
                (lo, hi),
            )
            cur = conn.execute("UPDATE wide SET amount = amount + 1, active = NOT active WHERE id BETWEEN %s AND %s AND id %% 4 = 0", (lo, hi))
            events += per + cur.rowcount
            cur = conn.execute("DELETE FROM wide WHERE id BETWEEN %s AND %s AND id %% 10 = 0", (lo, hi))
            events += cur.rowcount
            conn.commit()
    return events


PLUGIN_OPTIONS = {
    "pgoutput": ["-o", "proto_version=1", "-o", "publication_names=walbus_bench"],
    "wal2json": ["-o", "format-version=2", "-o", "include-xids=1", "-o", "include-timestamp=1", "-o", "include-lsn=1", "-o", "include-type-oids=1"],
}


def recvlogical(dsn: str, slot: str, plugin: str, end: int) -> float:
    from walbus.contract import Lsn

    cmd = ["pg_recvlogical", "-d", dsn, "--slot", slot, "--start", "-f", "/dev/null", f"--endpos={Lsn(end)}", "--no-loop", *PLUGIN_OPTIONS[plugin]]
    with Stopwatch() as sw:
        subprocess.run(cmd, check=True, capture_output=True)
    return sw.seconds


def slot_info(dsn: str, slot: str) -> tuple[bool, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT active, (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    assert row is not None
    return bool(row[0]), int(str(row[1]))


def run_producer(dsn: str, bootstrap: str, slot: str, plugin: str, topic: str, end: int, profile: Path | None = None) -> tuple[float, float]:
    """Seconds from the slot going active to the slot confirming ``end``, and peak RSS (MB)."""
    args = [sys.executable]
    if profile is not None:
        args += ["-m", "cProfile", "-o", str(profile)]
    args += ["-m", "walbus.app.cli", "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap, "--slot", slot, "--plugin", plugin,
             "--topic", topic, "--publication", "walbus_bench", "--heartbeat-interval", "0.2", "--log-level", "warning"]
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while not slot_info(dsn, slot)[0]:
            if proc.poll() is not None:
                raise RuntimeError(f"producer exited with {proc.returncode}")
            time.sleep(0.01)
        start = time.perf_counter()
        rss = 0.0
        while slot_info(dsn, slot)[1] < end:
            rss = max(rss, peak_rss_mb(proc.pid))
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        rss = max(rss, peak_rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    return seconds, rss


def throughput(dsn: str, bootstrap: str, workload: str, rows: int, txns: int, plugins: list[str], profile: bool) -> None:
    with scratch_database(dsn, f"bench_{workload.lower()}") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(W1_DDL if workload == "W1" else W2_DDL)
            conn.execute("CREATE PUBLICATION walbus_bench FOR ALL TABLES")
            for plugin in plugins:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (f"prod_{plugin}", plugin))
                conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (f"ceil_{plugin}", plugin))
            if profile:
                conn.execute("SELECT pg_create_logical_replication_slot('prof_pgoutput', 'pgoutput')")
        with Stopwatch() as load:
            events = load_w1(db, rows, txns) if workload == "W1" else load_w2(db, rows, txns)
        end = current_lsn(db)
        emit(bench="producer", kind="load", workload=workload, events=events, seconds=round(load.seconds, 2))
        for plugin in plugins:
            ceiling = recvlogical(db, f"ceil_{plugin}", plugin, end)
            seconds, rss = run_producer(db, bootstrap, f"prod_{plugin}", plugin, f"bench.{workload.lower()}.{plugin}.{int(time.time())}", end)
            emit(
                bench="producer", kind="throughput", workload=workload, plugin=plugin, events=events,
                producer_rows_per_s=round(events / seconds), producer_seconds=round(seconds, 2),
                recvlogical_rows_per_s=round(events / ceiling), recvlogical_seconds=round(ceiling, 2),
                ratio_to_recvlogical=round(ceiling / seconds, 3), peak_rss_mb=round(rss, 1),
            )
        if profile:
            # A separate run under cProfile (it slows the process down; the figures above are without it).
            plugin = "pgoutput"
            prof = Path(f"/tmp/walbus-producer-{workload}.prof")
            run_producer(db, bootstrap, "prof_pgoutput", plugin, f"bench.prof.{workload.lower()}.{int(time.time())}", end, prof)
            top = io.StringIO()
            pstats.Stats(str(prof), stream=top).sort_stats("tottime").print_stats(12)
            lines = [ln.strip() for ln in top.getvalue().splitlines() if ln.strip() and ln.strip()[0].isdigit()]
            emit(bench="producer", kind="profile", workload=workload, plugin=plugin, top_tottime=lines[:12])


def latency(dsn: str, bootstrap: str, rate: int, seconds: float) -> None:
    from aiokafka import AIOKafkaConsumer

    from walbus.kafka import KafkaAdmin, TopicSpec

    topic = f"bench.latency.{int(time.time())}"

    async def make_topic() -> None:
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
            await admin.ensure_topic(TopicSpec(topic, configs=(("message.timestamp.type", "LogAppendTime"),)))

    asyncio.run(make_topic())
    with scratch_database(dsn, "bench_latency") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(W1_DDL)
        args = [sys.executable, "-m", "walbus.app.cli", "produce", "--pg-dsn", db, "--kafka-bootstrap", bootstrap, "--topic", topic, "--log-level", "warning"]
        proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            while True:
                with psycopg.connect(db, autocommit=True) as conn:
                    if conn.execute("SELECT 1 FROM pg_replication_slots WHERE active AND database = current_database()").fetchone():
                        break
                time.sleep(0.05)
            per_txn = 20
            interval = per_txn / rate
            n = 0
            with psycopg.connect(db) as conn:
                start = time.perf_counter()
                while time.perf_counter() - start < seconds:
                    conn.execute("INSERT INTO transactions SELECT g, 1, 1 FROM generate_series(%s::int, %s::int) g", (n, n + per_txn - 1))
                    conn.commit()
                    n += per_txn
                    delay = start + (n / per_txn) * interval - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                achieved = n / (time.perf_counter() - start)
            time.sleep(2)
        finally:
            proc.terminate()
            proc.wait(60)

    async def read() -> list[float]:
        from datetime import datetime

        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        out: list[float] = []
        try:
            while len(out) < n:
                batch = await consumer.getmany(timeout_ms=2000, max_records=50000)
                if not batch:
                    break
                for msgs in batch.values():
                    for m in msgs:
                        ts = datetime.fromisoformat(orjson.loads(m.value)["timestamp"]).timestamp() * 1000
                        out.append(m.timestamp - ts)
        finally:
            await consumer.stop()
        return out

    lat = sorted(asyncio.run(read()))
    emit(
        bench="producer", kind="latency", target_rows_per_s=rate, achieved_rows_per_s=round(achieved), events=len(lat),
        p50_ms=round(lat[len(lat) // 2], 2), p99_ms=round(lat[int(len(lat) * 0.99)], 2), max_ms=round(lat[-1], 2),
    )


def rss(dsn: str, bootstrap: str, sizes: list[int]) -> None:
    for size in sizes:
        with scratch_database(dsn, "bench_rss") as db:
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute(W1_DDL)
                conn.execute("CREATE PUBLICATION walbus_bench FOR ALL TABLES")
                conn.execute("SELECT pg_create_logical_replication_slot('prod_rss', 'pgoutput')")
            with Stopwatch() as load:
                load_w1(db, size, 1)
            end = current_lsn(db)
            seconds, peak = run_producer(db, bootstrap, "prod_rss", "pgoutput", f"bench.rss.{size}.{int(time.time())}", end)
            emit(bench="producer", kind="rss", transaction_rows=size, peak_rss_mb=round(peak, 1),
                 rows_per_s=round(size / seconds), load_seconds=round(load.seconds, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--txns", type=int, default=100)
    parser.add_argument("--plugins", default="pgoutput,wal2json")
    parser.add_argument("--latency-rate", type=int, default=2000)
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--big-rows", type=int, default=5_000_000, help="rows of the large transaction in the RSS check (0: skip)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: throughput,latency,rss")
    parser.add_argument("--profile", action="store_true", help="profile the pgoutput producer (cProfile)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    plugins = [p for p in args.plugins.split(",") if p]
    with services() as (dsn, bootstrap):
        if "throughput" not in skip:
            throughput(dsn, bootstrap, "W1", args.rows, args.txns, plugins, args.profile)
            throughput(dsn, bootstrap, "W2", max(args.rows // 4, 1000), args.txns, plugins, args.profile)
        if "latency" not in skip:
            latency(dsn, bootstrap, args.latency_rate, args.latency_seconds)
        if "rss" not in skip and args.big_rows:
            rss(dsn, bootstrap, [10_000, args.big_rows])


if __name__ == "__main__":
    threading.excepthook = lambda a: None
    main()
