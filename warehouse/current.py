"""Current-state tables: one row per primary key, the latest version in (commit LSN, seq)
order, maintained by a Delta MERGE of each load's latest version per key.

* LSN guard: a row is only replaced by a strictly later event, so replays and late events
  never move a row back in time.
* Tombstones: a delete (or an update that moved the row to another key) leaves the row in
  place with ``_walbus_deleted = true`` and the delete's position, so an older event that
  arrives in a later load finds a newer row and is ignored: nothing is resurrected.
  Live rows: ``WHERE NOT _walbus_deleted`` (the ``<schema>_<table>`` view of
  ``walbus warehouse sql`` does it).
* TRUNCATE tombstones every row older than it, and its position is kept as the table
  property ``walbus.truncatedAt`` so that events older than a truncate, arriving late, are
  ignored too.
* The MERGE's target side is limited to the key range of the load (on the first key column)
  so Delta skips the files outside it (min/max file statistics); deletion vectors keep
  updates from rewriting whole files.
* No MERGE where no row can match: a table's first load, and a load whose keys all lie past
  every key the table holds (an integer first key column, as serial and identity keys are:
  an insert-only load of such a table). Each walbus write notes the table's highest first
  key in its commit (:data:`KEY_HIGH_WATER_KEY`), so knowing it costs no Spark job; those
  loads append their rows, the same rows the MERGE would insert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StructField

from warehouse import frame
from warehouse.frame import DELETED, META_FIELDS, POSITION, prev_name, transient
from warehouse.schema import (
    NewTable,
    SourceColumn,
    create_table,
    qcol,
    quote,
    sql_string,
    table_properties,
)
from warehouse.txn import (
    HighWater,
    Txn,
    high_water,
    last_commit_metrics,
    never_written,
    table_size_bytes,
    table_version,
)

TRUNCATED_PROPERTY: Final = "walbus.truncatedAt"
CURRENT_EXTRA_FIELDS: Final = (StructField(DELETED, BooleanType(), False),)
CURRENT_PROPERTIES: Final = {
    "delta.enableDeletionVectors": "true",
}
# Deletion vectors spare a MERGE the rewrite of the large files it touches, for a fixed cost
# of their own (measured on local[2]: a 1,600-row table's MERGE of 1,600 changes took 2.6-2.9 s
# with them, 1.3-1.6 s rewriting its file). Below this size the MERGE rewrites (copy-on-write).
COPY_ON_WRITE_BELOW_BYTES: Final = 64 << 20
_MERGE_DV_CONF: Final = "spark.databricks.delta.merge.deletionVectors.persistent"
_ORDERABLE_KEY_TYPES: Final = ("int", "bigint", "smallint", "string", "date", "timestamp", "double", "float")
# The current table's highest first key column value after a walbus write (integer keys),
# in that commit's userMetadata: a load whose keys all lie past it cannot match a row.
KEY_HIGH_WATER_KEY: Final = "walbus.current.maxFirstKey"
_INTEGER_KEY_TYPES: Final = ("tinyint", "smallint", "int", "bigint")


@dataclass(frozen=True)
class CurrentResult:
    inserted: int  # rows of keys new to the table (tombstones of unseen keys included)
    updated: int  # rows replaced by a newer version (tombstoning included)
    deleted: int  # deletes among those, plus rows tombstoned by TRUNCATE
    skipped: bool


def _newer(s: str, t: str) -> str:
    lsn, seq = POSITION
    return f"({s}.{lsn} > {t}.{lsn} OR ({s}.{lsn} = {t}.{lsn} AND {s}.{seq} > {t}.{seq}))"


def truncated_at(properties: dict[str, str]) -> tuple[int, int] | None:
    text = properties.get(TRUNCATED_PROPERTY)
    if not text:
        return None
    lsn, _, seq = text.partition(":")
    return int(lsn), int(seq)


def _after(position: tuple[int, int] | None) -> Column:
    if position is None:
        return F.lit(True)
    lsn, seq = POSITION
    return (F.col(lsn) > F.lit(position[0])) | ((F.col(lsn) == F.lit(position[0])) & (F.col(seq) > F.lit(position[1])))


def latest_actions(
    rows: DataFrame, pk: Sequence[str], columns: Sequence[SourceColumn], *, one_task: bool = False
) -> DataFrame:
    """The last action per key in this load: an upsert or a tombstone.

    An update that changed the key also tombstones its old key, at the same position.
    ``one_task``: found in one task (a single partition needs no shuffle: a Spark job fewer).
    """
    meta = [f.name for f in META_FIELDS]
    source = [c.name for c in columns]
    # A key value the column's type cannot hold is null there and its text is in pg_raw_values
    # (the old key's under its _walbus_prev_ name): such keys are told apart by that text too.
    # Before, every action of such a key was dropped (rows missing from the current table).
    raw_keys = raw_key_columns(rows, pk)
    raw_of = {k: transient(f"raw_key_{i}") for i, k in enumerate(raw_keys)}
    changes = rows.where(F.col("pg_operation") != "truncate")
    upserts = changes.select(
        *meta, *[qcol(c) for c in source], (F.col("pg_operation") == "delete").alias(DELETED),
        *[F.col("pg_raw_values")[k].alias(raw_of[k]) for k in raw_keys],
    )
    same_key = F.expr(" AND ".join(
        [f"({quote(k)} <=> {quote(prev_name(k))})" for k in pk]
        + [f"(pg_raw_values[{sql_string(k)}] <=> pg_raw_values[{sql_string(prev_name(k))}])" for k in raw_keys]
    ))
    old_raws = [(k, F.col("pg_raw_values")[prev_name(k)]) for k in raw_keys]
    old_raw_map = (
        F.map_from_entries(F.array_compact(F.array(*[F.when(v.isNotNull(), F.struct(F.lit(k).alias("k"), v.alias("v"))) for k, v in old_raws])))
        if old_raws else F.col("pg_raw_values")
    )
    moved = changes.where((F.col("pg_operation") == "update") & ~same_key).select(
        *[old_raw_map.alias(c) if c == "pg_raw_values" else F.col(c) for c in meta],
        *[qcol(prev_name(c)).alias(c) if c in pk else F.lit(None).cast(rows.schema[c].dataType).alias(c) for c in source],
        F.lit(True).alias(DELETED),
        *[v.alias(raw_of[k]) for k, v in old_raws],
    )
    known = " AND ".join(
        f"({quote(k)} IS NOT NULL OR {quote(raw_of[k])} IS NOT NULL)" if k in raw_of else f"{quote(k)} IS NOT NULL" for k in pk
    )
    actions = upserts.unionByName(moved).where(known)
    if one_task:
        actions = actions.coalesce(1)  # after the union: its two inputs would be two partitions
    group = [*pk, *raw_of.values()]
    others = [c for c in actions.columns if c not in group]
    # (a name no source column has: a key column named "a" made the reference ambiguous)
    latest = actions.groupBy(*[qcol(k) for k in group]).agg(
        F.max_by(F.struct(*[qcol(c) for c in others]), F.struct(*[F.col(c) for c in POSITION])).alias(_LATEST)
    )
    return latest.select(*[qcol(k) for k in pk], *[F.col(_LATEST)[c].alias(c) for c in others])


def raw_key_columns(rows: DataFrame, pk: Sequence[str]) -> list[str]:
    """The key columns whose type may not hold every value (decimal, date, timestamp, array)."""
    return [k for k in pk if not frame.always_exact(rows.schema[k].dataType)]


def _same_key(pk: Sequence[str], raw_keys: Sequence[str]) -> Column:
    """The MERGE's key match: null-safe, and by the text of values the type cannot hold."""
    cond: Column = F.lit(True)
    for k in pk:
        if k in raw_keys:
            cond = cond & F.col(f"t.{quote(k)}").eqNullSafe(F.col(f"s.{quote(k)}")) & F.col("t.pg_raw_values")[k].eqNullSafe(
                F.col("s.pg_raw_values")[k])
        else:
            cond = cond & (F.col(f"t.{quote(k)}") == F.col(f"s.{quote(k)}"))
    return cond


