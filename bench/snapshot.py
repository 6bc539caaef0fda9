"""Initial snapshot benchmark: rows/s into Kafka (all acknowledged) against COPY's read ceiling.

Prints JSON lines, every figure from the same run on the same table:

* ``copy_ceiling``: ``COPY (SELECT …) TO STDOUT`` of the table drained by psql to /dev/null
  (what PostgreSQL can hand out), and the same COPY drained by psycopg in Python (the
  snapshot's own read path without conversion, encoding or Kafka);
* ``snapshot``: ``walbus produce --snapshot-mode initial_only`` with 1 and with 2 workers (a
  new slot and topic each time): the snapshot's own duration from its log (slot creation to
  the last acknowledgement) and the process's wall time, rows/s, and the ratio to the ceiling;
  the CPU split: the producer's CPU seconds (and those of its threads but the event loop's:
  the snapshot's readers, COPY lines to values; the event loop encodes and appends), the
  PostgreSQL server's (every backend: the server is shared, so it includes other load) and
  the broker's (shared too), each per million rows.

``--baseline DIR``: another checkout's producer snapshots the same table too, in paired
rounds (this one, then the baseline), so that both see the same machine load.

    python -m bench.snapshot [--rows 2000000] [--repeat 1] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import psycopg
from psycopg.conninfo import conninfo_to_dict

from bench.common import (
    ROOT,
    Stopwatch,
    cpu_seconds,
    dsn_in_env,
    emit,
    listener_pid,
    scratch_database,
    services,
)

DDL = "CREATE TABLE transactions (transaction_id INT PRIMARY KEY, user_id INT, amount INT, note text, created timestamptz)"


def load(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        step = 500_000
        for lo in range(0, rows, step):
            conn.execute(
                "INSERT INTO transactions SELECT g, g %% 50000, (g * 7) %% 10000, md5(g::text), "
                "timestamptz '2024-01-01' + g * interval '1 second' FROM generate_series(%s::int, %s::int) g",
                (lo, min(rows, lo + step) - 1),
            )
        conn.execute("VACUUM ANALYZE transactions")


def psql_ceiling(dsn: str) -> float:
    params = conninfo_to_dict(dsn)
    env = {**os.environ, "PGHOST": str(params.get("host", "")), "PGPORT": str(params.get("port", "5432")),
           "PGUSER": str(params.get("user", "")), "PGDATABASE": str(params.get("dbname", ""))}
    if params.get("password"):
        env["PGPASSWORD"] = str(params["password"])
    with Stopwatch() as sw:
        subprocess.run(["psql", "-Atc", "COPY (SELECT * FROM transactions) TO STDOUT"], env=env, stdout=subprocess.DEVNULL, check=True)
    return sw.seconds


def psycopg_ceiling(dsn: str) -> float:
    with (
        psycopg.connect(dsn) as conn, conn.cursor() as cur, Stopwatch() as sw,
        cur.copy("COPY (SELECT * FROM transactions) TO STDOUT") as copy,
    ):
        for _ in copy:
            pass
    return sw.seconds


@dataclass
class SnapshotRun:
    seconds: float  # the snapshot's own, from its log
    wall: float  # the process's
    rows: int
    producer_cpu: float
    reader_cpu: float  # the producer's threads but the event loop's: the snapshot's readers
    postgres_cpu: float
    broker_cpu: float


def _other_threads_cpu(pid: int) -> float:
    """CPU seconds of a process's threads but its main one (the producer's event loop): the
    snapshot's reading threads, mostly."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if task.name == str(pid):
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _postgres_cpu(postmaster: int | None) -> float:
    """CPU seconds of the server's processes now (live backends; ended ones count in the
    postmaster's children times)."""
    if postmaster is None:
        return 0.0
    total = 0.0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster or int(proc.name) == postmaster:
                total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return total


