"""One load: topic slice -> per table history + current -> load committed.

See :mod:`warehouse.loads` for the commit protocol and :mod:`warehouse.txn` for how each
table's data and its load marker are committed together.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import decimal
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from walbus.contract import ColumnType, NameMatcher, split_table
from walbus.kafka import KafkaOptions
from warehouse import NUMERIC_SCALE, catalog, layout, loads
from warehouse.current import CURRENT_EXTRA_FIELDS, CURRENT_PROPERTIES, merge_current
from warehouse.decode import (
    INVALID,
    Schema,
    SliceSummary,
    SliceTally,
    decoded_records,
    describe_invalid,
    invalid_events,
    valid_events,
)
from warehouse.fetch import Split, fetched_records, slice_splits
from warehouse.frame import (
    DELETED,
    META_FIELDS,
    META_NAMES,
    POSITION,
    PREV_PREFIX,
    prev_fields,
    prev_name,
    typed_rows,
)
from warehouse.history import write_history
from warehouse.read import Offsets, check_no_gap, commit_cut, read_slice, topic_bounds
from warehouse.schema import (
    KEY_CHANGES_PROPERTY,
    PRIMARY_KEY_PROPERTY,
    KeyChange,
    SchemaChangeError,
    SchemaPlan,
    column_names_of,
    ensure_table,
    existing_columns,
    key_changes_of,
    key_changes_property,
    plan,
    primary_key_of,
    primary_key_property,
    quote,
    stored_names,
    table_properties,
    with_key_changes,
)
from warehouse.spark import on_this_host
from warehouse.toast import resolve_unchanged
from warehouse.txn import INTERPRETED_SETTINGS, Txn, is_delta_table

log = logging.getLogger("walbus.warehouse")

# A load of at most this many records evaluates its expressions interpreted, without generated
# code: compiling each query's code (Janino, then the JVM's JIT) costs more than it saves on a
# few thousand rows, and a load of many small tables runs dozens of distinct queries a table.
# Measured (bench.warehouse, local[2]): 2,000 events over 16 tables 33.3 -> 27.2 s, over one
# table 5.3 -> 3.5 s; at 20,000 events neutral on a 3-column table and 20% slower on a
# 16-column one, so the threshold stays well below that.
INTERPRETED_BELOW_RECORDS: Final = 5_000

HISTORY_PROPERTIES = {
    # column mapping lets PostgreSQL column names with spaces or ,;{}()= be Delta columns
    "delta.columnMapping.mode": "name",
    "delta.minReaderVersion": "2",
    "delta.minWriterVersion": "5",
}


class LoadError(Exception):
    """A load that did not complete; the message says what to fix. Nothing is half-written:
    the next run replays the same load."""


SLICE_READERS: Final = ("auto", "workers", "spark")


@dataclass(frozen=True)
class LoadSpec:
    kafka: KafkaOptions
    topic: str
    warehouse: str
    tables: Sequence[str] = ()  # table patterns (walbus.contract.NameMatcher); empty: all
    numeric_scale: int = NUMERIC_SCALE
    skip_invalid: bool = False  # quarantine records that are not contract-v1 events
    parallel_tables: int = 8  # tables written at once (driver threads; their jobs share one FIFO scheduler)
    catalog_database: str | None = None  # register the tables in this catalog database
    # how a load reads its slice: "workers" (the decoding workers fetch it: warehouse.fetch),
    # "spark" (Spark's Kafka source), "auto" (workers when every executor is on this host)
    slice_reader: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "warehouse", layout.absolute_root(self.warehouse))
        if self.slice_reader not in SLICE_READERS:
            raise ValueError(f"slice reader {self.slice_reader!r}: not one of {', '.join(SLICE_READERS)}")


@dataclass
class TableSummary:
    table: str
    events: int = 0
    history_rows: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    history_only: bool = False
    already_loaded: bool = False
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: schema, history, current

    def timed(self, phase: str, started: float) -> None:
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.monotonic() - started, 3)

    def line(self) -> str:
        if self.error:
            return f"{self.table}: FAILED: {self.error}"
        text = f"{self.table}: {self.events} events, history +{self.history_rows}"
        if self.history_only:
            text += ", no primary key: history only"
        else:
            text += f", current {self.inserted} inserted / {self.updated} updated rows ({self.deleted} deletes)"
        if self.already_loaded:
            text += " (this load was already committed before a restart)"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in (None, False, {})}


@dataclass
class LoadResult:
    batches: list[int] = field(default_factory=list)
    events: int = 0
    tables: dict[str, TableSummary] = field(default_factory=dict)
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # read+parse+meta of each load
    quarantined: int = 0  # invalid records written to the quarantine table (--skip-invalid)
    left_out: dict[str, int] = field(default_factory=dict)  # events of tables --tables left out

    def lines(self) -> list[str]:
        if not self.batches:
            return ["no new events"]
        lines = [self.tables[t].line() for t in sorted(self.tables)]
        if self.left_out:
            lines.append(
                f"left out by --tables, and not loaded by a later load either: {sum(self.left_out.values())} events of "
                + ", ".join(f"{t} ({n})" for t, n in sorted(self.left_out.items()))
            )
        if self.quarantined:
            lines.append(f"{self.quarantined} invalid records quarantined in {layout.QUARANTINE_DIR}")
        return lines


def run_load(spark: SparkSession, spec: LoadSpec, result: LoadResult | None = None) -> LoadResult:
    """Load everything from the last committed load to the topic's end offsets now.

    ``result``: filled as the load goes (and returned), so that a caller still has what was
    written when the load fails part way (its metrics count the tables that failed)."""
    started = time.monotonic()
    log_path = layout.loads_path(spec.warehouse, spec.topic)
    last = loads.last_load(spark, log_path)
    bounds = topic_bounds(spec.kafka, spec.topic)
    todo: list[loads.Load] = []
    if last is not None and last.status == "planned":
        check_no_gap(spec.topic, last.start, bounds.earliest)
        todo.append(last)  # the previous run died mid-load: replay it exactly
    if last is None:
        start: Offsets = dict(bounds.earliest)
        next_id = 0
    else:
        start = {p: last.end.get(p, bounds.earliest[p]) for p in bounds.latest}
        next_id = last.batch_id + 1
        check_no_gap(spec.topic, start, bounds.earliest)
    if any(bounds.latest[p] > start[p] for p in bounds.latest):
        end = commit_cut(spec.kafka, spec.topic, start, bounds)
        if any(end[p] > start[p] for p in end):
            todo.append(loads.Load(next_id, "planned", start, end))
    result = LoadResult() if result is None else result
    for load in todo:
        _run_batch(spark, spec, log_path, load, result, replay=load is last)
    result.seconds = time.monotonic() - started
    return result


def _table_meta(summary: SliceSummary) -> list[dict[str, Any]]:
    """Per table of the slice's summary: events, pk, column order (``latest_columns``),
    declared (column, type) pairs, unchanged (TOAST) names, last truncate, LSN range, and
    whether the slice holds each position once (``unique_positions``, the same for every
    table: see :func:`warehouse.decode.positions_unique`).

    The decoders collect each event's (columns, types, typmods) as they are: the distinct
    ones are one per table schema the slice holds (and one per key-only identity), however
    many events, and the declared types (``numeric(12,2)``) are spelled from those few here.
    """
    metas: list[dict[str, Any]] = []
    for table, tally in summary.tables.items():
        metas.append({
            "table": table,
            "events": tally.events,
            "pk": list(tally.pk),
            # the last event under another primary key than the latest (a key change in the load)
            "key_cut": max((last for key, last in tally.key_last.items() if key != tally.pk), default=None),
            # the last event under each key (the history notes the key changes: schema.with_key_changes)
            "key_last": [(list(key), list(last)) for key, last in tally.key_last.items()],
            "latest_columns": list(tally.columns) if tally.columns_at is not None else None,
            "truncate": None if tally.truncate is None else {"commit_lsn": tally.truncate[0], "seq": tally.truncate[1]},
            # Decimal: pg_commit_lsn's type (an LSN past 2**63 has no bigint literal)
            "lsn_lo": decimal.Decimal(tally.lsn_lo),
            "lsn_hi": decimal.Decimal(tally.lsn_hi),
            "pairs": list(dict.fromkeys(pair for s in sorted(tally.schemas) for pair in _declared_pairs(s))),
            "latest_pairs": _declared_pairs((tally.columns, tally.types, tally.typmods)) if tally.columns_at is not None else [],
            "unchanged": sorted(tally.unchanged),
            "unique_positions": summary.unique_positions,
        })
    return metas


def _declared_pairs(schema: Schema) -> list[tuple[str, str]]:
    """An event's (column, declared type) pairs from its columns, types and typmods entries."""
    columns, types, typmods = schema
    modifiers = dict(typmods)
    return [(c, ColumnType(c, t, modifiers.get(c, ())).declared) for c, t in zip(columns, types, strict=False)]


