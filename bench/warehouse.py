"""Warehouse load throughput on local[2]; prints JSON lines.

    python -m bench.warehouse [--kafka-bootstrap 127.0.0.1:9092] [--events 1000000]

1. ``transactions``: N contract-v1 events of pgkafka's table (80% inserts, 15% updates,
   5% deletes, 500-event transactions) into a fresh topic, then one load: events/s into the
   history and current tables, and the time of each phase;
2. ``wide``: the same for a 16-column table (text, numeric, timestamptz, jsonb, uuid, bool,
   int8, float8, date, text[]), N events;
3. ``incremental``: 10,000 more events over the N-row table of (1), and over a table of
   N/10 rows: the load time must not scale with the table's size.

Events are synthetic (written with record batches, as the producer would): this measures
the loader, not the producer. Without --kafka-bootstrap, WALBUS_KAFKA_BOOTSTRAP or a
local stack (``walbus dev``) is used.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
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
) -> tuple[list[tuple[bytes, bytes]], list[int], int]:
    """(records, live keys, next key) of n events: 80% inserts, 15% updates, 5% deletes."""
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
        if r < 0.8 or len(live) < 10:
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
    (summary,) = result.tables.values()
    return {
        "events": result.events, "seconds": round(seconds, 2), "events_per_s": round(result.events / seconds),
        "history_rows_added": summary.history_rows, "current_inserted": summary.inserted,
        "current_updated": summary.updated, "phases_s": {"read_parse": result.phases.get("read", 0.0), **summary.seconds},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kafka-bootstrap")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--incremental", type=int, default=10_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--shuffle-partitions", type=int, default=4)
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--skip-wide", action="store_true")
    args = ap.parse_args()
    from warehouse.spark import build_session

    with services() as (_, env_bootstrap):
        bootstrap = args.kafka_bootstrap or env_bootstrap
        spark = build_session(master=args.master, shuffle_partitions=args.shuffle_partitions,
                              conf={"spark.driver.memory": args.driver_memory, "spark.ui.enabled": "false"})
        root = tempfile.mkdtemp(prefix="walbus-bench-warehouse-")
        run = uuid.uuid4().hex[:8]
        try:
            emit(bench="warehouse", master=args.master, events=args.events, spark=spark.version,
                 shuffle_partitions=args.shuffle_partitions)
            sizes = {"full": args.events, "tenth": max(args.events // 10, 1)}
            for label, n in sizes.items():
                topic = f"bench-wh-tx-{label}-{run}"
                recs, live, next_key = events(n, "public.transactions", TX_COLS, TX_TYPES, tx_values)
                fill(bootstrap, topic, recs)
                first = load(spark, bootstrap, topic, root)
                if label == "full":
                    emit(workload="transactions", **first)
                more, _, _ = events(args.incremental, "public.transactions", TX_COLS, TX_TYPES, tx_values,
                                    first_key=next_key, first_commit=0x9_0000_0000, live=live, seed=2)
                fill(bootstrap, topic, more)
                again = load(spark, bootstrap, topic, root)
                emit(workload="incremental", table_events=n, **again)
            if not args.skip_wide:
                topic = f"bench-wh-wide-{run}"
                cols, types = [c for c, _ in WIDE], [t for _, t in WIDE]
                recs, _, _ = events(args.events, "public.wide", cols, types, wide_values)
                fill(bootstrap, topic, recs)
                emit(workload="wide", columns=len(WIDE), **load(spark, bootstrap, topic, root))
        finally:
            spark.stop()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
