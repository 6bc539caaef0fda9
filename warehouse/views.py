"""Temporary SQL views over a warehouse's Delta tables (see :mod:`warehouse.layout`).

With ``as_of`` (a commit LSN) the views show the tables as they were once every transaction
committed at or before it was applied: rebuilt from the history table by the rules the
current table follows (the latest action per key by ``(pg_commit_lsn, pg_seq)``, a
key-changing update removes the old key, TRUNCATE empties), in one aggregation instead of a
``ROW_NUMBER()`` view per table. Tables without a primary key have a history view only.
"""

from __future__ import annotations

from typing import Final

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DataType,
    MapType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from warehouse import layout
from warehouse.current import latest_actions
from warehouse.frame import DELETED, META_NAMES, prev_name, transient
from warehouse.schema import (
    existing_columns,
    key_changes_of,
    primary_key_of,
    qcol,
    quote,
    table_properties,
)
from warehouse.txn import hadoop_path, is_delta_table


def _list_dirs(spark: SparkSession, path: str) -> list[str]:
    """Sub-directory names of ``path`` on any Hadoop filesystem."""
    hpath = hadoop_path(spark, path)
    fs = hpath.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf())
    if not fs.exists(hpath):
        return []
    return sorted(s.getPath().getName() for s in fs.listStatus(hpath) if s.isDirectory())


def tables(spark: SparkSession, warehouse: str, topic: str) -> list[tuple[str, str]]:
    """(schema, table) of each table directory of ``topic`` in ``warehouse`` (one listing)."""
    found = (layout.table_from_dir_name(d) for d in _list_dirs(spark, layout.topic_root(warehouse, topic)))
    return [pair for pair in found if pair is not None]  # None: _walbus_loads, _walbus_quarantine


def topics(spark: SparkSession, warehouse: str) -> list[str]:
    # an escaped topic holds no ".": a directory with one is walbus' own (the catalog's)
    return [layout.unescape_segment(d) for d in _list_dirs(spark, warehouse) if "." not in d]


LONG_MAX: Final = (1 << 63) - 1


def as_of(spark: SparkSession, paths: layout.TablePaths, lsn: int) -> tuple[DataFrame, DataFrame | None]:
    """(history up to commit LSN ``lsn``, the table's rows then with tombstones, or None
    when the table has no primary key).

    Each row is keyed by the primary key its event was written under (the history's
    :data:`~warehouse.schema.KEY_CHANGES_PROPERTY`). As the current table after a key change,
    the rows then are those the events since the last change before ``lsn`` made."""
    history_path = paths.history
    # int(): an Lsn (an int whose text is X/Y) would reach Spark's lit() as that text. LSNs are
    # stored as Spark longs: one from 8000000/0 on is past every stored one, and as a literal
    # it failed the query (a bare Py4JError; a fuzz asked for FFFFFFFF/FFFFFFFF, "the latest").
    bound = min(int(lsn), LONG_MAX)
    history = spark.read.format("delta").load(history_path).where(F.col("pg_commit_lsn") <= F.lit(bound))
    keyed = is_delta_table(spark, paths.current)
    pk = primary_key_of(table_properties(spark, paths.current)) if keyed else []
    if not pk:
        return history, None
    properties = table_properties(spark, history_path)
    changes = key_changes_of(properties) or [((-1, -1), tuple(pk))]
    meta = {*META_NAMES, *(prev_name(k) for _, key in changes for k in key), *(prev_name(k) for k in pk)}
    columns = existing_columns(history.schema.fields, properties, meta)
    # (a name no source column has: a column named "t" made the reference ambiguous)
    last, top = transient("last_truncate"), transient("top")
    position = F.struct(F.col("pg_commit_lsn").alias("l"), F.col("pg_seq").alias("s"))
    bounds = history.agg(
        F.max(F.when(F.col("pg_operation") == "truncate", position)).alias(last), F.max(position).alias(top)
    )
    # The key change in force: the last one some row up to the bound lies past.
    since: Column = F.lit(0)
    for i, (at, _) in enumerate(changes[1:], 1):
        since = F.when(F.col(top) > _position(at), F.lit(i)).otherwise(since)
    epoch = transient("epoch")
    after = history.crossJoin(bounds.select(last, since.alias(epoch))).where(
        F.col(last).isNull() | (position > F.col(last))
    ).drop(last)
    states = []
    for i, (at, key) in enumerate(changes):
        rows = after.where(F.col(epoch) == i)
        if i:
            rows = rows.where(position > _position(at))
        rows = rows.drop(epoch)
        for k in key:
            # an event written under another key has no old value of this one: unchanged
            old = F.coalesce(qcol(prev_name(k)), qcol(k)) if prev_name(k) in rows.columns else qcol(k)
            rows = rows.withColumn(prev_name(k), old)
        states.append(latest_actions(rows, list(key), columns))
    state = states[0]
    for other in states[1:]:
        state = state.unionByName(other)
    return history, state