_LATEST: Final = transient("latest")


def _observed_stats(source: DataFrame, first_key: str) -> tuple[DataFrame, Observation]:
    """``source`` with its first key column's range and its tombstones counted as it is
    computed (:func:`_source_stats` reads them after its first action): no job of their own,
    where an aggregate over the checkpointed source was one or two a table on every load."""
    stats = Observation()
    key = _as_number(qcol(first_key), source.schema[first_key].dataType.simpleString())
    return source.observe(
        stats,
        F.min(key).alias("lo"), F.max(key).alias("hi"), F.count_if(F.col(DELETED)).alias("d"),
        F.count_if(qcol(first_key).isNull()).alias("n"),
    ), stats


def _as_number(column: Column, key_type: str) -> Column:
    """A date or timestamp key as the number Spark keeps (days, microseconds since 1970), so
    its range reaches the driver and comes back without Python's datetime: a timestamp key in
    year 1 failed every load ("year 0 is out of range", converted to the driver's zone), and a
    local zone's repeated DST hour could shift a bound by an hour."""
    if key_type == "timestamp":
        return F.unix_micros(column)
    if key_type == "date":
        return F.unix_date(column)
    return column


def _from_number(value: Any, key_type: str) -> Column:
    if key_type == "timestamp":
        return F.timestamp_micros(F.lit(value))
    if key_type == "date":
        return F.date_from_unix_date(F.lit(value))
    return F.lit(value)


