"""Unchanged TOAST values: fill the columns an update did not send from the row's previous
version, so history and current rows are complete.

Previous version of an event's row = the latest earlier event of the same key in this load,
else the current table's row (as it was before this load). Within a key, a run of updates
is a *segment* that starts at an insert, a delete or an update that changed the key (a
"rename"); a value not sent is the last one sent earlier in its segment, and otherwise:

* segment without a start in this load -> the current table's row of that key;
* segment starting at a rename -> the old key's value just before the rename (looked up
  the same way, in the old key's segment, else the current table's row of the old key).

Known limit: a rename whose old key's segment itself began with a rename in the same load,
with the column unchanged all along, has no value to carry (null; ``pg_unchanged`` names
the column). It needs two key changes of one row, each leaving a TOASTed column unchanged,
in one load.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from warehouse.frame import POSITION, prev_name

_PROBE = "_walbus_probe"
_SEG = "_walbus_segment"
_SEG_RENAME = "_walbus_segment_rename"


def _last(col: Column, window: object) -> Column:
    return F.last(col, ignorenulls=True).over(window)  # type: ignore[arg-type]


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _pos() -> Column:
    return F.struct(*[F.col(c) for c in POSITION])


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
    same_key = F.expr(" AND ".join(f"({_q(k)} <=> {_q(prev_name(k))})" for k in pk))
    is_rename = (F.col("pg_operation") == "update") & ~same_key
    events = rows.withColumn(_PROBE, F.lit(False)).withColumn("_walbus_rename", is_rename)
    # probes: one per rename, at the rename's position, in the *old* key's partition
    probes = events.where(F.col("_walbus_rename")).select(
        *[F.col(prev_name(k)).alias(k) for k in pk],
        *POSITION,
        F.lit("probe").alias("pg_operation"),
        F.lit(True).alias(_PROBE),
        F.lit(False).alias("_walbus_rename"),
    )
    both = events.unionByName(probes, allowMissingColumns=True)
    by_key = Window.partitionBy(*pk).orderBy(*POSITION).rowsBetween(Window.unboundedPreceding, Window.currentRow)
    starts = F.col("pg_operation").isin("insert", "read", "delete") | F.col("_walbus_rename")
    both = both.withColumn(_SEG, _last(F.when(starts & ~F.col(_PROBE), _pos()), by_key)).withColumn(
        _SEG_RENAME, _last(F.when(starts & ~F.col(_PROBE), F.col("_walbus_rename")), by_key)
    )
    by_segment = Window.partitionBy(*pk, _SEG).orderBy(*POSITION).rowsBetween(Window.unboundedPreceding, Window.currentRow)
    for c in unchanged:
        sent = ~F.col(_PROBE) & ~F.coalesce(F.array_contains("pg_unchanged", c), F.lit(False))
        both = both.withColumn(f"_walbus_last_{c}", _last(F.when(sent, F.struct(F.col(c).alias("v"))), by_segment))
    # the current table's values, for segments that do not start in this load
    needs_table = F.lit(False)
    for c in unchanged:
        needs_table = needs_table | (F.col(f"_walbus_last_{c}").isNull() & F.col(_SEG).isNull())
    flagged = both.withColumn("_walbus_needs_table", needs_table)
    if current_path is not None:
        table = spark.read.format("delta").load(current_path).select(
            *pk, *[F.struct(F.col(c).alias("v")).alias(f"_walbus_table_{c}") for c in unchanged]
        )
        wanted = flagged.where("_walbus_needs_table")
        looked_up = wanted.join(table, list(pk), "left")
        rest = flagged.where(~F.col("_walbus_needs_table"))
        for c in unchanged:
            rest = rest.withColumn(f"_walbus_table_{c}", F.lit(None).cast(table.schema[f"_walbus_table_{c}"].dataType))
        flagged = looked_up.unionByName(rest)
    else:
        for c in unchanged:
            flagged = flagged.withColumn(f"_walbus_table_{c}", F.lit(None).cast(f"struct<v: {rows.schema[c].dataType.simpleString()}>"))
    # value of each column at each row, before renames are followed
    local = flagged
    for c in unchanged:
        local = local.withColumn(
            f"_walbus_val_{c}", F.coalesce(F.col(f"_walbus_last_{c}"), F.col(f"_walbus_table_{c}"))
        )
    probe_values = local.where(F.col(_PROBE)).select(
        _pos().alias("_walbus_probe_pos"),
        *[F.col(f"_walbus_val_{c}").alias(f"_walbus_probe_{c}") for c in unchanged],
    )
    events_done = local.where(~F.col(_PROBE))
    joined = events_done.join(
        probe_values,
        (F.col(_SEG_RENAME) == F.lit(True)) & (F.col(_SEG) == F.col("_walbus_probe_pos")),
        "left",
    )
    out = joined
    for c in unchanged:
        value = F.coalesce(
            F.col(f"_walbus_last_{c}"),
            F.when(F.col(_SEG_RENAME) == F.lit(True), F.col(f"_walbus_probe_{c}")),
            F.when(F.col(_SEG).isNull(), F.col(f"_walbus_table_{c}")),
        )
        # columns sent by the event keep their own value (null included)
        sent = ~F.coalesce(F.array_contains("pg_unchanged", c), F.lit(False))
        out = out.withColumn(c, F.when(sent, F.col(c)).otherwise(value["v"]))
    return out.select(*columns)