def _run_batch(
    spark: SparkSession,
    spec: LoadSpec,
    log_path: str,
    load: loads.Load,
    result: LoadResult,
    *,
    replay: bool,
) -> None:
    if not replay:
        loads.record(spark, log_path, load)
    log.info("load", extra={"batch": load.batch_id, "start": load.start, "end": load.end, "replay": replay})
    raw: DataFrame | list[Split]
    if _workers_read(spark, spec):
        raw = slice_splits(load.start, load.end, spark.sparkContext.defaultParallelism)
    else:
        raw = read_slice(spark, spec.kafka, spec.topic, load.start, load.end)
    records = sum(max(load.end[p] - load.start.get(p, 0), 0) for p in load.end)
    with interpreted_if_small(spark, records):
        write_slice(spark, spec, raw, Txn(f"walbus:{spec.topic}", load.batch_id, replay), result)
    loads.record(
        spark,
        log_path,
        loads.Load(load.batch_id, "committed", load.start, load.end),
        {t: s.as_dict() for t, s in result.tables.items()},
    )


def _workers_read(spark: SparkSession, spec: LoadSpec) -> bool:
    """Whether the decoding workers fetch the slice themselves (warehouse.fetch)."""
    if spec.slice_reader == "auto":
        return on_this_host(spark.sparkContext.master or "")
    return spec.slice_reader == "workers"