def _position(at: tuple[int, int]) -> Column:
    return F.struct(F.lit(at[0]).cast("decimal(20,0)").alias("l"), F.lit(at[1]).alias("s"))


def register_views(
    spark: SparkSession, warehouse: str, topic: str | None = None, as_of_lsn: int | None = None
) -> list[str]:
    """Register each table's live-rows, ``_all`` and ``_history`` views (names in
    :mod:`warehouse.layout`) for ``topic`` (default: the only topic), and
    ``_walbus_quarantine`` when the topic has quarantined records; with ``as_of_lsn`` the
    tables as of that commit LSN (see the module doc)."""
    if topic is None:
        found = topics(spark, warehouse)
        if len(found) != 1:
            raise ValueError(f"{warehouse} holds {len(found)} topics {found}: choose one with --topic")
        topic = found[0]
    names: list[str] = []
    quarantine = layout.quarantine_path(warehouse, topic)
    if is_delta_table(spark, quarantine):
        spark.read.format("delta").load(quarantine).createOrReplaceTempView(layout.QUARANTINE_VIEW)
        names.append(layout.QUARANTINE_VIEW)
    for pair in tables(spark, warehouse, topic):
        paths = layout.table_paths(warehouse, topic, *pair)
        if as_of_lsn is not None:
            names += _as_of_views(spark, paths, as_of_lsn)
            continue
        if is_delta_table(spark, paths.history):
            _view(spark.read.format("delta").load(paths.history), paths.view("history"))
            names.append(paths.view("history"))
        if is_delta_table(spark, paths.current):
            current = spark.read.format("delta").load(paths.current)
            _view(current, paths.view("all"))
            _view(current.where(~F.col(DELETED)).drop(DELETED), paths.view(""))
            names += [paths.view("all"), paths.view("")]
    return names


def _as_of_views(spark: SparkSession, paths: layout.TablePaths, lsn: int) -> list[str]:
    if not is_delta_table(spark, paths.history):
        return []
    history, state = as_of(spark, paths, lsn)
    _view(history, paths.view("history"))
    if state is None:
        return [paths.view("history")]
    _view(state, paths.view("all"))
    _view(state.where(~F.col(DELETED)).drop(DELETED), paths.view(""))
    return [paths.view("history"), paths.view("all"), paths.view("")]


def _view(frame: DataFrame, name: str) -> None:
    # the name is parsed as an identifier: quoted, any table's name is one part
    frame.createOrReplaceTempView(quote(name))


def times_as_text(frame: DataFrame) -> DataFrame:
    """``frame`` with its timestamps (in arrays, maps and structs too) as ISO 8601 text in the
    session's time zone, with its offset (walbus' sessions: UTC, ``2024-06-01T12:00:00Z``).
    Collected as they are, PySpark turns them into naive datetimes of the process's local
    zone (17:30 for 12:00 UTC under TZ=Asia/Kolkata), and year 1 into "year 0 is out of
    range" west of Greenwich; Spark writes the text, so neither happens."""
    return frame.select(*[_time_text(qcol(f.name), f.dataType).alias(f.name) for f in frame.schema.fields])


def _time_text(column: Column, data_type: DataType) -> Column:
    if isinstance(data_type, TimestampType):
        fraction = F.regexp_replace(F.date_format(column, ".SSSSSS"), r"\.?0+$", "")
        return F.concat(F.date_format(column, "yyyy-MM-dd'T'HH:mm:ss"), fraction, F.date_format(column, "XXX"))
    if isinstance(data_type, TimestampNTZType):
        return F.regexp_replace(column.cast("string"), " ", "T")
    if not _holds_time(data_type):
        return column
    if isinstance(data_type, ArrayType):
        return F.transform(column, lambda x: _time_text(x, data_type.elementType))
    if isinstance(data_type, MapType):
        values = F.transform_values(column, lambda _, v: _time_text(v, data_type.valueType))
        return F.transform_keys(values, lambda k, _: _time_text(k, data_type.keyType))
    assert isinstance(data_type, StructType)
    return F.when(column.isNotNull(), F.struct(*[
        _time_text(column[f.name], f.dataType).alias(f.name) for f in data_type.fields
    ]))


def _holds_time(data_type: DataType) -> bool:
    if isinstance(data_type, (TimestampType, TimestampNTZType)):
        return True
    if isinstance(data_type, ArrayType):
        return _holds_time(data_type.elementType)
    if isinstance(data_type, MapType):
        return _holds_time(data_type.keyType) or _holds_time(data_type.valueType)
    if isinstance(data_type, StructType):
        return any(_holds_time(f.dataType) for f in data_type.fields)
    return False
