"""Warehouse load throughput on local[2]; prints JSON lines.

    python -m bench.warehouse [--kafka-bootstrap 127.0.0.1:9092] [--events 100000] [--rounds 2] [--tables 1,16,200]

1. ``transactions``: N contract-v1 events of pgkafka's table (80% inserts, 15% updates,
   5% deletes, 500-event transactions) into a fresh topic, then one walbus load and the
   naive job of ``bench/warehouse_baseline.py`` over the same topic in the same session:
   events/s of both, their ratio (``speedup``: > 1 is walbus faster), walbus' phases; each
   job ``--rounds`` times (2), in the order walbus, naive, naive, walbus… (see ``compare``):
   ``speedup_steady`` leaves each job's first run out;
2. ``wide``: the same for a 16-column table (text, numeric, timestamptz, jsonb, uuid, bool,
   int8, float8, date, text[]), N events;
3. ``tables``: one load of 2,000 events spread over T tables (``--tables 1,16``), then a second
   one into the existing tables, then a third of inserts only (append-only tables): seconds
   per extra table of each, walbus', the naive job's over many tables and Delta's least (two
   appends a table), on the same slices (see ``tables_sweep``);
4. ``incremental``: 10,000 more events over an N-event table, and over one of N/10 events:
   the load time must not scale with the table's size.

Events are synthetic (written with record batches, as the producer would): this measures
the loader, not the producer. Without --kafka-bootstrap, WALBUS_KAFKA_BOOTSTRAP or a
local stack (``walbus dev``) is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.common import emit, fill_topic, services
from walbus.contract import encode_event, event_key
from walbus.kafka import KafkaOptions

TS = "2024-01-02T03:04:05.123456+00:00"
TX_COLS = ["transaction_id", "user_id", "amount"]
TX_TYPES = ["int4", "int4", "int4"]
WIDE = [
    ("id", "int8"), ("name", "text"), ("email", "text"), ("balance", "numeric"), ("rate", "float8"),
    ("active", "bool"), ("created", "timestamptz"), ("updated", "timestamptz"), ("birthday", "date"),
    ("attrs", "jsonb"), ("ref", "uuid"), ("tags", "_text"), ("score", "int4"), ("note", "text"),
    ("visits", "int8"), ("country", "varchar"),
]


def tx_values(rnd: random.Random, key: int) -> list[Any]:
    return [key, rnd.randint(1, 50000), rnd.randint(1, 10**6)]


def wide_values(rnd: random.Random, key: int) -> list[Any]:
    return [
        key, f"name {key}", f"user{key}@example.com", f"{rnd.randint(0, 10**9)}.{rnd.randint(0, 99):02d}",
        rnd.random() * 100, rnd.random() < 0.5, "2024-01-02 03:04:05.123456+00", "2024-03-04 05:06:07+00",
        "1990-05-06", '{"plan": "pro", "seats": 3}', str(uuid.UUID(int=key)), '{red,"dark blue"}',
        rnd.randint(0, 100), "x" * rnd.randint(0, 60), rnd.randint(0, 10**6), "NL",
    ]


def events(
    n: int, table: str, columns: list[str], types: list[str], values: Callable[[random.Random, int], list[Any]],
    *, first_key: int = 1, first_commit: int = 0x1_0000_0000, live: list[int] | None = None, seed: int = 1,
    inserts_only: bool = False,
) -> tuple[list[tuple[bytes, bytes]], list[int], int]:
    """(records, live keys, next key) of n events: 80% inserts, 15% updates, 5% deletes (or
    inserts of new keys only)."""
    rnd = random.Random(seed)
    live = list(live or [])
    out: list[tuple[bytes, bytes]] = []
    next_key = first_key
    commit = first_commit
    pk = [columns[0]]
    for i in range(n):
        if i % 500 == 0:
            commit += 0x10000
        seq = i % 500
        common: dict[str, Any] = {"lsn": commit - 0x8000 + seq, "commit_lsn": commit, "seq": seq,
                                  "xid": 1000 + i // 500, "table": table, "timestamp": TS, "pk": pk}
        r = rnd.random()
        if r < 0.8 or len(live) < 10 or inserts_only:
            key, next_key = next_key, next_key + 1
            live.append(key)
            v = encode_event(operation="insert", new={"columns": columns, "types": types, "values": values(rnd, key)},
                             identity=None, **common)
        elif r < 0.95:
            key = live[rnd.randrange(len(live))]
            v = encode_event(operation="update", new={"columns": columns, "types": types, "values": values(rnd, key)},
                             identity={"columns": pk, "types": types[:1], "values": [key]}, **common)
        else:
            key = live.pop(rnd.randrange(len(live)))
            v = encode_event(operation="delete", new=None,
                             identity={"columns": pk, "types": types[:1], "values": [key]}, **common)
        out.append((event_key(commit, seq), v))
    return out, live, next_key


async def _fill(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    await fill_topic(bootstrap, topic, records)


def fill(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    asyncio.run(_fill(bootstrap, topic, records))


def load(spark: Any, bootstrap: str, topic: str, warehouse: str) -> dict[str, Any]:
    from warehouse.job import LoadSpec, run_load

    started = time.monotonic()
    result = run_load(spark, LoadSpec(KafkaOptions(kafka_bootstrap=bootstrap), topic, warehouse))
    seconds = time.monotonic() - started
    summaries = list(result.tables.values())
    out: dict[str, Any] = {
        "events": result.events, "seconds": round(seconds, 2), "events_per_s": round(result.events / seconds),
        "tables": len(summaries), "phases_s": {"read_parse": result.phases.get("read", 0.0)},
    }
    out.update(history_rows_added=sum(s.history_rows for s in summaries),
               current_inserted=sum(s.inserted for s in summaries), current_updated=sum(s.updated for s in summaries))
    if len(summaries) == 1:
        out["phases_s"].update(summaries[0].seconds)
    return out


def baseline(spark: Any, bootstrap: str, topic: str, root: str, columns: list[tuple[str, str]]) -> dict[str, Any]:
    """The naive job (bench/warehouse_baseline.py) over the same topic, in the same session."""
    from bench import warehouse_baseline

    started = time.monotonic()
    n = warehouse_baseline.run(spark, bootstrap, topic, f"{root}/baseline-{topic}", columns)
    seconds = time.monotonic() - started
    return {"events": n, "seconds": round(seconds, 2), "events_per_s": round(n / seconds)}


def compare(
    spark: Any, bootstrap: str, topic: str, root: str, columns: list[tuple[str, str]], rounds: int = 2
) -> dict[str, Any]:
    """walbus' load and the naive job over one topic: each one's figures and the ratio.

    Each round runs both, each into a warehouse of its own (so each loads the whole topic),
    the order mirrored from round to round: walbus, naive, naive, walbus, walbus, naive…
    Whichever runs first in a JVM pays JIT warm-up for what the other reuses (the Kafka
    source, Delta's writer), and the mirrored order gives both the same share of it.
    ``speedup`` is the ratio of the means; ``speedup_steady`` that of the rounds after the
    first (a JVM that has run both jobs before: a ``warehouse stream`` or a long-lived
    driver, where a nightly ``warehouse load`` starts a JVM of its own)."""
    order = [job for i in range(rounds) for job in (("walbus", "naive") if i % 2 == 0 else ("naive", "walbus"))]
    runs: dict[str, list[dict[str, Any]]] = {"walbus": [], "naive": []}
    for i, job in enumerate(order):
        where = f"{root}/round-{i}"
        if job == "walbus":
            runs[job].append(load(spark, bootstrap, topic, where))
        else:
            runs[job].append(baseline(spark, bootstrap, topic, where, columns))

    def mean(job: str, skip: int = 0) -> float:
        taken = runs[job][skip:]
        return sum(r["seconds"] for r in taken) / len(taken)

    ours, naive = dict(runs["walbus"][0]), dict(runs["naive"][0])
    for out, job in ((ours, "walbus"), (naive, "naive")):
        out["seconds_each"] = [r["seconds"] for r in runs[job]]
        out["events_each"] = [r["events"] for r in runs[job]]
    if rounds > 1:
        ours["phases_s_last"] = runs["walbus"][-1]["phases_s"]
    out = {"walbus": ours, "baseline": naive, "order": order, "speedup": round(mean("naive") / mean("walbus"), 2)}
    if rounds > 1:
        out["speedup_steady"] = round(mean("naive", 1) / mean("walbus", 1), 2)
    return out


def cold_compare(
    bootstrap: str, topic: str, table: str, events: int, root: str, rounds: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Each job as a nightly job of its own, ``rounds`` times in mirrored order: ``walbus
    warehouse load`` (its driver cache as ``walbus warehouse prepare`` left it) and the naive
    job (``python -m bench.warehouse_baseline``: Ivy, no cache), each a new process and JVM into
    a new warehouse; seconds from process start to exit, and their ratio (``speedup``)."""
    spark_args = ["--master", args.master, "--driver-memory", args.driver_memory,
                  "--shuffle-partitions", str(args.shuffle_partitions)]
    order = [job for i in range(rounds) for job in (("walbus", "naive") if i % 2 == 0 else ("naive", "walbus"))]
    seconds: dict[str, list[float]] = {"walbus": [], "naive": []}
    for i, job in enumerate(order):
        where = f"{root}/cold-{topic}-{i}"
        if job == "walbus":
            command = [sys.executable, "-m", "walbus.app.cli", "warehouse", "load", "--kafka-bootstrap", bootstrap,
                       "--topic", topic, "--warehouse", where, "--spark-conf", "spark.ui.enabled=false", *spark_args]
        else:
            command = [sys.executable, "-m", "bench.warehouse_baseline", "--kafka-bootstrap", bootstrap,
                       "--topic", topic, "--table", table, "--warehouse", where, *spark_args]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        took = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"{job} job failed: {done.stderr[-2000:]}")
        loaded = (int(done.stdout.split(" events, ", 1)[0].rsplit(" ", 1)[-1]) if job == "walbus"
                  else int(json.loads(done.stdout.splitlines()[-1])["events"]))
        if loaded != events:
            raise RuntimeError(f"{job} job loaded {loaded} events, not {events}: {done.stdout[-2000:]}")
        seconds[job].append(round(took, 2))
    mean = {job: sum(v) / len(v) for job, v in seconds.items()}
    return {"order": order, "walbus_s": seconds["walbus"], "naive_s": seconds["naive"], "events": events,
            "speedup": round(mean["naive"] / mean["walbus"], 2)}