def _source_stats(source: DataFrame, stats: Observation, first_key: str) -> tuple[tuple[Any, Any] | None, int]:
    """(key range of the first key column if orderable, number of tombstones)."""
    row = stats.get
    key_type = source.schema[first_key].dataType.simpleString()
    orderable = key_type in _ORDERABLE_KEY_TYPES or key_type.startswith("decimal")
    # a key only pg_raw_values holds (null in the column) lies in no range: no pruning then
    bounds = (row["lo"], row["hi"]) if orderable and row["lo"] is not None and not row["n"] else None
    return bounds, int(row["d"] or 0)


def merge_current(
    spark: SparkSession,
    path: str,
    rows: DataFrame,
    pk: Sequence[str],
    columns: Sequence[SourceColumn],
    txn: Txn,
    truncate: tuple[int, int] | None,
    new_table: NewTable | None = None,
    events: int | None = None,
) -> CurrentResult:
    """Apply the load's latest action per key (``new_table``: the table does not exist yet;
    this load's write creates it; ``events``: how many rows ``rows`` holds at most, when the
    caller knows)."""
    from delta.tables import DeltaTable

    key_mark: dict[str, str] = {}
    if txn.applied(spark, path):
        inserted = updated = deleted = 0
        skipped = True
    else:
        skipped = False
        floor = None if new_table is not None else truncated_at(table_properties(spark, path))
        if truncate is not None and (floor is None or truncate > floor):
            floor = truncate
        one_task = events is not None and events <= frame.ONE_TASK_ROWS
        latest = latest_actions(rows.where(_after(floor)), pk, columns, one_task=one_task)
        observed, stats = _observed_stats(latest, pk[0])
        source = observed.localCheckpoint()
        cond = _same_key(pk, raw_key_columns(source, pk))
        bounds, deleted = _source_stats(source, stats, pk[0])
        if bounds is not None:
            # a target-only predicate: Delta prunes the files outside the load's key range
            key_type = source.schema[pk[0]].dataType.simpleString()
            cond = cond & F.col(f"t.{quote(pk[0])}").between(_from_number(bounds[0], key_type), _from_number(bounds[1], key_type))
        meta_names = [f.name for f in META_FIELDS]
        all_cols = [*meta_names, *[c.name for c in columns], DELETED]
        tombstone_set: dict[str, str | Column] = {quote(c): f"s.{quote(c)}" for c in [*meta_names, DELETED]}
        full_set: dict[str, str | Column] = {quote(c): f"s.{quote(c)}" for c in all_cols}
        key_mark, past_the_end = _key_high_water(spark, path, source, pk[0], bounds, new=new_table is not None)
        if new_table is not None:
            # the table's first write creates it: every source row is an insert
            create_table(spark, path, source, new_table, txn, key_mark)
            inserted = int(last_commit_metrics(spark, path).get("numOutputRows", 0))
            updated = 0
        # an integer key's mark already says whether the table has rows: no second log read
        elif past_the_end or (not key_mark and never_written(spark, path)):
            # No row to match (a table's first load, or keys past every key it holds): every
            # source row is the MERGE's insert, so an append writes the same rows without the
            # MERGE's join jobs (~1 s a table).
            before = table_version(spark, path)
            (
                source.select(*[qcol(c) for c in all_cols]).write.format("delta").mode("append")
                .option("userMetadata", txn.user_metadata(key_mark)).save(path)
            )
            inserted = int(last_commit_metrics(spark, path, since=before).get("numOutputRows", 0))
            updated = 0
        else:
            session = txn.tagged_session(spark, key_mark)
            size = table_size_bytes(spark, path)
            if size is not None and size < COPY_ON_WRITE_BELOW_BYTES:
                session.conf.set(_MERGE_DV_CONF, "false")
            before = table_version(spark, path)
            (
                DeltaTable.forPath(session, path)
                .alias("t")
                .merge(source.alias("s"), cond)
                # a tombstone keeps the row's last values, with the delete's position
                .whenMatchedUpdate(condition=f"{_newer('s', 't')} AND s.{DELETED}", set=tombstone_set)
                .whenMatchedUpdate(condition=_newer("s", "t"), set=full_set)
                .whenNotMatchedInsert(values=full_set)
                .execute()
            )
            metrics = last_commit_metrics(spark, path, since=before)
            inserted = int(metrics.get("numTargetRowsInserted", 0))
            updated = int(metrics.get("numTargetRowsUpdated", 0))
    if truncate is not None:
        # its UPDATE keeps the keys, and says so: the next load still knows the highest one
        deleted += _apply_truncate(txn.tagged_session(spark, key_mark), path, truncate)
    return CurrentResult(inserted, updated, deleted, skipped)


