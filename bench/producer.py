"""Producer benchmark: throughput against pg_recvlogical's ceiling, latency, memory.

Prints JSON lines. Every figure is measured in the same run on the same services:

* ``throughput``: W1 (the transactions table, --rows rows in --txns transactions) and W2 (a
  wider table with inserts, updates and deletes) committed before the producer starts (a
  backlog in the slot); rows/s until Kafka acknowledged all of it (the slot's confirmed
  position reaches the end), per plugin and per transport (loopback TCP, Unix socket),
  beside ``pg_recvlogical`` draining a copy of the same slot to /dev/null with the same
  plugin (the decode ceiling), their ratio, and the CPU seconds per million rows of the
  client, its walsender and the broker (the broker is shared: its figure includes whatever
  else it serves meanwhile), and ``*_steal_pct``: the share of the machine's CPU a virtual
  machine's host took during that run (a round with much of it measures the host's load). ``--baseline DIR``: another checkout's producer drains the same
  backlog in the same run (before/after figures).
* ``latency``: commit -> Kafka append p50/p99 under a steady write load (the topic uses
  LogAppendTime, so the broker stamps each record when it appends it).
* ``rss``: the producer's peak RSS for a small and for a large single transaction.

    python -m bench.producer [--rows 1000000] [--big-rows 5000000] [--baseline DIR] [--rounds 2] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import os
import pstats
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg.conninfo import make_conninfo

from bench.common import (
    ROOT,
    Stopwatch,
    cpu_seconds,
    cpu_times,
    current_lsn,
    dsn_in_env,
    emit,
    listener_pid,
    peak_rss_mb,
    scratch_database,
    services,
    steal_percent,
)

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


def copy_slot(dsn: str, origin: str, slot: str) -> None:
    """A fresh slot at ``origin``'s position: every run drains the very same backlog."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (origin, slot))


