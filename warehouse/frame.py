"""Events of one source table -> typed rows: metadata columns, then the source columns.

Metadata columns (history and current tables alike):

=================  ===============  ===============================================
pg_lsn             decimal(20,0)    LSN of the change's WAL record
pg_commit_lsn      decimal(20,0)    LSN of the transaction's commit
pg_seq             int              position of the change in its transaction
pg_txn_id          bigint           transaction id (xid)
pg_operation       string           insert / update / delete / truncate / read
pg_txn_timestamp   timestamp        commit time (UTC)
pg_unchanged       array<string>    columns not sent (unchanged TOAST): carried over
pg_raw_values      map<str,str>     exact text of values the Spark type cannot hold
=================  ===============  ===============================================

``(pg_commit_lsn, pg_seq)`` is an event's position: unique, in commit order.

History tables of a table with a primary key add ``_walbus_prev_<key>`` per key column (see
:func:`prev_fields`); the current table has ``_walbus_deleted`` instead.

Source columns are the tables' (:attr:`~warehouse.schema.SourceColumn.name`: a column whose
PostgreSQL name clashes is stored under another, :func:`warehouse.schema.stored_name`); so
are the key names given here, the ``_walbus_prev_`` columns', ``pg_unchanged``'s entries
and ``pg_raw_values``' keys. Only the events' values are read by PostgreSQL's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    TimestampType,
)

from warehouse.schema import SourceColumn, qcol
from warehouse.types import convert

LSN_TYPE: Final = DecimalType(20, 0)

META_FIELDS: Final = (
    StructField("pg_lsn", LSN_TYPE, False),
    StructField("pg_commit_lsn", LSN_TYPE, False),
    StructField("pg_seq", IntegerType(), False),
    StructField("pg_txn_id", LongType(), True),
    StructField("pg_operation", StringType(), False),
    StructField("pg_txn_timestamp", TimestampType(), True),
    StructField("pg_unchanged", ArrayType(StringType(), True), True),
    StructField("pg_raw_values", MapType(StringType(), StringType(), True), True),
)
META_NAMES: Final = frozenset(f.name for f in META_FIELDS)
# A table's load of at most this many events is handled in one task: its history rows are
# de-duplicated and sorted, and its latest action per key found, with no shuffle before
# (each a Spark job of its own), and its history append is one sorted file.
ONE_TASK_ROWS: Final = 200_000
# A history append with nothing to de-duplicate writes a file per this many rows (at most one
# per core), each sorted in its own task.
FILE_ROWS: Final = 50_000
DELETED: Final = "_walbus_deleted"  # tombstone flag of the current table
POSITION: Final = ("pg_commit_lsn", "pg_seq")
PREV_PREFIX: Final = "_walbus_prev_"  # the row's key before the event (history, and within a load)


def prev_name(key: str) -> str:
    return PREV_PREFIX + key


def prev_fields(columns: Sequence[SourceColumn], pk: Sequence[str]) -> tuple[StructField, ...]:
    """History's ``_walbus_prev_<key>`` columns: the key the row had before the event (the
    new key but on a key-changing update), so that history alone replays the table."""
    types = {c.name: c.spark for c in columns}
    return tuple(StructField(prev_name(k), types[k], True) for k in pk if k in types)


# The start of the name of every column a load adds for a while and drops again: longer than
# PostgreSQL's identifiers (63 bytes), so no source column has such a name. Before stop 49
# they were short (_walbus_probe, _walbus_needs_table): a source column so named failed every
# load or got a wrong value (a warehouse fuzz).
TRANSIENT_PREFIX: Final = "__walbus_transient" + "_" * 46


def transient(name: str) -> str:
    """A working column's name (see TRANSIENT_PREFIX)."""
    return TRANSIENT_PREFIX + name


_NEW: Final = transient("new")  # the event's row image as a map (column -> value text)
_OLD: Final = transient("old")  # its identity as a map
_IN_ORDER: Final = transient("in_order")  # the event's columns are the table's, in order


def _raw(i: int) -> str:
    return transient(f"raw_{i}")


def _old_raw(i: int) -> str:
    return transient(f"old_raw_{i}")


