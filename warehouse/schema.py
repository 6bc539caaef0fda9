"""Schema evolution: what the history and current tables look like after a load.

Pure planning (:func:`plan`) is separate from applying it to Delta (:func:`ensure_table`),
so the rules are unit-tested without Spark:

* a new source column is added, nullable, at the end of both tables;
* a column missing from the new events (dropped at the source) stays; its value is null from
  then on;
* a column whose type widens (int -> bigint, real -> double, a decimal with more digits on
  either side of the point, an array's elements so) is widened in both tables with Delta's
  type widening (:func:`warehouse.types.delta_widens`);
* a column whose PostgreSQL type maps to another Spark type Delta cannot widen to fails the
  load of that table with a message saying which column changed from what to what. Nothing
  is written to the table then. Types that map to the same Spark type (varchar -> text) are
  fine, and so are narrower ones (bigint -> int) and decimals that would need fewer digits
  than the column has on one side (the column keeps its type; values it cannot hold are null
  with their text in pg_raw_values). A new column takes a type that holds every version in
  the load;
* a new column whose name clashes, ignoring case, with one of the table's or walbus' own is
  stored under another name (:func:`stored_name`), recorded in :data:`COLUMN_NAMES_PROPERTY`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, StructField, StructType

from warehouse.txn import Txn, hadoop_path, is_delta_table, table_configuration
from warehouse.types import compatible, delta_widens, describe, spark_type, widest

log = logging.getLogger("walbus.warehouse")

# Delta's type widening table feature: ensure_table turns it on when it first widens a column
# (the table's protocol goes to reader 3 / writer 7, which Delta readers from 3.2 on take).
TYPE_WIDENING_PROPERTY = "delta.enableTypeWidening"


class SchemaChangeError(Exception):
    """An incompatible change of a source table's columns."""


@dataclass(frozen=True)
class SourceColumn:
    name: str  # the column's name in the tables: its PostgreSQL name unless that clashes (stored_name)
    pg_type: str
    spark: DataType
    source: str | None = None  # its PostgreSQL name, when the tables store it under another

    @property
    def pg_name(self) -> str:
        """The column's name in the events (PostgreSQL's)."""
        return self.source if self.source is not None else self.name


# A source column stored under another name is stored as STORED_PREFIX + its name, or, when
# that is taken, STORED_PREFIX[:-1] + N + "_" + its name with the smallest N from 2 that is free.
# No column of walbus' own starts so (pg_*, _walbus_deleted, _walbus_prev_<key>).
STORED_PREFIX = "_walbus_col_"
# The table property: {stored name: PostgreSQL name} of the columns stored under another name.
COLUMN_NAMES_PROPERTY = "walbus.columnNames"


def _folds(name: str) -> set[str]:
    """The name's case-insensitive forms. Delta and Spark compare names case-insensitively
    (Java's lower case, and ``equalsIgnoreCase`` char by char); these cover both, and Python's
    case folding, so names that any of them finds equal share a form."""
    return {name.lower(), name.casefold(), "".join(c.upper().lower() for c in name)}


def stored_name(name: str, taken: set[str], reserved: set[str], reserved_prefixes: Iterable[str] = ()) -> str:
    """The name a new source column ``name`` is stored under in the tables: its own, unless
    that is one of ``taken`` (the folded forms of the tables' column names so far, see
    :func:`_folds`) or ``reserved`` (folded names of walbus' own columns), or starts with one of
    ``reserved_prefixes`` (walbus' too: _walbus_prev_<key>, whatever the key) in any case;
    then ``_walbus_col_<name>`` (or ``_walbus_col<N>_<name>``, the first that is free).

    Delta Lake keeps column names case-insensitively, PostgreSQL does not: a table with
    columns ``a`` and ``"A"``, or ``"PG_LSN"`` (walbus' pg_lsn), was refused. Every name is
    checked against ``taken`` (a later source column named like a stored name is stored apart
    in turn), and a stored name is none of walbus' own: names never clash. ``taken`` gets the
    chosen name's forms."""
    forms = _folds(name)
    prefixes = tuple(p.lower() for p in reserved_prefixes)
    own = not (forms & taken or forms & reserved or any(f.startswith(prefixes) for f in forms if prefixes))
    chosen = name
    n = 1
    while not own:
        chosen = STORED_PREFIX + name if n == 1 else f"{STORED_PREFIX[:-1]}{n}_{name}"
        own = not _folds(chosen) & taken
        n += 1
    taken.update(_folds(chosen))
    return chosen