def _key_high_water(
    spark: SparkSession, path: str, source: DataFrame, first_key: str, bounds: tuple[Any, Any] | None,
    *, new: bool = False,
) -> tuple[dict[str, str], bool]:
    """(the mark this load's write notes, whether every source key lies past the table's
    highest), for an integer first key column; ({}, False) for any other key.

    The table's highest first key comes from its latest walbus commit's mark, or from its data
    (a Spark job) after a commit that added rows without one: another writer's, or an older
    walbus'. A foreign DELETE only lowers the real highest key, so the mark stays a bound.
    ``new``: the table does not exist yet (it holds no key)."""
    if bounds is None or source.schema[first_key].dataType.simpleString() not in _INTEGER_KEY_TYPES:
        return {}, False
    mark: HighWater = HighWater(True, None) if new else high_water(spark, path, KEY_HIGH_WATER_KEY)
    top = mark.value if mark.known else _max_key(spark, path, first_key)
    low, high = int(bounds[0]), int(bounds[1])
    return {KEY_HIGH_WATER_KEY: str(high if top is None else max(top, high))}, top is None or low > top


def _max_key(spark: SparkSession, path: str, column: str) -> int | None:
    row = spark.read.format("delta").load(path).agg(F.max(qcol(column)).alias("hi")).first()
    return None if row is None or row["hi"] is None else int(row["hi"])


def _apply_truncate(spark: SparkSession, path: str, position: tuple[int, int]) -> int:
    """Tombstone every live row older than the TRUNCATE; remember its position. Idempotent."""
    from delta.tables import DeltaTable

    floor = truncated_at(table_properties(spark, path))
    if floor is not None and floor >= position:
        return 0
    lsn, seq = POSITION
    older = (F.col(lsn) < F.lit(position[0])) | ((F.col(lsn) == F.lit(position[0])) & (F.col(seq) < F.lit(position[1])))
    before = table_version(spark, path)
    DeltaTable.forPath(spark, path).update(
        condition=(~F.col(DELETED)) & older,
        set={
            DELETED: F.lit(True),
            lsn: F.lit(position[0]).cast("decimal(20,0)"),
            seq: F.lit(position[1]),
            "pg_operation": F.lit("truncate"),
        },
    )
    metrics = last_commit_metrics(spark, path, since=before)
    value = f"{position[0]}:{position[1]}"
    spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('{TRUNCATED_PROPERTY}' = {sql_string(value)})")
    return int(metrics.get("numUpdatedRows", 0))