def typed_rows(events: DataFrame, columns: Sequence[SourceColumn], pk: Sequence[str]) -> DataFrame:
    """One row per event with typed source values; deletes carry their identity values.

    With a primary key, ``_walbus_prev_<key>`` columns hold the identity's key values (the
    row's old key on an update; equal to the key when the identity has no key columns).

    Three projections, each reading the one before's columns: the two maps, each column's
    value text, then the conversions. Written as one, the optimizer copied each map into
    every expression that read a value (a column's text is read by its conversion, its
    exactness check and ``pg_raw_values``): 16 columns built the maps some 60 times a row
    (100,000 events of a 16-column table: 8.2-8.6 s -> 2.0-3.2 s). A projection whose
    expensive columns are read more than once is not merged into the next one.

    Two shortcuts for the usual row, each giving what the general expression gives:

    * an event whose ``columns`` are the table's, in its order (every insert and update of a
      table whose schema did not change), has its values read by position: no map is built;
    * a row whose values all convert exactly has ``pg_raw_values`` empty without building
      the array of its columns' entries (a higher-order ``filter`` is evaluated element by
      element, interpreted).

    Measured on 100,000 events of a 16-column table (typed rows written to ``noop``, warm,
    3 rounds): 2.67 s of tasks -> 1.75 s.
    """
    is_delete = F.col("operation") == "delete"
    in_order = (
        F.col("columns") == F.array(*[F.lit(c.pg_name) for c in columns]) if columns else F.lit(False)
    )
    maps = events.select(
        "*",
        in_order.alias(_IN_ORDER),
        F.when(~in_order, F.map_from_arrays(F.col("columns"), F.col("values"))).alias(_NEW),
        F.map_from_arrays(F.col("identity.columns"), F.col("identity.values")).alias(_OLD),
    )
    texts: list[Column] = []
    for i, col in enumerate(columns):
        texts.append(
            F.when(is_delete, F.col(_OLD)[col.pg_name])
            .when(F.col(_IN_ORDER), F.col("values")[i])
            .otherwise(F.col(_NEW)[col.pg_name])
            .alias(_raw(i))
        )
        if col.name in pk:
            texts.append(F.col(_OLD)[col.pg_name].alias(_old_raw(i)))
    staged = maps.select(*[F.col(c) for c in events.columns], *texts)
    typed: list[Column] = []
    raw_entries: list[Column] = []
    exacts: list[Column] = []
    prev: list[Column] = []
    for i, col in enumerate(columns):
        raw = F.col(_raw(i))
        value, exact = convert(raw, col.pg_type, col.spark)
        typed.append(value.cast(col.spark).alias(col.name))
        raw_entries.append(F.when(~exact, F.struct(F.lit(col.name).alias("k"), raw.alias("v"))))
        exacts.append(exact)
        if col.name in pk:
            old_raw = F.col(_old_raw(i))
            old_value, old_exact = convert(old_raw, col.pg_type, col.spark)
            # an identity without this key column (REPLICA IDENTITY USING INDEX/NOTHING):
            # the key is taken as unchanged
            prev.append(F.when(old_raw.isNotNull(), old_value.cast(col.spark)).otherwise(value.cast(col.spark)).alias(prev_name(col.name)))
            if not always_exact(col.spark):
                # an old key value the type cannot hold: its text, under the old key's column
                raw_entries.append(F.when(~old_exact, F.struct(F.lit(prev_name(col.name)).alias("k"), old_raw.alias("v"))))
                exacts.append(old_exact)
    no_raw = F.create_map().cast(MapType(StringType(), StringType()))
    raw_map = (
        F.when(_all_of(exacts), no_raw).otherwise(F.map_from_entries(F.array_compact(F.array(*raw_entries))))
        if raw_entries
        else no_raw
    )
    return staged.select(
        F.col("lsn").alias("pg_lsn"),
        F.col("commit_lsn").alias("pg_commit_lsn"),
        F.col("seq").cast("int").alias("pg_seq"),
        F.col("xid").alias("pg_txn_id"),
        F.col("operation").alias("pg_operation"),
        F.col("timestamp").try_cast("timestamp").alias("pg_txn_timestamp"),
        F.coalesce(_stored_names(F.col("unchanged"), columns), F.array().cast("array<string>")).alias("pg_unchanged"),
        raw_map.alias("pg_raw_values"),
        *typed,
        *prev,
    )


def _stored_names(names: Column, columns: Sequence[SourceColumn]) -> Column:
    """An event's array of column names (PostgreSQL's) with the tables' names: pg_unchanged
    names the tables' columns, as pg_raw_values' keys do."""
    renamed = [(c.pg_name, c.name) for c in columns if c.source is not None]
    if not renamed:
        return names
    to_stored = F.create_map(*[F.lit(n) for pair in renamed for n in pair])
    return F.transform(names, lambda n: F.coalesce(to_stored[n], n))


# Spark types that hold every value of the PostgreSQL types mapped to them: a key column of
# another type (decimal, date, timestamp, array) may hold a value only pg_raw_values has.
_ALWAYS_EXACT: Final = (ByteType, ShortType, IntegerType, LongType, StringType, BooleanType, BinaryType, DoubleType, FloatType)


def always_exact(spark_type: DataType) -> bool:
    return isinstance(spark_type, _ALWAYS_EXACT)


def _all_of(conditions: Sequence[Column]) -> Column:
    """The conjunction of ``conditions`` as a balanced tree: a chain of 1,600 ANDs (a table
    of PostgreSQL's most columns) overflowed the JVM's stack in Spark's analysis."""
    level = list(conditions) or [F.lit(True)]
    while len(level) > 1:
        level = [level[i] & level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def table_columns(columns: Sequence[SourceColumn], pk: Sequence[str] = ()) -> list[Column]:
    """The columns of a table, in order; with ``pk`` those of the history (old key included)."""
    names = [f.name for f in META_FIELDS] + [c.name for c in columns] + [f.name for f in prev_fields(columns, pk)]
    return [qcol(n) for n in names]