@dataclass(frozen=True)
class SchemaPlan:
    columns: tuple[SourceColumn, ...]  # every source column of the table after this load
    added: tuple[SourceColumn, ...]  # those that the tables lack so far
    widened: tuple[SourceColumn, ...] = ()  # existing columns whose type this load widens


def plan(
    table: str,
    existing: Iterable[SourceColumn] | None,
    incoming: Iterable[tuple[str, str]],
    *,
    reserved: Iterable[str] = (),
    reserved_prefixes: Iterable[str] = (),
    numeric_scale: int,
    latest: Mapping[str, str] | None = None,
) -> SchemaPlan:
    """Merge the tables' current source columns with the (column, pg type) pairs of a load.

    ``incoming`` in the order of the latest event's columns, then any others. ``latest``: the
    latest event's (column, pg type): a column new to the tables whose types within the load
    do not widen takes its latest type (values of the other that it cannot hold are null with
    their text in pg_raw_values). Before, such a load failed for good: a table dropped and
    created again with other types, replayed after its directory was moved away as advised.

    Columns are matched by their PostgreSQL names. A column new to the tables gets its stored
    name (:func:`stored_name`; ``reserved``, ``reserved_prefixes``: walbus' own names), in that order, after
    the existing ones: the same events give the same names, and a column keeps its name.
    """
    existing_cols = {c.pg_name: c for c in existing or ()}
    seen: dict[str, str] = {}
    seen_types: dict[str, DataType] = {}
    settled: set[str] = set()  # took the latest type
    order: list[str] = []
    for name, pg_type in incoming:
        spark = spark_type(pg_type, numeric_scale=numeric_scale)
        if name in seen:
            if name in settled:
                continue
            merged = widest(seen_types[name], spark)
            if merged is None and latest and name in latest and name not in existing_cols:
                seen[name] = latest[name]
                seen_types[name] = spark_type(latest[name], numeric_scale=numeric_scale)
                settled.add(name)
                continue
            if merged is None:
                raise SchemaChangeError(
                    f"{table}: column {name!r} changed type within this load, "
                    f"from {seen[name]} to {pg_type}"
                )
            seen_types[name] = merged
            continue
        seen[name] = pg_type
        seen_types[name] = spark
        order.append(name)
    # Delta Lake keeps column names case-insensitively (PostgreSQL does not): "PG_LSN" clashed
    # with pg_lsn, and "A" with a, as Delta's DELTA_DUPLICATE_COLUMNS_FOUND (a fuzz), then
    # were refused. Such a column is stored under another name (stored_name).
    folded_reserved = {f for n in reserved for f in _folds(n)}
    taken = {f for c in existing_cols.values() for f in _folds(c.name)}
    changes: list[str] = []
    columns = {c.pg_name: c for c in existing_cols.values()}
    added: list[SourceColumn] = []
    widened: list[SourceColumn] = []
    for name in order:
        pg_type = seen[name]
        incoming_type = seen_types[name]
        old = existing_cols.get(name)
        if old is None:
            stored = stored_name(name, taken, folded_reserved, reserved_prefixes)
            col = SourceColumn(stored, pg_type, incoming_type, None if stored == name else name)
            columns[name] = col
            added.append(col)
        elif (wider := widest(old.spark, incoming_type)) is not None and delta_widens(old.spark, wider):
            # int -> bigint, real -> double, more decimal digits: the tables' column is widened
            # (Delta's type widening, ensure_table). Before, the table failed, on every load.
            col = SourceColumn(old.name, pg_type, wider, old.source)
            columns[name] = col
            widened.append(col)
        elif not compatible(old.spark, incoming_type):
            changes.append(
                f"column {name!r} changed type from {describe(old.pg_type, old.spark)} "
                f"to {describe(pg_type, incoming_type)}"
            )
        else:
            columns[name] = SourceColumn(old.name, pg_type, old.spark, old.source)
    if changes:
        raise SchemaChangeError(
            f"{table}: incompatible schema change: {'; '.join(changes)}, which Delta's type widening "
            "cannot make of the column. The table was not loaded; its history and current tables are "
            "unchanged. Move its directory away (the next load creates it from the events since) or "
            "leave it out with --tables."
        )
    return SchemaPlan(tuple(columns.values()), tuple(added), tuple(widened))