def drop_slot(dsn: str, slot: str) -> None:
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            except psycopg.errors.ObjectInUse:  # its walsender has not exited yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def slot_info(dsn: str, slot: str) -> tuple[int | None, int]:
    """(walsender pid while the slot is in use, confirmed position)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid, (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert row is not None
    return (None if row[0] is None else int(str(row[0]))), int(str(row[1]))


@dataclass
class Run:
    """One drain of the backlog: wall seconds from the slot going active, CPU seconds of the
    client (producer or pg_recvlogical), its walsender and the broker, peak RSS of the client."""

    seconds: float = 0.0
    client_cpu: float = 0.0
    walsender_cpu: float = 0.0
    broker_cpu: float = 0.0
    peak_rss_mb: float = 0.0
    steal_pct: float = 0.0  # of the machine's CPU time during the run, taken by a VM's host

    def figures(self, name: str, events: int) -> dict[str, float]:
        per_m = 1e6 / events
        return {
            f"{name}_rows_per_s": round(events / self.seconds), f"{name}_seconds": round(self.seconds, 2),
            f"{name}_cpu_s_per_m_rows": round(self.client_cpu * per_m, 2),
            f"{name}_walsender_cpu_s_per_m_rows": round(self.walsender_cpu * per_m, 2),
            f"{name}_broker_cpu_s_per_m_rows": round(self.broker_cpu * per_m, 2),
            f"{name}_steal_pct": self.steal_pct,
        }


def measure(proc: subprocess.Popen[bytes], dsn: str, slot: str, end: int, broker: int | None, *, until_exit: bool) -> Run:
    """Sample the run's processes every 20 ms until the slot confirmed ``end`` (the producer)
    or the client exited (pg_recvlogical, which stops at ``--endpos``)."""
    launched = time.perf_counter()
    walsender = None
    while walsender is None:
        if proc.poll() is not None:
            if until_exit and proc.returncode == 0:  # a backlog drained before the slot was seen in use
                return Run(seconds=time.perf_counter() - launched)
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before streaming")
        walsender = slot_info(dsn, slot)[0]
        time.sleep(0.005)
    start = time.perf_counter()
    machine = cpu_times()
    base = (cpu_seconds(proc.pid), cpu_seconds(walsender), cpu_seconds(broker) if broker else 0.0)
    run = Run()
    while True:
        client, ws = cpu_seconds(proc.pid), cpu_seconds(walsender)  # 0.0 once exited: keep the last
        run.client_cpu = max(run.client_cpu, client - base[0])
        run.walsender_cpu = max(run.walsender_cpu, ws - base[1])
        run.broker_cpu = (cpu_seconds(broker) - base[2]) if broker else 0.0
        with contextlib.suppress(OSError):
            run.peak_rss_mb = max(run.peak_rss_mb, peak_rss_mb(proc.pid))
        if until_exit and proc.poll() is not None:
            break
        if not until_exit and slot_info(dsn, slot)[1] >= end:
            break
        if proc.poll() is not None:  # a producer that died never confirms the end: do not wait for it
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before the slot confirmed {end:X}")
        time.sleep(0.02)
    run.seconds = time.perf_counter() - start
    run.steal_pct = steal_percent(machine, cpu_times())
    return run


def recvlogical(dsn: str, slot: str, plugin: str, end: int, broker: int | None) -> Run:
    from walbus.contract import Lsn

    cmd = ["pg_recvlogical", "-d", dsn, "--slot", slot, "--start", "-f", "/dev/null", f"--endpos={Lsn(end)}", "--no-loop", *PLUGIN_OPTIONS[plugin]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return measure(proc, dsn, slot, end, broker, until_exit=True)
    finally:
        proc.wait(60)


def run_producer(
    dsn: str, bootstrap: str, slot: str, plugin: str, topic: str, end: int, *, tree: Path = ROOT,
    broker: int | None = None, profile: Path | None = None, env: dict[str, str] | None = None,
) -> Run:
    """The producer of ``tree`` (this one, or a baseline checkout) draining ``slot`` up to ``end``."""
    args = [sys.executable]
    if profile is not None:
        args += ["-m", "cProfile", "-o", str(profile)]
    cli = "walbus.app.cli" if (tree / "walbus" / "app" / "cli.py").exists() else "walbus.cli"  # a baseline before the app layer
    args += ["-m", cli, "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap, "--slot", slot, "--plugin", plugin,
             "--topic", topic, "--publication", "walbus_bench", "--heartbeat-interval", "0.2", "--log-level", "warning"]
    child_env = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
    proc = subprocess.Popen(dsn_in_env(args, child_env), cwd=tree, env=child_env)
    try:
        return measure(proc, dsn, slot, end, broker, until_exit=False)
    finally:
        proc.terminate()
        proc.wait(60)


PURE_PYTHON = {"WALBUS_NATIVE": "0"}  # the producer without its compiled hot path (producer.native)


def unix_socket_dsn(dsn: str) -> str | None:
    """The same database over the server's Unix socket, when it is on this machine."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        dirs = str(conn.execute("SHOW unix_socket_directories").fetchone()[0])  # type: ignore[index]
        port = str(conn.execute("SHOW port").fetchone()[0])  # type: ignore[index]
    for d in (x.strip() for x in dirs.split(",")):
        if d and Path(d, f".s.PGSQL.{port}").exists():
            return make_conninfo(dsn, host=d, port=port)
    return None