@contextlib.contextmanager
def interpreted_if_small(spark: SparkSession, records: int) -> Iterator[None]:
    """Run the block with generated code off when ``records`` is at most
    INTERPRETED_BELOW_RECORDS (the session's settings are put back after it)."""
    if records > INTERPRETED_BELOW_RECORDS:
        yield
        return
    before: dict[str, str | None] = {key: spark.conf.get(key, None) for key in INTERPRETED_SETTINGS}
    for key, value in INTERPRETED_SETTINGS.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def write_slice(
    spark: SparkSession, spec: LoadSpec, raw: DataFrame | Sequence[Split], txn: Txn, result: LoadResult
) -> None:
    """One slice of the topic into every table, each write tagged with ``txn``: the whole of a
    batch load, and the body of each micro-batch of ``walbus warehouse stream``. ``raw``: the
    slice's Kafka rows (Spark's Kafka source), or its splits, which the decoding workers fetch
    themselves (:mod:`warehouse.fetch`)."""
    tally = SliceTally(spark.sparkContext)
    records: DataFrame | None = None
    try:
        if isinstance(raw, DataFrame):
            decoded = decoded_records(raw, tally)
        else:
            decoded = fetched_records(spark, spec.kafka, spec.topic, raw, tally)
        records = decoded.persist(StorageLevel.MEMORY_AND_DISK)
        started = time.monotonic()
        # One job over every partition at once: reads the slice and decodes it into the
        # cache, its decoders tallying each table and the invalid records as they go. (An
        # aggregate over the cache after it cost 0.3-0.6 s of a warm load of 200,000 records.)
        records.select(F.lit(1)).write.format("noop").mode("overwrite").save()
        summary = tally.summary()
        metas = _table_meta(summary)
        invalid = summary.invalid
        valid = valid_events(records)
        if invalid:
            assert summary.first_invalid is not None
            # The first invalid record by (partition, offset): the same one on every replay.
            bad = dict(zip(("kafka_partition", "kafka_offset", INVALID), summary.first_invalid, strict=True))
            if not spec.skip_invalid:
                raise LoadError(
                    f"{describe_invalid(spec.topic, bad)}: not a walbus contract-v1 event; nothing of "
                    "this load was written (--skip-invalid quarantines such records and loads the rest)"
                )
            result.quarantined += _quarantine(spark, spec, records, txn, bad, invalid)
        metas.sort(key=lambda r: r["table"])
        result.phases["read"] = round(result.phases.get("read", 0.0) + time.monotonic() - started, 3)
        selected = NameMatcher(spec.tables)
        if selected:
            # The load's offsets cover every table: what it leaves out is not loaded later.
            for m in metas:
                if not selected.matches_table(m["table"]):
                    result.left_out[m["table"]] = result.left_out.get(m["table"], 0) + int(m["events"])
            if result.left_out:
                log.warning("tables left out by --tables: their events of this load are skipped for good",
                            extra={"left_out": result.left_out})
            metas = [m for m in metas if selected.matches_table(m["table"])]
        for meta in metas:
            result.tables.setdefault(meta["table"], TableSummary(meta["table"]))
        failures = _load_tables(spark, spec, valid, metas, txn, result.tables)
        if spec.catalog_database is not None:
            _register(spark, spec, metas)
        result.events += sum(int(m["events"]) for m in metas)
        result.batches.append(txn.batch_id)
        if failures:
            raise LoadError(
                "; ".join(f.rstrip(".") for f in failures)
                + ". The other tables of this load are committed; the load itself is not, so "
                "every run replays it until the table is fixed (or left out with --tables)."
            )
    finally:
        tally.close()
        if records is not None:
            records.unpersist()