def stored_names(columns: Iterable[SourceColumn]) -> dict[str, str]:
    """PostgreSQL name -> the tables' name, of each column."""
    return {c.pg_name: c.name for c in columns}


def column_names_of(properties: Mapping[str, str]) -> dict[str, str]:
    """The table's {stored name: PostgreSQL name} of its columns stored under another name
    (:data:`COLUMN_NAMES_PROPERTY`; a column not in it has its PostgreSQL name)."""
    try:
        names = orjson.loads(properties.get(COLUMN_NAMES_PROPERTY, "{}"))
    except orjson.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


PG_TYPES_PROPERTY = "walbus.pgTypes"
PRIMARY_KEY_PROPERTY = "walbus.primaryKey"


def primary_key_property(pk: Iterable[str]) -> str:
    """The current table's primary key as its property: the names comma-separated, or, when a
    name holds a comma or starts with ``[``, a JSON list (read by :func:`primary_key_of`)."""
    names = list(pk)
    if any("," in n or n.startswith("[") for n in names):
        return orjson.dumps(names).decode()
    return ",".join(names)


def primary_key_of(properties: Mapping[str, str]) -> list[str]:
    """The primary key a current table was written with (none: [])."""
    text = properties.get(PRIMARY_KEY_PROPERTY, "")
    if text.startswith("["):
        try:
            names = orjson.loads(text)
        except orjson.JSONDecodeError:
            names = None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
    return [n for n in text.split(",") if n]


# The history table's primary keys over time: [[lsn, seq, [key…]], …] in position order, each
# the key of the events after position (lsn, seq) ([-1, -1, …]: from the first event). A
# point-in-time view rebuilds the rows under the key they were written with (the current
# table's key applied to events of an earlier one turned a delete, whose identity lacked a
# key column, into nothing: the deleted row was live again; a fuzz).
KEY_CHANGES_PROPERTY = "walbus.primaryKeys"
KeyChange = tuple[tuple[int, int], tuple[str, ...]]  # (after this position, the key)


def key_changes_of(properties: Mapping[str, str]) -> list[KeyChange]:
    """The history table's key changes (:data:`KEY_CHANGES_PROPERTY`; none noted: [])."""
    try:
        entries = orjson.loads(properties.get(KEY_CHANGES_PROPERTY, "[]"))
    except orjson.JSONDecodeError:
        return []
    return [((int(lsn), int(seq)), tuple(pk)) for lsn, seq, pk in entries]


def key_changes_property(changes: Iterable[KeyChange]) -> str:
    return orjson.dumps([[lsn, seq, list(pk)] for (lsn, seq), pk in changes]).decode()