def throughput(
    dsn: str, bootstrap: str, workload: str, rows: int, txns: int, plugins: list[str], *, baseline: Path | None,
    rounds: int, transports: list[str], profile: bool, pure: bool, variant: dict[str, str] | None = None,
) -> None:
    """Every run drains a copy of the same slot (pg_copy_logical_replication_slot), so all
    figures of a workload are of one backlog; runs alternate within each round."""
    broker = listener_pid(int(bootstrap.split(",")[0].rsplit(":", 1)[1]))
    tag = f"{workload.lower()}_{os.getpid()}"  # slot names are cluster-wide: two runs must not share them
    with scratch_database(dsn, f"bench_{tag}") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(W1_DDL if workload == "W1" else W2_DDL)
            conn.execute("CREATE PUBLICATION walbus_bench FOR ALL TABLES")
            for plugin in plugins:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (f"origin_{plugin}_{tag}", plugin))
        with Stopwatch() as load:
            events = load_w1(db, rows, txns) if workload == "W1" else load_w2(db, rows, txns)
        end = current_lsn(db)
        emit(bench="producer", kind="load", workload=workload, events=events, seconds=round(load.seconds, 2))
        dsns = {"tcp": db, "unix": unix_socket_dsn(db)}
        for rnd, transport, plugin in itertools.product(range(rounds), transports, plugins):
            via = dsns[transport]
            if via is None:
                emit(bench="producer", kind="skipped", transport=transport, reason="no Unix socket of the server here")
                continue
            runs: dict[str, Run] = {}
            trees = {"producer": ROOT, **({"pure": ROOT} if pure else {}), **({"variant": ROOT} if variant else {}),
                     **({"baseline": baseline} if baseline is not None else {})}
            for name in ("recvlogical", *trees):
                slot = f"run_{plugin}_{tag}"
                copy_slot(db, f"origin_{plugin}_{tag}", slot)
                try:
                    if name == "recvlogical":
                        runs[name] = recvlogical(via, slot, plugin, end, broker)
                    else:
                        topic = f"bench.{workload.lower()}.{plugin}.{name}.{time.time_ns()}"
                        runs[name] = run_producer(via, bootstrap, slot, plugin, topic, end, tree=trees[name], broker=broker,
                                                  env={"pure": PURE_PYTHON, "variant": variant}.get(name))
                finally:
                    drop_slot(db, slot)
            line: dict[str, object] = {
                "bench": "producer", "kind": "throughput", "workload": workload, "plugin": plugin, "transport": transport,
                "round": rnd, "events": events, "load_avg_1m": round(os.getloadavg()[0], 2),
            }
            for name, run in runs.items():
                line |= run.figures(name, events)
            line["peak_rss_mb"] = round(runs["producer"].peak_rss_mb, 1)
            line["ratio_to_recvlogical"] = round(runs["recvlogical"].seconds / runs["producer"].seconds, 3)
            if "pure" in runs:
                line["pure_ratio_to_recvlogical"] = round(runs["recvlogical"].seconds / runs["pure"].seconds, 3)
            if "variant" in runs:
                line["variant_env"] = ",".join(f"{k}={v}" for k, v in (variant or {}).items())
                line["variant_ratio_to_recvlogical"] = round(runs["recvlogical"].seconds / runs["variant"].seconds, 3)
            if "baseline" in runs:
                line["baseline_ratio_to_recvlogical"] = round(runs["recvlogical"].seconds / runs["baseline"].seconds, 3)
            emit(**line)
        if profile:
            # A separate run under cProfile (it slows the process down; the figures above are without it).
            plugin = "pgoutput"
            prof = Path(f"/tmp/walbus-producer-{tag}.prof")
            copy_slot(db, f"origin_{plugin}_{tag}", f"prof_{tag}")
            run_producer(db, bootstrap, f"prof_{tag}", plugin, f"bench.prof.{workload.lower()}.{int(time.time())}", end, profile=prof)
            top = io.StringIO()
            pstats.Stats(str(prof), stream=top).sort_stats("tottime").print_stats(12)
            lines = [ln.strip() for ln in top.getvalue().splitlines() if ln.strip() and ln.strip()[0].isdigit()]
            emit(bench="producer", kind="profile", workload=workload, plugin=plugin, top_tottime=lines[:12])


