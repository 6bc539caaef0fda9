"""History tables: every event exactly once, rows written in (commit LSN, seq) order.

Duplicates (the producer re-sends after a crash; a topic written twice) are removed twice:
within the load, and against the rows already in the table. The latter reads only the files
whose ``pg_commit_lsn`` range overlaps the load's (Delta data skipping on the file stats that
LSN-ordered appends keep tight), so it does not scan the whole history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from warehouse.frame import POSITION, table_columns
from warehouse.schema import SourceColumn
from warehouse.txn import Txn, last_commit_metrics


@dataclass(frozen=True)
class HistoryResult:
    written: int  # rows appended by this load (0 when the table already had this load)
    skipped: bool  # the table had already committed this load (a rerun after a crash)


def write_history(
    spark: SparkSession, path: str, rows: DataFrame, columns: list[SourceColumn], pk: list[str], txn: Txn,
    lsn_range: tuple[Any, Any] | None = None,
) -> HistoryResult:
    """Append the load's new events; with a primary key each row keeps the key it had before
    the event (``_walbus_prev_<key>``), so a key-changing update says which row it moved.
    ``lsn_range``: the lowest and highest commit LSN of ``rows`` when the caller knows them
    (the load's per-table summary does: one Spark job a table fewer)."""
    if txn.applied(spark, path):
        return HistoryResult(0, True)
    rows = rows.select(*table_columns(columns, pk)).dropDuplicates(list(POSITION))
    if lsn_range is None:
        bounds = rows.agg(F.min("pg_commit_lsn").alias("lo"), F.max("pg_commit_lsn").alias("hi")).first()
        lsn_range = (None, None) if bounds is None else (bounds["lo"], bounds["hi"])
    lo, hi = lsn_range
    if lo is None or hi is None:
        return HistoryResult(0, False)
    existing = (
        spark.read.format("delta")
        .load(path)
        .where(F.col("pg_commit_lsn").between(lo, hi))
        .select(*POSITION)
    )
    fresh = rows.join(existing, list(POSITION), "left_anti").orderBy(*POSITION)
    (
        fresh.write.format("delta")
        .mode("append")
        .option("txnAppId", txn.app_id)
        .option("txnVersion", txn.batch_id)
        .save(path)
    )
    metrics = last_commit_metrics(spark, path)
    return HistoryResult(int(metrics.get("numOutputRows", 0)), False)