def _load_tables(
    spark: SparkSession,
    spec: LoadSpec,
    events: DataFrame,
    metas: list[dict[str, Any]],
    txn: Txn,
    summaries: dict[str, TableSummary],
) -> list[str]:
    """Load each table, ``spec.parallel_tables`` at a time: most of a small table's load is
    Spark's and Delta's fixed cost per job and commit, spent waiting on the driver, so many
    tables overlap those waits. Returns the schema-change failures (the other tables load)."""

    def load_one(meta: dict[str, Any]) -> str | None:
        table = meta["table"]
        summary = summaries[table]
        try:
            _load_table(spark, spec, events.where(F.col("table") == table), meta, txn, summary)
        except SchemaChangeError as e:
            summary.error = str(e)
            return str(e)
        return None

    if spec.parallel_tables <= 1 or len(metas) <= 1:
        outcomes = [load_one(m) for m in metas]
    else:
        with concurrent.futures.ThreadPoolExecutor(spec.parallel_tables, thread_name_prefix="walbus-table") as pool:
            outcomes = list(pool.map(load_one, metas))
    return [o for o in outcomes if o is not None]


def _register(spark: SparkSession, spec: LoadSpec, metas: list[dict[str, Any]]) -> None:
    """Name the topic's tables in the catalog, one after the other (the metastore client is
    one connection): the slice's (checked, as they may be new), and any other without its
    names (one listing of the topic's directory and one of the database: a table quiet in the
    loads since the catalog was turned on had none; a fuzz)."""
    from warehouse.views import tables

    database = spec.catalog_database
    assert database is not None
    spark.sql(f"CREATE DATABASE IF NOT EXISTS {quote(database)}")
    named = {str(r["tableName"]) for r in spark.sql(f"SHOW TABLES IN {quote(database)}").collect()}
    loaded = {split_table(m["table"]) for m in metas}
    for pair in sorted(loaded | set(tables(spark, spec.warehouse, spec.topic))):
        paths = layout.table_paths(spec.warehouse, spec.topic, *pair)
        kinds = tuple(
            k for k, p in (("history", paths.history), ("current", paths.current))
            if (pair in loaded or catalog.table_name(*pair, k) not in named) and is_delta_table(spark, p)
        )
        if not kinds:
            continue
        try:
            catalog.register(spark, database, paths, kinds)
        except catalog.CatalogError as e:
            raise LoadError(str(e)) from None