# the many-tables loads, in order: a first one, a second (updates and deletes among inserts),
# a third of inserts only
LOADS = ("first", "second", "inserts")


def tables_sweep(spark: Any, bootstrap: str, root: str, run: str, counts: list[int], total: int) -> None:
    """One load of ``total`` events spread over T tables, for each T, then a second one into the
    same (now existing) tables, as every later nightly load, then a third of inserts of new
    keys only (append-only tables: logs, events): seconds per extra table of each.

    After each walbus load, on the same slice, in the same session: the naive job over many
    tables (``naive``: the slice read once, each table's history append and current MERGE,
    as many tables at once as walbus writes) and Delta's least work for the same tables
    (``delta_floor``: the same job with the current table appended, not merged: two Delta
    appends a table, nothing read back). A loader that keeps a history and a current table
    per source table pays the floor's cost per table whatever else it does."""
    from bench import warehouse_baseline

    columns = list(zip(TX_COLS, TX_TYPES, strict=True))
    seconds: dict[str, dict[int, list[float]]] = {job: {} for job in ("walbus", "naive", "delta_floor")}

    def timed(job: str, count: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        out = fn(*args, **kwargs)
        seconds[job].setdefault(count, []).append(time.monotonic() - started)
        return out

    for count in counts:
        topic = f"bench-wh-tables-{count}-{run}"
        names = [f"public.t{i}" for i in range(count)]
        sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
        state: list[tuple[list[int], int]] = []
        end = 0
        for load_no, kind in enumerate(LOADS):
            recs: list[tuple[bytes, bytes]] = []
            for i, n in enumerate(sizes):
                if load_no == 0:
                    part, live, next_key = events(n, names[i], TX_COLS, TX_TYPES, tx_values, first_commit=(i + 1) << 32, seed=i)
                else:
                    live, next_key = state[i]
                    part, live, next_key = events(
                        n, names[i], TX_COLS, TX_TYPES, tx_values, first_key=next_key,
                        first_commit=((i + 1) << 32) + load_no * (1 << 30), live=live, seed=100 * load_no + i,
                        inserts_only=kind == "inserts")
                state[i:i + 1] = [(live, next_key)]
                recs += part
            fill(bootstrap, topic, recs)
            start, end = end, end + len(recs)
            result = timed("walbus", count, load, spark, bootstrap, topic, root)
            rows = {}
            for job, merge in (("naive", True), ("delta_floor", False)):
                rows[job] = timed(job, count, warehouse_baseline.run_tables, spark, bootstrap, topic,
                                  f"{root}/{job}-{topic}", names, columns, (start, end), merge=merge)
            emit(workload="tables", load=kind, **result,
                 naive_s=round(seconds["naive"][count][-1], 2), naive_rows=rows["naive"],
                 delta_floor_s=round(seconds["delta_floor"][count][-1], 2))
    if len(counts) > 1:
        low, high = min(counts), max(counts)

        def per_table(job: str, load_no: int) -> float:
            return round((seconds[job][high][load_no] - seconds[job][low][load_no]) / (high - low), 3)

        emit(workload="tables", seconds_per_extra_table=per_table("walbus", 0),
             seconds_per_extra_table_second_load=per_table("walbus", 1),
             seconds_per_extra_table_inserts=per_table("walbus", 2),
             naive=[per_table("naive", n) for n in range(len(LOADS))],
             delta_floor=[per_table("delta_floor", n) for n in range(len(LOADS))],
             loads=list(LOADS), between=[low, high], events=total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kafka-bootstrap")
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--incremental", type=int, default=10_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--shuffle-partitions", type=int, default=4)
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of walbus' load and the naive job on each one-table topic (order mirrored each round)")
    ap.add_argument("--skip-wide", action="store_true")
    ap.add_argument("--skip-incremental", action="store_true")
    ap.add_argument("--tables", default="1,16", help="table counts of the many-tables load (comma-separated; empty: skip)")
    ap.add_argument("--tables-events", type=int, default=2_000, help="events of each many-tables load")
    ap.add_argument("--cold", type=int, default=0, metavar="ROUNDS",
                    help="also run each one-table job as a nightly job of its own (a new process and JVM each) "
                    "ROUNDS times, walbus' CLI against the naive job (see cold_compare)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting for both jobs' session (repeatable)")
    args = ap.parse_args()
    from warehouse.job import INTERPRETED_BELOW_RECORDS
    from warehouse.spark import build_session

    with services() as (_, env_bootstrap):
        bootstrap = args.kafka_bootstrap or env_bootstrap
        spark = build_session(master=args.master, shuffle_partitions=args.shuffle_partitions,
                              conf={"spark.driver.memory": args.driver_memory, "spark.ui.enabled": "false",
                                    **dict(kv.split("=", 1) for kv in args.conf)})
        root = tempfile.mkdtemp(prefix="walbus-bench-warehouse-")
        run = uuid.uuid4().hex[:8]
        try:
            emit(bench="warehouse", master=args.master, events=args.events, spark=spark.version,
                 shuffle_partitions=args.shuffle_partitions, conf=args.conf)
            # Both jobs once on a small topic first: the first Kafka read, Delta write and MERGE
            # of a session load classes and warm the JIT, a cost neither job should carry alone.
            # Past INTERPRETED_BELOW_RECORDS, so that walbus warms the generated-code path its
            # measured loads take (a smaller warm-up ran interpreted: only the naive job's was warm).
            topic = f"bench-wh-warmup-{run}"
            warmup = INTERPRETED_BELOW_RECORDS + 1_000 if args.events > INTERPRETED_BELOW_RECORDS else min(2_000, max(args.events // 10, 100))
            recs, _, _ = events(warmup, "public.transactions", TX_COLS, TX_TYPES, tx_values)
            fill(bootstrap, topic, recs)
            emit(workload="warmup", **compare(spark, bootstrap, topic, root, list(zip(TX_COLS, TX_TYPES, strict=True)), 1))
            topic = f"bench-wh-tx-{run}"
            recs, _, _ = events(args.events, "public.transactions", TX_COLS, TX_TYPES, tx_values)
            fill(bootstrap, topic, recs)
            emit(workload="transactions",
                 **compare(spark, bootstrap, topic, root, list(zip(TX_COLS, TX_TYPES, strict=True)), args.rounds))
            one_table = [("transactions", topic)]
            if not args.skip_wide:
                topic = f"bench-wh-wide-{run}"
                recs, _, _ = events(args.events, "public.wide", [c for c, _ in WIDE], [t for _, t in WIDE], wide_values)
                fill(bootstrap, topic, recs)
                emit(workload="wide", columns=len(WIDE), **compare(spark, bootstrap, topic, root, WIDE, args.rounds))
                one_table.append(("wide", topic))
            for table, topic in one_table if args.cold else []:
                emit(workload=f"cold-{table}", **cold_compare(bootstrap, topic, table, args.events, root, args.cold, args))
            if args.tables:
                tables_sweep(spark, bootstrap, root, run, [int(t) for t in args.tables.split(",")], args.tables_events)
            if not args.skip_incremental:
                incremental(spark, bootstrap, root, run, args.events, args.incremental)
        finally:
            spark.stop()
            shutil.rmtree(root, ignore_errors=True)


def incremental(spark: Any, bootstrap: str, root: str, run: str, events_full: int, more_events: int) -> None:
    """``more_events`` over a table of ``events_full`` events, and over one 10 times smaller."""
    for label, n in {"full": events_full, "tenth": max(events_full // 10, 1)}.items():
        topic = f"bench-wh-inc-{label}-{run}"
        recs, live, next_key = events(n, "public.transactions", TX_COLS, TX_TYPES, tx_values)
        fill(bootstrap, topic, recs)
        load(spark, bootstrap, topic, root)
        more, _, _ = events(more_events, "public.transactions", TX_COLS, TX_TYPES, tx_values,
                            first_key=next_key, first_commit=0x9_0000_0000, live=live, seed=2)
        fill(bootstrap, topic, more)
        emit(workload="incremental", table_events=n, **load(spark, bootstrap, topic, root))


if __name__ == "__main__":
    main()