def snapshot_run(dsn: str, bootstrap: str, name: str, workers: int, log: Path, tree: Path = ROOT) -> SnapshotRun:
    cli = "walbus.app.cli" if (tree / "walbus" / "app" / "cli.py").exists() else "walbus.cli"
    args = [
        sys.executable, "-m", cli, "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap,
        "--topic", name, "--slot", name, "--snapshot-mode", "initial_only", "--snapshot-workers", str(workers),
        "--drop-slot-on-exit",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("WALBUS_PG_DSN", None)
    env.pop("WALBUS_KAFKA_BOOTSTRAP", None)
    args = dsn_in_env(args, env)
    params = conninfo_to_dict(dsn)
    postmaster = listener_pid(int(str(params.get("port", "5432"))))
    broker = listener_pid(int(bootstrap.rsplit(":", 1)[1]))
    pg0, br0 = _postgres_cpu(postmaster), cpu_seconds(broker) if broker else 0.0
    reader = 0.0
    with log.open("wb") as out, Stopwatch() as sw:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tree)
        while proc.poll() is None:
            reader = max(reader, _other_threads_cpu(proc.pid))  # gone with the process: keep the last
            time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"the producer failed: {log}")
    producer_cpu = cpu_children()
    pg_cpu, br_cpu = _postgres_cpu(postmaster) - pg0, (cpu_seconds(broker) if broker else 0.0) - br0
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            rec = orjson.loads(line)
            if rec.get("msg") == "initial snapshot completed":
                return SnapshotRun(float(rec["seconds"]), sw.seconds, int(rec["rows"]), producer_cpu, reader, pg_cpu, br_cpu)
    raise RuntimeError(f"no completion in {log}")


_children_seen = 0.0


def cpu_children() -> float:
    """CPU seconds of the child processes that ended since the last call."""
    global _children_seen
    t = os.times()
    total = t.children_user + t.children_system
    delta, _children_seen = total - _children_seen, total
    return delta


def _summary(runs: list[SnapshotRun], ceil_psql: float, ceil_py: float) -> dict[str, object]:
    snap_s = statistics.median(r.seconds for r in runs)
    rows = runs[0].rows
    per_m = 1e6 / max(rows, 1)
    return {
        "rows": rows, "seconds": round(snap_s, 3), "rows_per_s": round(rows / snap_s),
        "process_wall_seconds": round(statistics.median(r.wall for r in runs), 3),
        "ratio_to_copy_psql": round(ceil_psql / snap_s, 3), "ratio_to_copy_psycopg": round(ceil_py / snap_s, 3),
        "producer_cpu_s_per_m_rows": round(statistics.median(r.producer_cpu for r in runs) * per_m, 2),
        "reader_threads_cpu_s_per_m_rows": round(statistics.median(r.reader_cpu for r in runs) * per_m, 2),
        "postgres_cpu_s_per_m_rows": round(statistics.median(r.postgres_cpu for r in runs) * per_m, 2),
        "broker_cpu_s_per_m_rows": round(statistics.median(r.broker_cpu for r in runs) * per_m, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each measurement (the median is reported)")
    ap.add_argument("--baseline", type=Path, help="a checkout of another walbus whose producer snapshots the same table too")
    opts = ap.parse_args()
    with services() as (admin_dsn, bootstrap), scratch_database(admin_dsn, "walbus_bench_snapshot") as dsn:
        with Stopwatch() as sw:
            load(dsn, opts.rows)
        emit(kind="load", rows=opts.rows, seconds=round(sw.seconds, 2))
        ceil_psql = statistics.median(psql_ceiling(dsn) for _ in range(opts.repeat))
        ceil_py = statistics.median(psycopg_ceiling(dsn) for _ in range(opts.repeat))
        emit(kind="copy_ceiling", rows=opts.rows, psql_rows_per_s=round(opts.rows / ceil_psql),
             psycopg_rows_per_s=round(opts.rows / ceil_py), psql_seconds=round(ceil_psql, 3), psycopg_seconds=round(ceil_py, 3))
        logdir = Path(os.environ.get("TMPDIR", "/tmp"))
        trees = {"snapshot": ROOT, **({"baseline": opts.baseline} if opts.baseline is not None else {})}
        cpu_children()
        for workers in (1, 2):
            runs: dict[str, list[SnapshotRun]] = {kind: [] for kind in trees}
            for i in range(opts.repeat):
                for kind, tree in trees.items():  # paired: this one, then the baseline, under the same load
                    name = f"bench_{kind}_{workers}_{i}_{int(time.time())}"
                    runs[kind].append(snapshot_run(dsn, bootstrap, name, workers, logdir / f"{name}.log", tree))
            for kind, got in runs.items():
                emit(kind=kind, workers=workers, **_summary(got, ceil_psql, ceil_py))

if __name__ == "__main__":
    main()