def with_key_changes(
    noted: Sequence[KeyChange], last_under: Mapping[tuple[str, ...], tuple[int, int]], first_lsn: int,
    known: Sequence[str] = (),
) -> list[KeyChange]:
    """``noted`` and the key changes of a load whose events under each key end at
    ``last_under`` (the tally's key_last) and start at commit LSN ``first_lsn``. ``known``:
    the key the table had so far when nothing is noted (a table of an older walbus).

    Each key after another rules the events after the earlier one's last; a key other than
    the table's when the load starts (a change between loads) rules from the load's first
    event on. A load written again adds nothing."""
    changes = list(noted) or ([((-1, -1), tuple(known))] if known else [])
    segments = sorted((last, pk) for pk, last in last_under.items())
    after: tuple[int, int] = (first_lsn, -1)
    for last, pk in segments:
        if not changes:
            changes.append(((-1, -1), pk))
        elif changes[-1][1] != pk and after > changes[-1][0]:
            changes.append((after, pk))
        after = last
    return changes


def existing_columns(fields: Iterable[StructField], properties: Mapping[str, str], meta: set[str]) -> list[SourceColumn]:
    """The source columns of an existing table (its schema minus the metadata columns)."""
    pg_types: dict[str, str] = orjson.loads(properties.get(PG_TYPES_PROPERTY, "{}"))
    sources = column_names_of(properties)
    return [
        SourceColumn(f.name, pg_types.get(f.name, "?"), f.dataType, sources.get(f.name))
        for f in fields if f.name not in meta
    ]


def table_properties(spark: SparkSession, path: str) -> dict[str, str]:
    """The Delta table's properties (walbus's own and Delta's configuration, and the protocol
    versions): from its snapshot, else (py4j trouble) with SHOW TBLPROPERTIES."""
    try:
        return table_configuration(spark, path)
    except Exception:
        rows = spark.sql(f"SHOW TBLPROPERTIES delta.{quote(path)}").collect()
        return {r["key"]: r["value"] for r in rows}


def quote(name: str) -> str:
    """A Spark SQL identifier for any name: backticks, inner backticks doubled."""
    return "`" + name.replace("`", "``") + "`"


def qcol(name: str) -> Column:
    """The column named ``name`` exactly (``F.col`` alone reads dots as struct fields)."""
    return F.col(quote(name))


@dataclass(frozen=True)
class NewTable:
    """A table that does not exist yet, as its first write creates it (:func:`create_table`)."""

    schema: StructType
    properties: Mapping[str, str]


def ensure_table(
    spark: SparkSession,
    path: str,
    meta_fields: Iterable[StructField],
    schema_plan: SchemaPlan,
    properties: Mapping[str, str],
) -> NewTable | None:
    """Add the planned columns to the Delta table and record the pg types; for a table that
    does not exist yet, what its first write (:func:`create_table`) creates it with.

    Each step is its own Delta commit and idempotent, so a crash between two of them is
    repaired by the next load.
    """
    pg_types = {c.name: c.pg_type for c in schema_plan.columns}
    props = {**properties, PG_TYPES_PROPERTY: orjson.dumps(pg_types).decode()}
    renamed = {c.name: c.source for c in schema_plan.columns if c.source is not None}
    if renamed:  # both tables: a reader maps their names back, a load matches the events by it
        props[COLUMN_NAMES_PROPERTY] = orjson.dumps(renamed).decode()
    wanted = [*meta_fields, *(StructField(c.name, c.spark, True) for c in schema_plan.columns)]
    if not is_delta_table(spark, path):
        return NewTable(StructType(wanted), props)
    current = {f.name: f.dataType for f in spark.read.format("delta").load(path).schema.fields}
    # metadata fields too: a table written by an older walbus lacks the newer ones
    missing = [f for f in wanted if f.name not in current]
    if missing:
        cols = ", ".join(f"{quote(f.name)} {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.{quote(path)} ADD COLUMNS ({cols})")
    # a widened source column, and its key's _walbus_prev_ column (each its own commit: a
    # crash between two leaves the rest to the next load, which finds them narrower still)
    widen = [f for f in wanted if f.name in current and delta_widens(current[f.name], f.dataType)]
    old = table_properties(spark, path)
    if widen and old.get(TYPE_WIDENING_PROPERTY) != "true":
        _set_properties(spark, path, {TYPE_WIDENING_PROPERTY: "true"})
    for f in widen:
        column, data_type = quote(f.name), f.dataType
        while isinstance(data_type, ArrayType):  # an array's elements are widened by their path
            column, data_type = f"{column}.element", data_type.elementType
        spark.sql(f"ALTER TABLE delta.{quote(path)} ALTER COLUMN {column} TYPE {data_type.simpleString()}")
        log.warning("column type widened", extra={
            "table": path, "column": f.name, "from": current[f.name].simpleString(), "to": f.dataType.simpleString(),
        })
    old = table_properties(spark, path) if widen else old
    if any(not _property_holds(k, old.get(k), v) for k, v in props.items()):
        _set_properties(spark, path, props)
    return None