def latency(dsn: str, bootstrap: str, rate: int, seconds: float, *, path: str = "default") -> None:
    from aiokafka import AIOKafkaConsumer

    from walbus.kafka import KafkaAdmin, TopicSpec

    topic = f"bench.latency.{int(time.time())}"

    async def make_topic() -> None:
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
            await admin.ensure_topic(TopicSpec(topic, configs=(("message.timestamp.type", "LogAppendTime"),)))

    asyncio.run(make_topic())
    with scratch_database(dsn, f"bench_latency_{os.getpid()}") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(W1_DDL)
        args = [sys.executable, "-m", "walbus.app.cli", "produce", "--pg-dsn", db, "--kafka-bootstrap", bootstrap, "--topic", topic, "--log-level", "warning"]
        child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(PURE_PYTHON if path == "pure" else {})}
        proc = subprocess.Popen(dsn_in_env(args, child_env), cwd=ROOT, env=child_env)
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
        bench="producer", kind="latency", path=path, target_rows_per_s=rate, achieved_rows_per_s=round(achieved), events=len(lat),
        p50_ms=round(lat[len(lat) // 2], 2), p99_ms=round(lat[int(len(lat) * 0.99)], 2), max_ms=round(lat[-1], 2),
    )


def rss(dsn: str, bootstrap: str, sizes: list[int]) -> None:
    for size in sizes:
        with scratch_database(dsn, f"bench_rss_{os.getpid()}") as db:
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute(W1_DDL)
                conn.execute("CREATE PUBLICATION walbus_bench FOR ALL TABLES")
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"prod_rss_{os.getpid()}",))
            with Stopwatch() as load:
                load_w1(db, size, 1)
            end = current_lsn(db)
            run = run_producer(db, bootstrap, f"prod_rss_{os.getpid()}", "pgoutput", f"bench.rss.{size}.{int(time.time())}", end)
            emit(bench="producer", kind="rss", transaction_rows=size, peak_rss_mb=round(run.peak_rss_mb, 1),
                 rows_per_s=round(size / run.seconds), load_seconds=round(load.seconds, 1))


def warm_broker(dsn: str, bootstrap: str, rows: int) -> None:
    """One untimed producer run of ``rows`` W1 inserts before the measured rounds: a broker
    just started still compiles its hot paths while it takes its first records (measured on a
    fresh local stack: 5.4 and 8.3 µs of broker CPU a row in the first round, 2.0-2.2 in the
    second, ~3M records later), and that cost would land on the producer's runs alone
    (``pg_recvlogical`` does not use the broker)."""
    tag = f"warm_{os.getpid()}"
    with scratch_database(dsn, f"bench_{tag}") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(W1_DDL)
            conn.execute("CREATE PUBLICATION walbus_bench FOR ALL TABLES")
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (tag,))
        load_w1(db, rows, max(1, rows // 10_000))
        try:
            run = run_producer(db, bootstrap, tag, "pgoutput", f"bench.warm.{time.time_ns()}", current_lsn(db))
        finally:
            drop_slot(db, tag)
    emit(bench="producer", kind="warmup", events=rows, seconds=round(run.seconds, 2))


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
    parser.add_argument("--baseline", type=Path, help="a checkout of another walbus whose producer drains the same backlogs too")
    parser.add_argument("--variant", default="",
                        help="KEY=VALUE[,KEY=VALUE]: also run this producer with these settings (WALBUS_* variables), "
                             "e.g. WALBUS_COMPRESSION=lz4")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (transport, plugin), alternating")
    parser.add_argument("--pure", action="store_true",
                        help="also run this producer with its native hot path off (WALBUS_NATIVE=0), throughput and latency")
    parser.add_argument("--transports", default="tcp,unix", help="tcp (loopback), unix (the server's socket) or both")
    parser.add_argument("--warmup-rows", type=int, default=1_000_000,
                        help="W1 rows one untimed producer run sends first, so that a broker just started has compiled "
                             "its hot paths before anything is measured (0: none)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    plugins = [p for p in args.plugins.split(",") if p]
    with services() as (dsn, bootstrap):
        if args.warmup_rows and skip != {"throughput", "latency", "rss"}:
            warm_broker(dsn, bootstrap, args.warmup_rows)
        if "throughput" not in skip:
            variant = dict(kv.split("=", 1) for kv in args.variant.split(",") if kv)
            opts: dict[str, Any] = {"baseline": args.baseline, "rounds": args.rounds, "profile": args.profile, "pure": args.pure,
                                    "variant": variant,
                                    "transports": [t for t in args.transports.split(",") if t]}
            throughput(dsn, bootstrap, "W1", args.rows, args.txns, plugins, **opts)
            throughput(dsn, bootstrap, "W2", max(args.rows // 4, 1000), args.txns, plugins, **opts)
        if "latency" not in skip:
            for path in ("default", "pure") if args.pure else ("default",):
                latency(dsn, bootstrap, args.latency_rate, args.latency_seconds, path=path)
        if "rss" not in skip and args.big_rows:
            rss(dsn, bootstrap, [10_000, args.big_rows])


if __name__ == "__main__":
    threading.excepthook = lambda a: None
    main()
