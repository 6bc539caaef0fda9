"""The job a data engineer would write instead of walbus' loader: the comparison of
``python -m bench.warehouse`` (issue 19).

One table, its columns and key known in advance: a Kafka batch read of the whole topic,
``from_json`` of the envelope, the values picked by column name and cast, a Delta append to
a history table, and a MERGE of the latest row per key (``row_number`` over the key by
position) into a current table (deletes delete). Same Spark session, same Delta version.

What it does not do, and walbus does: check records against the contract, drop duplicate
events (within the load and against the table), fill unchanged TOAST values, guard the
MERGE against older events, keep tombstones and TRUNCATE, evolve the schema, keep values
Spark cannot hold exactly, and commit each load exactly once.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

# what the naive job makes of each PostgreSQL type: a cast from the value's text
_CASTS = {
    "int2": "int", "int4": "int", "int8": "bigint", "float4": "float", "float8": "double", "bool": "boolean",
    "numeric": "decimal(38,10)", "date": "date", "timestamp": "timestamp", "timestamptz": "timestamp",
}
_ENVELOPE = (
    "lsn decimal(20,0), commit_lsn decimal(20,0), seq bigint, xid bigint, operation string, `table` string, "
    "timestamp string, columns array<string>, `values` array<string>, "
    "identity struct<columns: array<string>, `values`: array<string>>"
)


def _value(name: str, pg_type: str) -> Any:
    values = F.map_from_arrays(
        F.coalesce(F.col("e.columns"), F.col("e.identity.columns")),
        F.coalesce(F.col("e.values"), F.col("e.identity.values")),
    )
    raw = values[name]
    if pg_type.startswith("_"):  # a one-dimensional text array: '{a,"b c"}'
        return F.split(F.regexp_replace(raw, r'^\{|\}$|"', ""), ",").alias(name)
    return raw.cast(_CASTS.get(pg_type, "string")).alias(name)


def rows(
    spark: SparkSession, bootstrap: str, topic: str, columns: Sequence[tuple[str, str]],
    offsets: tuple[int, int] | None = None,
) -> DataFrame:
    """The topic's events, typed: all of them, or partition 0's ``offsets`` (start, end)."""
    reader = spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap)
    if offsets is None:
        reader = reader.option("subscribe", topic).option("startingOffsets", "earliest").option("endingOffsets", "latest")
    else:
        reader = (
            reader.option("assign", orjson.dumps({topic: [0]}).decode())
            .option("startingOffsets", orjson.dumps({topic: {"0": offsets[0]}}).decode())
            .option("endingOffsets", orjson.dumps({topic: {"0": offsets[1]}}).decode())
        )
    raw = reader.load()
    parsed = raw.select(F.from_json(F.col("value").cast("string"), _ENVELOPE).alias("e"))
    return parsed.select(
        F.col("e.table").alias("table"),
        F.col("e.commit_lsn").alias("commit_lsn"),
        F.col("e.seq").alias("seq"),
        F.col("e.operation").alias("operation"),
        F.col("e.timestamp").cast("timestamp").alias("txn_timestamp"),
        *[_value(name, pg_type) for name, pg_type in columns],
    )


def run(spark: SparkSession, bootstrap: str, topic: str, root: str, columns: Sequence[tuple[str, str]]) -> int:
    """Load ``topic`` (one table, keyed on its first column) into ``root``; events loaded."""
    events = rows(spark, bootstrap, topic, columns).drop("table").cache()  # read from Kafka once
    try:
        return write_table(spark, events, root, columns[0][0])
    finally:
        events.unpersist()


def write_table(spark: SparkSession, events: DataFrame, root: str, key: str, *, merge: bool = True) -> int:
    """One table's events into ``root``/history (appended) and ``root``/current (the latest
    row per key MERGEd; ``merge=False``: appended, Delta's least work for a second table);
    the rows appended to the history."""
    from delta.tables import DeltaTable

    history, current = f"{root}/history", f"{root}/current"
    events.write.format("delta").mode("append").save(history)
    latest = (
        events.withColumn("_n", F.row_number().over(Window.partitionBy(key).orderBy(F.desc("commit_lsn"), F.desc("seq"))))
        .where("_n = 1")
        .drop("_n")
    )
    if not merge:
        latest.write.format("delta").mode("append").save(current)
    else:
        if not DeltaTable.isDeltaTable(spark, current):
            latest.where("operation != 'delete'").limit(0).write.format("delta").save(current)
        (
            DeltaTable.forPath(spark, current).alias("t")
            .merge(latest.alias("s"), f"t.{key} = s.{key}")
            .whenMatchedDelete(condition="s.operation = 'delete'")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll(condition="s.operation != 'delete'")
            .execute()
        )
    return int(DeltaTable.forPath(spark, history).history(1).select("operationMetrics").first()[0]["numOutputRows"])


def run_tables(
    spark: SparkSession, bootstrap: str, topic: str, root: str, tables: Sequence[str],
    columns: Sequence[tuple[str, str]], offsets: tuple[int, int], *, merge: bool = True, threads: int = 8,
) -> int:
    """The naive job over a topic of many tables (all with ``columns``): the slice read once
    and cached, then each table written as :func:`write_table` does, ``threads`` at a time
    (walbus' default); the rows appended to the histories."""
    events = rows(spark, bootstrap, topic, columns, offsets).cache()
    try:
        events.count()

        def one(i_table: tuple[int, str]) -> int:
            i, table = i_table
            mine = events.where(F.col("table") == table).drop("table")
            return write_table(spark, mine, f"{root}/t{i}", columns[0][0], merge=merge)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, enumerate(tables)))
    finally:
        events.unpersist()


def main() -> None:
    """``python -m bench.warehouse_baseline --kafka-bootstrap B --topic T --table transactions|wide``:
    the naive job as a nightly job of its own (a new process and JVM, Ivy resolving the
    connector jars, no walbus driver cache: what a data engineer's own job pays); prints its
    events and seconds from process start as JSON (``bench.warehouse --cold``)."""
    started = time.monotonic()
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--kafka-bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--table", choices=["transactions", "wide"], required=True)
    ap.add_argument("--warehouse", help="root of its tables (default: a temporary directory)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--shuffle-partitions", type=int, default=4)
    args = ap.parse_args()
    os.environ["WALBUS_SPARK_DRIVER_CACHE"] = "off"
    from bench.warehouse import TX_COLS, TX_TYPES, WIDE
    from warehouse.spark import build_session

    columns = list(zip(TX_COLS, TX_TYPES, strict=True)) if args.table == "transactions" else WIDE
    spark = build_session(master=args.master, shuffle_partitions=args.shuffle_partitions,
                          conf={"spark.driver.memory": args.driver_memory, "spark.ui.enabled": "false"})
    root = args.warehouse or tempfile.mkdtemp(prefix="walbus-bench-naive-")
    events = run(spark, args.kafka_bootstrap, args.topic, root, columns)
    spark.stop()
    print(json.dumps({"events": events, "seconds": round(time.monotonic() - started, 2)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