def _quarantine(spark: SparkSession, spec: LoadSpec, records: DataFrame, txn: Txn, first: Any, count: int) -> int:
    """Append the load's ``count`` invalid records (of :func:`decoded_records`) to the topic's
    quarantine table (once per load)."""
    path = layout.quarantine_path(spec.warehouse, spec.topic)
    bad = records.where(invalid_events()).select(
        F.lit(spec.topic).alias("kafka_topic"),
        "kafka_partition",
        "kafka_offset",
        "kafka_key",
        "kafka_value",
        F.col(INVALID).alias("reason"),
        F.lit(txn.batch_id).cast("bigint").alias("load_id"),
        F.current_timestamp().alias("quarantined_at"),
    )
    log.error(
        "invalid records quarantined",
        extra={
            "topic": spec.topic, "batch": txn.batch_id, "records": count, "quarantine": path,
            "first": describe_invalid(spec.topic, first),
        },
    )
    if not txn.applied(spark, path):
        (
            bad.orderBy("kafka_partition", "kafka_offset")
            .write.format("delta")
            .mode("append")
            .option("txnAppId", txn.app_id)
            .option("txnVersion", txn.batch_id)
            .save(path)
        )
    return count


def _incoming_pairs(meta: Any) -> list[tuple[str, str]]:
    latest = list(meta["latest_columns"] or [])
    pairs: list[tuple[str, str]] = list(meta["pairs"] or [])
    rank = {name: i for i, name in enumerate(latest)}
    return sorted(pairs, key=lambda p: (rank.get(p[0], len(rank)), p[0]))


def _load_table(
    spark: SparkSession,
    spec: LoadSpec,
    events: DataFrame,
    meta: Any,
    txn: Txn,
    summary: TableSummary,
) -> None:
    started = time.monotonic()
    table = meta["table"]
    paths = layout.table_paths(spec.warehouse, spec.topic, *split_table(table))
    pk: list[str] = list(meta["pk"] or [])  # the latest keyed event's (see TableTally.pk), PostgreSQL's names
    has_history = is_delta_table(spark, paths.history)
    history_props = table_properties(spark, paths.history) if has_history else {}
    if not pk and is_delta_table(spark, paths.current):
        # Only events without a key in this load (the primary key dropped for a while, only
        # inserts then): the current table goes on under the key it has. Before, such a load
        # was history only, and its rows never reached the current table (a fuzz).
        current_props = table_properties(spark, paths.current)
        sources = column_names_of(current_props)
        pk = [sources.get(k, k) for k in primary_key_of(current_props)]  # the table's names -> PostgreSQL's
    summary.events += int(meta["events"])
    summary.history_only = not pk
    existing = None
    if has_history:
        fields = spark.read.format("delta").load(paths.history).schema.fields
        # the _walbus_prev_ columns of every key the table had too: read as source columns
        # after a key change, an earlier key's went into the rebuilt current table (a fuzz)
        earlier = {k for _, key in key_changes_of(history_props) for k in key}
        stored = {source: name for name, source in column_names_of(history_props).items()}
        meta_names = {*META_NAMES, *(prev_name(k) for k in (*(stored.get(k, k) for k in pk), *earlier))}
        existing = existing_columns(fields, history_props, meta_names)
    elif is_delta_table(spark, paths.current):
        # a history moved away alone: the current table's columns keep their names
        fields = spark.read.format("delta").load(paths.current).schema.fields
        existing = existing_columns(fields, table_properties(spark, paths.current), {*META_NAMES, DELETED})
    schema_plan: SchemaPlan = plan(
        table, existing, _incoming_pairs(meta), reserved={*META_NAMES, DELETED},
        reserved_prefixes=(PREV_PREFIX,), numeric_scale=spec.numeric_scale,
        latest=dict(meta["latest_pairs"] or []),
    )
    # From here on every column is named as the tables name it (see warehouse.frame)
    names = stored_names(schema_plan.columns)
    if pk:
        _check_primary_key(spark, table, paths.current, [names.get(k, k) for k in pk])
        missing = [k for k in pk if k not in names]
        if missing:
            raise SchemaChangeError(f"{table}: primary-key column(s) {missing} missing from the events")
        pk = [names[k] for k in pk]
    key_changes = _key_changes(spark, paths, history_props, meta, names) if pk else []
    history_meta = [*META_FIELDS, *prev_fields(schema_plan.columns, pk)]
    # a table that does not exist yet is created by its first write (one commit, not two)
    # the key changes are noted before the rows are written: a replay notes the same ones again
    history_properties = {**HISTORY_PROPERTIES, **({KEY_CHANGES_PROPERTY: key_changes_property(key_changes)} if key_changes else {})}
    new_history = ensure_table(spark, paths.history, history_meta, schema_plan, history_properties)
    new_current = None
    if pk:
        new_current = ensure_table(
            spark,
            paths.current,
            [*META_FIELDS, *CURRENT_EXTRA_FIELDS],
            schema_plan,
            {**HISTORY_PROPERTIES, **CURRENT_PROPERTIES, PRIMARY_KEY_PROPERTY: primary_key_property(pk)},
        )
    summary.timed("schema", started)
    columns = list(schema_plan.columns)
    rows = typed_rows(events, columns, pk)
    unchanged = [names[c] for c in (meta["unchanged"] or []) if c in names and names[c] not in pk]
    if pk and unchanged:
        rows = resolve_unchanged(spark, rows, pk, unchanged, paths.current if new_current is None else None)
    rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        started = time.monotonic()
        history = write_history(
            spark, paths.history, rows, columns, pk, txn, (meta["lsn_lo"], meta["lsn_hi"]), int(meta["events"]),
            new_history,
            # the rows keep the slice's partitions in offset order unless the TOAST fill joined them
            unique=bool(meta.get("unique_positions")) and not (pk and unchanged),
        )
        summary.timed("history", started)
        summary.history_rows += history.written
        summary.already_loaded = history.skipped
        if pk:
            truncate = meta["truncate"]
            position = (int(truncate["commit_lsn"]), int(truncate["seq"])) if truncate is not None else None
            started = time.monotonic()
            current_rows = rows
            if meta["key_cut"] is not None:
                # The primary key changed inside this load: the events under the earlier key are
                # not rows under this one (merged by it, a deleted row came back under a key it
                # never had; a fuzz). The current table takes the events since, as a current
                # table rebuilt from the change on would (the change across loads: see
                # _check_primary_key); history keeps every event.
                lsn, seq = (int(x) for x in meta["key_cut"])
                at = F.lit(decimal.Decimal(lsn))  # pg_commit_lsn is decimal(20,0): past 2**63 no bigint
                log.warning("primary key changed within this load: the current table takes the changes since",
                            extra={"table": table, "primary_key": pk, "since": f"{lsn:X}/{seq}"})
                after = (F.col(POSITION[0]) > at) | ((F.col(POSITION[0]) == at) & (F.col(POSITION[1]) > seq))
                current_rows = rows.where(after)
            current = merge_current(
                spark, paths.current, current_rows, pk, columns, txn, position, new_current, int(meta["events"])
            )
            summary.timed("current", started)
            summary.inserted += current.inserted
            summary.updated += current.updated
            summary.deleted += current.deleted
            summary.already_loaded = summary.already_loaded and current.skipped
    finally:
        rows.unpersist()


