"""Initial snapshot benchmark: rows/s into Kafka (all acknowledged) against COPY's read ceiling.

Prints JSON lines, every figure from the same run on the same table:

* ``copy_ceiling``: ``COPY (SELECT …) TO STDOUT`` of the table drained by psql to /dev/null
  (what PostgreSQL can hand out), and the same COPY drained by psycopg in Python (the
  snapshot's own read path without conversion, encoding or Kafka);
* ``snapshot``: ``walbus produce --snapshot-mode initial_only`` with 1 and with 2 workers (a
  new slot and topic each time): the snapshot's own duration from its log (slot creation to
  the last acknowledgement) and the process's wall time, rows/s, and the ratio to the ceiling.

    python -m bench.snapshot [--rows 2000000] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psycopg
from psycopg.conninfo import conninfo_to_dict

from bench.common import ROOT, Stopwatch, emit, scratch_database, services

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


def snapshot_run(dsn: str, bootstrap: str, name: str, workers: int, log: Path) -> tuple[float, float, int]:
    args = [
        sys.executable, "-m", "walbus.app.cli", "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap,
        "--topic", name, "--slot", name, "--snapshot-mode", "initial_only", "--snapshot-workers", str(workers),
        "--drop-slot-on-exit",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WALBUS_PG_DSN", None)
    env.pop("WALBUS_KAFKA_BOOTSTRAP", None)
    with log.open("wb") as out, Stopwatch() as sw:
        subprocess.run(args, env=env, stdout=out, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            rec = orjson.loads(line)
            if rec.get("msg") == "initial snapshot completed":
                return float(rec["seconds"]), sw.seconds, int(rec["rows"])
    raise RuntimeError(f"no completion in {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each measurement (the median is reported)")
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
        for workers in (1, 2):
            runs = []
            for i in range(opts.repeat):
                name = f"bench_snap_{workers}_{i}_{int(time.time())}"
                runs.append(snapshot_run(dsn, bootstrap, name, workers, logdir / f"{name}.log"))
            snap_s = statistics.median(r[0] for r in runs)
            wall_s = statistics.median(r[1] for r in runs)
            rows = runs[0][2]
            emit(
                kind="snapshot", workers=workers, rows=rows, seconds=round(snap_s, 3), rows_per_s=round(rows / snap_s),
                process_wall_seconds=round(wall_s, 3), ratio_to_copy_psql=round(ceil_psql / snap_s, 3),
                ratio_to_copy_psycopg=round(ceil_py / snap_s, 3),
            )


if __name__ == "__main__":
    main()
