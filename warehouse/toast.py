"""Unchanged TOAST values: fill the columns an update did not send from the row's previous
version, so history and current rows are complete.

Previous version of an event's row = the newest version before it by (commit_lsn, seq),
in this load or in the current table (as it was before this load). Within a key, a run of
updates is a *segment* that starts at an insert, a delete or an update that changed the key
(a "rename"). A value not sent is the newest of:

* the last one sent earlier in its segment in this load;
* the current table's row of that key, when it is older than the event and newer than the
  segment's start (a load may hold a re-sent old insert of a key whose newer versions are
  already in the table: duplicates are whole transactions, re-sent from any point);
* for a segment starting at a rename: the old key's value just before the rename (looked
  up the same way, in the old key's segment and the current table's row of the old key).

A segment without a start in this load takes the current table's row when nothing else is
found.

Known limit: a rename whose old key's segment itself began with a rename in the same load,
with the column unchanged all along, has no value to carry (null; ``pg_unchanged`` names
the column). It needs two key changes of one row, each leaving a TOASTed column unchanged,
in one load.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from warehouse.frame import DELETED, POSITION, prev_name, transient
from warehouse.schema import qcol, quote

_PROBE = transient("probe")
_RENAME = transient("rename")
_SEG = transient("segment")
_SEG_RENAME = transient("segment_rename")
_NEEDS_TABLE = transient("needs_table")
_PROBE_POS = transient("probe_pos")

# Per unchanged column (by its index: names may hold any character), struct<p: position, v>:
# the last value sent in the segment, the current table's, the value at each row, and the
# old key's just before a rename.
def _last_col(i: int) -> str:
    return transient(f"last_{i}")


def _table_col(i: int) -> str:
    return transient(f"table_{i}")


def _val_col(i: int) -> str:
    return transient(f"val_{i}")


def _probe_col(i: int) -> str:
    return transient(f"probe_{i}")


def _last(col: Column, window: object) -> Column:
    return F.last(col, ignorenulls=True).over(window)  # type: ignore[arg-type]


def _pos() -> Column:
    return F.struct(*[F.col(c) for c in POSITION])


def _newest(i: int, *more: Column) -> Column:
    """The newest known value of column ``i`` before the row (struct<p, v>, or null).

    The table's row counts when it is older than the row and newer than the segment's start;
    a segment that does not start in this load falls back on the table's row whatever its age.
    """
    table = F.col(_table_col(i))
    in_segment = F.col(_SEG).isNull() | (table["p"] > F.col(_SEG))
    eligible = F.when(in_segment & (table["p"] < _pos()), table)
    return F.coalesce(F.greatest(F.col(_last_col(i)), eligible, *more), F.when(F.col(_SEG).isNull(), table))


def resolve_unchanged(
    spark: SparkSession,
    rows: DataFrame,
    pk: Sequence[str],
    unchanged: Sequence[str],
    current_path: str | None,
) -> DataFrame:
    """``rows`` (see :func:`warehouse.frame.typed_rows`) with unchanged columns filled."""
    if not unchanged or not pk:
        return rows
    columns = rows.columns
    keys = [qcol(k) for k in pk]
    same_key = F.expr(" AND ".join(f"({quote(k)} <=> {quote(prev_name(k))})" for k in pk))
    is_rename = (F.col("pg_operation") == "update") & ~same_key
    events = rows.withColumn(_PROBE, F.lit(False)).withColumn(_RENAME, is_rename)
    # probes: one per rename, at the rename's position, in the *old* key's partition
    probes = events.where(F.col(_RENAME)).select(
        *[qcol(prev_name(k)).alias(k) for k in pk],
        *POSITION,
        F.lit("probe").alias("pg_operation"),
        F.lit(True).alias(_PROBE),
        F.lit(False).alias(_RENAME),
    )
    both = events.unionByName(probes, allowMissingColumns=True)
    by_key = Window.partitionBy(*keys).orderBy(*POSITION).rowsBetween(Window.unboundedPreceding, Window.currentRow)
    starts = (F.col("pg_operation").isin("insert", "read", "delete") | F.col(_RENAME)) & ~F.col(_PROBE)
    both = both.withColumn(_SEG, _last(F.when(starts, _pos()), by_key)).withColumn(
        _SEG_RENAME, _last(F.when(starts, F.col(_RENAME)), by_key)
    )
    by_segment = Window.partitionBy(*keys, F.col(_SEG)).orderBy(*POSITION).rowsBetween(
        Window.unboundedPreceding, Window.currentRow
    )
    not_sent = [F.coalesce(F.array_contains("pg_unchanged", c), F.lit(False)) for c in unchanged]
    # r: the value's exact text when the column's type cannot hold it (pg_raw_values): carried
    # with it, or a filled value the type cannot hold was lost (null, no text; a fuzz found it)
    for i, c in enumerate(unchanged):
        sent_value = F.when(~F.col(_PROBE) & ~not_sent[i], F.struct(_pos().alias("p"), qcol(c).alias("v"), _raw_text(c)))
        both = both.withColumn(_last_col(i), _last(sent_value, by_segment))
    # the current table's values, for the rows that need a value and the probes
    needs_table = F.col(_PROBE)
    for flag in not_sent:
        needs_table = needs_table | flag
    flagged = both.withColumn(_NEEDS_TABLE, needs_table)
    value_types = [
        f"struct<p: struct<pg_commit_lsn: decimal(20,0), pg_seq: int>, v: {rows.schema[c].dataType.simpleString()}, r: string>"
        for c in unchanged
    ]
    if current_path is not None:
        # A tombstone keeps the deleted row's values: none of them is a live row's (the row of
        # that key inserted since, with no event under this name, took one; a fuzz).
        live = ~F.coalesce(F.col(DELETED), F.lit(False))
        table = spark.read.format("delta").load(current_path).select(
            *keys, *[F.when(live, F.struct(_pos().alias("p"), qcol(c).alias("v"), _raw_text(c))).alias(_table_col(i))
                     for i, c in enumerate(unchanged)]
        )
        looked_up = flagged.where(F.col(_NEEDS_TABLE)).join(table, list(pk), "left")
        rest = flagged.where(~F.col(_NEEDS_TABLE))
        for i in range(len(unchanged)):
            rest = rest.withColumn(_table_col(i), F.lit(None).cast(table.schema[_table_col(i)].dataType))
        flagged = looked_up.unionByName(rest)
    else:
        for i in range(len(unchanged)):
            flagged = flagged.withColumn(_table_col(i), F.lit(None).cast(value_types[i]))
    # value of each column at each row, before renames are followed
    local = flagged
    for i in range(len(unchanged)):
        local = local.withColumn(_val_col(i), _newest(i))
    probe_values = local.where(F.col(_PROBE)).select(
        _pos().alias(_PROBE_POS),
        *[F.col(_val_col(i)).alias(_probe_col(i)) for i in range(len(unchanged))],
    )
    events_done = local.where(~F.col(_PROBE))
    joined = events_done.join(
        probe_values,
        (F.col(_SEG_RENAME) == F.lit(True)) & (F.col(_SEG) == F.col(_PROBE_POS)),
        "left",
    )
    out = joined
    texts = []
    for i, c in enumerate(unchanged):
        from_rename = F.when(F.col(_SEG_RENAME) == F.lit(True), F.col(_probe_col(i)))
        newest = _newest(i, from_rename)
        # columns sent by the event keep their own value (null included)
        out = out.withColumn(c, F.when(~not_sent[i], qcol(c)).otherwise(newest["v"]))
        texts.append(F.struct(F.lit(c).alias("key"), F.when(not_sent[i], newest["r"]).alias("value")))
    filled = F.map_from_entries(F.filter(F.array(*texts), lambda e: e["value"].isNotNull()))
    # (an event's own texts are of the values it sent: never of one it left unchanged)
    raw = F.coalesce(F.col("pg_raw_values"), F.create_map().cast("map<string,string>"))
    merged = F.map_concat(raw, filled)
    # null, as before, when no value needs its text
    out = out.withColumn("pg_raw_values", F.when(F.size(merged) > 0, merged).otherwise(F.col("pg_raw_values")))
    return out.select(*[qcol(c) for c in columns])


def _raw_text(column: str) -> Column:
    return F.col("pg_raw_values")[column].alias("r")
