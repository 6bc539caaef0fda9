"""History tables: every event exactly once, rows written in (commit LSN, seq) order.

Duplicates (the producer re-sends after a crash; a topic written twice) are removed twice:
within the load (unless its first pass saw the positions rise through the whole slice, see
:func:`warehouse.decode.positions_unique`), and against the rows already in the table. The latter reads only the files
whose ``pg_commit_lsn`` range overlaps the load's (Delta data skipping on the file stats that
LSN-ordered appends keep tight), so it does not scan the whole history; and not at all when
the load starts past the table's highest commit LSN, which each append notes in its commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from warehouse import frame
from warehouse.frame import POSITION, table_columns
from warehouse.schema import NewTable, SourceColumn, create_table
from warehouse.txn import (
    HIGH_WATER_KEY,
    Txn,
    history_high_water,
    last_commit_metrics,
    table_version,
)


@dataclass(frozen=True)
class HistoryResult:
    written: int  # rows appended by this load (0 when the table already had this load)
    skipped: bool  # the table had already committed this load (a rerun after a crash)


def write_history(
    spark: SparkSession, path: str, rows: DataFrame, columns: list[SourceColumn], pk: list[str], txn: Txn,
    lsn_range: tuple[Any, Any] | None = None, events: int | None = None, new_table: NewTable | None = None,
    unique: bool = False,
) -> HistoryResult:
    """Append the load's new events; with a primary key each row keeps the key it had before
    the event (``_walbus_prev_<key>``), so a key-changing update says which row it moved.
    ``lsn_range``: the lowest and highest commit LSN of ``rows`` when the caller knows them
    (the load's per-table summary does: one Spark job a table fewer). ``events``: how many
    rows ``rows`` holds at most, when the caller knows (a small load is written as one file).
    ``new_table``: the table does not exist yet; this write creates it. ``unique``: ``rows``
    hold each position once, in the slice's partitions, each in offset order (the load's
    first pass saw the positions rise: :func:`warehouse.decode.positions_unique`)."""
    if txn.applied(spark, path):
        return HistoryResult(0, True)
    one_file = events is not None and events <= frame.ONE_TASK_ROWS
    rows = rows.select(*table_columns(columns, pk))
    if not unique:
        if one_file:
            # One task de-duplicates and sorts it: a single partition satisfies the
            # de-duplication's distribution, so no shuffle (a Spark job of its own) comes first.
            rows = rows.coalesce(1)
        rows = rows.dropDuplicates(list(POSITION))
    if lsn_range is None:
        bounds = rows.agg(F.min("pg_commit_lsn").alias("lo"), F.max("pg_commit_lsn").alias("hi")).first()
        lsn_range = (None, None) if bounds is None else (bounds["lo"], bounds["hi"])
    lo, hi = lsn_range
    if lo is None or hi is None:
        return HistoryResult(0, False)
    if new_table is not None:
        high = None
    else:
        table = spark.read.format("delta").load(path)
        mark = history_high_water(spark, path)
        high = mark.value if mark.known else _max_lsn(table)  # the data decides: ~1 s, after foreign commits
    if high is None or high < int(lo):
        # Every row of this load is past the table's last position: nothing to de-duplicate
        # against (the anti-join's read and join cost ~1 s a table, most loads never need it).
        fresh = rows
    else:
        existing = table.where(F.col("pg_commit_lsn").between(lo, hi)).select(*POSITION)
        fresh = rows.join(existing, list(POSITION), "left_anti")
    if unique and fresh is rows and events is not None:
        # Nothing to de-duplicate, and the partitions already follow the positions: each is
        # sorted where it is and written as a file of its own, side by side, with no shuffle
        # and no task that writes the whole table alone (a 100,000-event table's history
        # took one core 1.7-3.7 s that way).
        files = max(1, min(events // frame.FILE_ROWS, spark.sparkContext.defaultParallelism))
        fresh = fresh.coalesce(files).sortWithinPartitions(*POSITION)
    elif one_file:
        # One task sorts it: a global orderBy first samples its input for the range
        # boundaries, a second run of the whole plan (~0.5 s a table for a few thousand rows).
        fresh = fresh.coalesce(1).sortWithinPartitions(*POSITION)
    else:
        fresh = fresh.orderBy(*POSITION)
    high = int(hi) if high is None else max(high, int(hi))
    if new_table is not None:
        create_table(spark, path, fresh, new_table, txn, {HIGH_WATER_KEY: str(high)})
        return HistoryResult(int(last_commit_metrics(spark, path).get("numOutputRows", 0)), False)
    before = table_version(spark, path)
    (
        fresh.write.format("delta")
        .mode("append")
        .option("userMetadata", txn.user_metadata({HIGH_WATER_KEY: str(high)}))
        .save(path)
    )
    metrics = last_commit_metrics(spark, path, since=before)
    return HistoryResult(int(metrics.get("numOutputRows", 0)), False)


def _max_lsn(table: DataFrame) -> int | None:
    """The table's highest commit LSN, read from its data (when its log cannot say)."""
    row = table.agg(F.max("pg_commit_lsn").alias("hi")).first()
    return None if row is None or row["hi"] is None else int(row["hi"])