def _key_changes(
    spark: SparkSession, paths: layout.TablePaths, history: dict[str, str], meta: Any, names: dict[str, str]
) -> list[KeyChange]:
    """The history's key changes after this load (:data:`warehouse.schema.KEY_CHANGES_PROPERTY`),
    in the tables' column names (``names``: PostgreSQL's -> the tables')."""
    noted = key_changes_of(history)
    known: list[str] = []
    if not noted and history and is_delta_table(spark, paths.current):
        known = primary_key_of(table_properties(spark, paths.current))  # a history of an older walbus
    last_under = {
        tuple(names.get(k, k) for k in key): (int(last[0]), int(last[1])) for key, last in meta.get("key_last") or []
    }
    return with_key_changes(noted, last_under, int(meta["lsn_lo"]), known)


def _check_primary_key(spark: SparkSession, table: str, path: str, pk: list[str]) -> None:
    if not is_delta_table(spark, path):
        return
    stored = primary_key_of(table_properties(spark, path))
    if stored and stored != pk:
        raise SchemaChangeError(
            f"{table}: primary key changed from {stored} to {pk}; the current table "
            "is keyed on the old one. Move its current/ directory away to rebuild it from now on."
        )


__all__ = ["POSITION", "LoadError", "LoadResult", "LoadSpec", "TableSummary", "run_load"]
