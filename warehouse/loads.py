"""The load log: which slice of the topic each load covers, and whether it completed.

A Delta table at ``<warehouse>/<topic>/_walbus_loads``, appended to only. Each load N writes
two rows: ``planned`` (its fixed offset range, before any data is written) and ``committed``
(after every table has committed load N). Together with the per-table markers of
:mod:`warehouse.txn` this is a two-phase protocol like Spark Structured Streaming's offset
and commit logs:

* last row ``committed`` -> the next load starts at its end offsets;
* last row ``planned`` (the job died) -> the next run replays load N with exactly the same
  offsets; the tables that had committed load N skip it, the others write it. Then it
  continues with a new load.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from warehouse.read import Offsets

LOADS_SCHEMA = StructType(
    [
        StructField("batch_id", LongType(), False),
        StructField("status", StringType(), False),
        StructField("start_offsets", StringType(), False),
        StructField("end_offsets", StringType(), False),
        StructField("at", TimestampType(), False),
        StructField("summary", StringType(), True),
    ]
)


@dataclass(frozen=True)
class Load:
    batch_id: int
    status: str  # planned | committed
    start: Offsets
    end: Offsets


def _offsets(text: str) -> Offsets:
    return {int(p): int(o) for p, o in orjson.loads(text).items()}


def _text(offsets: Offsets) -> str:
    return orjson.dumps({str(p): o for p, o in sorted(offsets.items())}).decode()


def last_load(spark: SparkSession, path: str) -> Load | None:
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    row = (
        spark.read.format("delta")
        .load(path)
        .orderBy(F.col("batch_id").desc(), F.when(F.col("status") == "committed", 1).otherwise(0).desc())
        .first()
    )
    if row is None:
        return None
    return Load(int(row["batch_id"]), row["status"], _offsets(row["start_offsets"]), _offsets(row["end_offsets"]))


def record(spark: SparkSession, path: str, load: Load, summary: dict[str, Any] | None = None) -> None:
    row = (
        load.batch_id,
        load.status,
        _text(load.start),
        _text(load.end),
        dt.datetime.now(dt.UTC),
        orjson.dumps(summary).decode() if summary is not None else None,
    )
    spark.createDataFrame([row], LOADS_SCHEMA).write.format("delta").mode("append").save(path)