def create_table(
    spark: SparkSession, path: str, rows: DataFrame, table: NewTable, txn: Txn, extra: dict[str, str] | None = None
) -> None:
    """Create the table with its first rows in one commit (CREATE TABLE AS SELECT) that names
    the load (``txn``, ``extra`` keys) as every walbus write does.

    Creating it empty and appending were two commits, each with its snapshot update: measured
    on local[2] over 16 tables written 8 at a time, 7.5-9.0 s against 5.1-6.0 s. A CTAS keeps
    its columns' nullability from its query, so the metadata columns are nullable (walbus
    never writes a null in them). ``rows`` holds the table's columns by name."""
    data = rows.select(*[qcol(f.name).cast(f.dataType).alias(f.name) for f in table.schema.fields])
    tagged = txn.tagged_session(spark, extra)  # the commit's userMetadata comes from the session
    if _path_exists(spark, path):
        # Files of a first write that died before its commit: a CTAS refuses a location that
        # is not empty, an append does not (those files are in no commit, so not in the table).
        delta = {k: v for k, v in table.properties.items() if k.startswith("delta.")}
        (
            data.write.format("delta").mode("append").options(**delta)
            .option("userMetadata", txn.user_metadata(extra)).save(path)
        )
        own = {k: v for k, v in table.properties.items() if k not in delta}
        if own:
            _set_properties(tagged, path, own)
        return
    # The query reaches the tagged session as a global temporary view (the session's own
    # temporary views are its own); the name is this call's alone.
    view = f"walbus_new_table_{uuid.uuid4().hex}"
    data.createGlobalTempView(view)
    try:
        views = spark.conf.get("spark.sql.globalTempDatabase", "global_temp") or "global_temp"
        tagged.sql(
            f"CREATE TABLE delta.{quote(path)} USING delta TBLPROPERTIES ({_properties_sql(table.properties)}) "
            f"AS SELECT * FROM {quote(views)}.{quote(view)}"
        )
    finally:
        spark.catalog.dropGlobalTempView(view)


def _properties_sql(properties: Mapping[str, str]) -> str:
    """``'key' = 'value', …`` for a TBLPROPERTIES clause."""
    return ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in properties.items())


def _set_properties(spark: SparkSession, path: str, properties: Mapping[str, str]) -> None:
    spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ({_properties_sql(properties)})")


def _path_exists(spark: SparkSession, path: str) -> bool:
    where = hadoop_path(spark, path)
    return bool(where.getFileSystem(spark._jsc.hadoopConfiguration()).exists(where))


# Protocol versions: a table never goes below what it has (deletion vectors raise a current
# table to reader 3 / writer 7), so asking for less is satisfied, not a change to commit.
_PROTOCOL_PROPERTIES = ("delta.minReaderVersion", "delta.minWriterVersion")


def _property_holds(key: str, have: str | None, want: str) -> bool:
    if key in _PROTOCOL_PROPERTIES and have is not None and have.isdigit() and want.isdigit():
        return int(have) >= int(want)
    return have == want


def sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
