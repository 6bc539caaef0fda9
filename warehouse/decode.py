"""Kafka records -> contract-v1 events, checked by the contract's own decoder.

A load's first pass over its slice: Python workers take the records in Arrow batches
(``mapInArrow``) and decode each with :func:`walbus.contract.decode_keyed_event_as`, the
decoder every walbus consumer uses (the compiled one from walbus_native when it is
installed, else msgspec and the reference checks). So a record is valid here exactly when
it is valid to the feed client and the demux, and an invalid record's reason is the
contract's own message: there is no second copy of the contract's rules to keep in step.
(It replaced a check written as Spark expressions, two JSON parses and ~60 rules a record,
which cost more than twice as much on two cores: see docs/warehouse.md, "Stop 43".)

Each value in ``values`` comes out as the text the typed columns read (warehouse.types):
a string as itself, ``true``/``false``, a number as its digits, anything else as its JSON.

The same workers tally the slice as they decode it (:class:`SliceTally`: per table its
events, latest key and columns, schemas, LSN range; per task its edges; the invalid records)
and hand the tallies back with their tasks' results through a Spark accumulator, so the pass
that fills the load's cache is its summary too, with no aggregate over the cache after it.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from pyspark import SparkContext
from pyspark.accumulators import Accumulator, AccumulatorParam
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from walbus.contract import (
    CONTRACT_VERSION,
    FIELD_ORDER,
    ChangeEvent,
    ContractError,
    RowImage,
    decode_keyed_event_as,
    qualify_table,
    split_table,
)
from warehouse.schema import quote

# The Spark types of the contract-v1 fields (walbus.contract.FIELD_ORDER: a field added to
# the contract fails here until it is given a type). ``values`` as each value's text (see
# above): the column's pg type decides how to read it.
_FIELD_TYPES: Final = {
    "v": "int",
    "lsn": "decimal(20,0)",
    "commit_lsn": "decimal(20,0)",
    "seq": "bigint",
    "xid": "bigint",
    "operation": "string",
    "table": "string",
    "timestamp": "string",
    "pk": "array<string>",
    "not_null": "array<string>",
    "typmods": "map<string, array<int>>",
    "columns": "array<string>",
    "types": "array<string>",
    "values": "array<string>",
    "identity": "struct<columns: array<string>, types: array<string>, values: array<string>>",
    "unchanged": "array<string>",
}
INVALID: Final = "invalid_reason"  # why a record is not a contract-v1 event; null if it is
_POSITION: Final = ("kafka_partition int", "kafka_offset bigint", f"{INVALID} string")
# the record itself, kept only where it is invalid (the quarantine holds its bytes)
_RECORD: Final = ("kafka_key binary", "kafka_value binary")
EVENT_SCHEMA: Final = ", ".join(
    [*_POSITION, *(f"{quote(name)} {_FIELD_TYPES[name]}" for name in FIELD_ORDER), *_RECORD]
)
# one event's columns (EVENT_SCHEMA without the record's bytes)
EVENT_COLUMNS: Final = tuple(c.split(" ")[0] for c in (*_POSITION, *FIELD_ORDER))
_INT64_LIMIT: Final = 1 << 63  # xid past it has no bigint: null, as the history's pg_txn_id
_ROW_FIELDS: Final = (
    "v", "lsn", "commit_lsn", "seq", "xid", "operation", "table", "timestamp", "pk", "not_null", "typmods",
    "columns", "types", "values", "identity", "unchanged",
)


def _value_text(value: Any) -> str | None:
    """A JSON value as the text the typed columns read: a string as itself, a scalar as JSON
    writes it, a list or object as its JSON."""
    if value is None or type(value) is str:
        return value
    if value is True:
        return "true"
    if value is False:
        return "false"
    if type(value) is int:
        return str(value)
    if type(value) is float:
        return repr(value)  # the shortest text of the same double (Java's parseDouble reads it)
    return orjson.dumps(value).decode()


def _texts(values: tuple[Any, ...]) -> list[str | None]:
    return [v if type(v) is str else str(v) if type(v) is int else _value_text(v) for v in values]


def _image(image: RowImage | None) -> dict[str, Any] | None:
    if image is None:
        return None
    return {"columns": image.columns, "types": image.types, "values": _texts(image.values)}


def _table(name: str) -> str:
    """One spelling of a (schema, table) pair: ``"public"."a b"`` loads as ``public.a b``."""
    return qualify_table(*split_table(name)) if '"' in name else name


Position = tuple[int, int]  # (commit_lsn, seq)
# an event's schema as the summary keeps it: its columns, their types, its typmods' entries
Schema = tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, tuple[int, ...]], ...]]


@dataclass(slots=True)
class TableTally:
    """One table's events in a task of a load's first pass (or, merged, in the whole slice)."""

    lsn_lo: int  # the lowest and highest commit LSN
    lsn_hi: int
    events: int = 0
    # The latest event with a primary key, and that key: events without one (the key dropped
    # for a while) do not make the load history-only (their table's current table missed the
    # load's keyed changes; a fuzz found it).
    keyed: Position | None = None
    pk: tuple[str, ...] = ()
    # The last event under each primary key: a load spanning a key change keys the current
    # table by the latest one from the last event under another on (job._load_table).
    key_last: dict[tuple[str, ...], Position] = field(default_factory=dict)
    columns_at: Position | None = None  # the latest event with a row image, and its columns
    columns: tuple[str, ...] = ()
    types: tuple[str, ...] = ()  # and their types and typmods (Schema's third part)
    typmods: tuple[tuple[str, tuple[int, ...]], ...] = ()
    truncate: Position | None = None  # the latest TRUNCATE
    schemas: set[Schema] = field(default_factory=set)  # one per table schema the events carry
    unchanged: set[str] = field(default_factory=set)  # columns some update left unchanged (TOAST)

    def merge(self, other: TableTally) -> None:
        self.events += other.events
        if other.keyed is not None and (self.keyed is None or other.keyed > self.keyed):
            self.keyed, self.pk = other.keyed, other.pk
        for key, last in other.key_last.items():
            if last > self.key_last.get(key, last):
                self.key_last[key] = last
            else:
                self.key_last.setdefault(key, last)
        if other.columns_at is not None and (self.columns_at is None or other.columns_at > self.columns_at):
            self.columns_at, self.columns, self.types, self.typmods = other.columns_at, other.columns, other.types, other.typmods
        if other.truncate is not None and (self.truncate is None or other.truncate > self.truncate):
            self.truncate = other.truncate
        self.lsn_lo = min(self.lsn_lo, other.lsn_lo)
        self.lsn_hi = max(self.lsn_hi, other.lsn_hi)
        self.schemas |= other.schemas
        self.unchanged |= other.unchanged


Edge = tuple[int, int, Position]  # (kafka partition, offset, position) of a task's first or last valid event


@dataclass
class TaskTally:
    """What one task's decoder saw: per table its :class:`TableTally`; whether its valid
    events' positions rise through it (``ordered``) and its first and last valid event (see
    :func:`positions_unique`); its invalid records and the first of them."""

    tables: dict[str, TableTally] = field(default_factory=dict)
    ordered: bool = True
    edges: list[Edge] = field(default_factory=list)
    invalid: int = 0
    first_invalid: tuple[int, int, str] | None = None  # (kafka partition, offset, reason)


@dataclass
class SliceSummary:
    """A load's slice, summarised from its tasks' tallies."""

    tables: dict[str, TableTally]
    invalid: int  # records that are not contract-v1 events
    first_invalid: tuple[int, int, str] | None  # the first of them by (kafka partition, offset)
    unique_positions: bool  # the slice holds each position once (positions_unique)


TaskKey = tuple[int, int]  # a task's first record: (kafka partition, offset)
Tallies = dict[str, dict[TaskKey, TaskTally]]  # load token -> its tasks' tallies


class _TalliesParam(AccumulatorParam[Tallies]):
    """Tallies keyed by load and by task: a task that runs again (a retry, a speculative copy,
    a cache block computed again) replaces its own tally instead of adding to it."""

    def zero(self, value: Tallies) -> Tallies:
        return {}

    def addInPlace(self, value1: Tallies, value2: Tallies) -> Tallies:
        for token, tasks in value2.items():
            value1.setdefault(token, {}).update(tasks)
        return value1


_accumulators: weakref.WeakKeyDictionary[SparkContext, Accumulator[Tallies]] = weakref.WeakKeyDictionary()
_active: set[str] = set()  # tokens of the loads under way in this process
_lock = threading.Lock()


class SliceTally:
    """The tallies of one load's first pass: :func:`decoded_records` with it makes each task
    tally what it decodes; after an action has run every task (the pass that fills the
    cache), :meth:`summary` merges them. One accumulator serves every load of a SparkContext
    (pyspark never forgets one), each load under a token of its own."""

    def __init__(self, sc: SparkContext) -> None:
        self.token = uuid.uuid4().hex
        with _lock:
            acc = _accumulators.get(sc)
            if acc is None:
                acc = _accumulators[sc] = sc.accumulator({}, _TalliesParam())
            # a finished load's tasks that ran again after its summary (a cache block computed
            # again) left tallies behind: drop them. (list() takes the keys in one step: the
            # accumulator's update thread may add one meanwhile.)
            for token in list(acc.value):
                if token not in _active:
                    acc.value.pop(token, None)
            _active.add(self.token)
        self.accumulator = acc

    @property
    def handle(self) -> tuple[Accumulator[Tallies], str]:
        """What a decoding task needs to hand its tally back (see :func:`decode_batches`)."""
        return self.accumulator, self.token

    def summary(self) -> SliceSummary:
        """The slice's summary; the tallies are dropped (call once, after the pass)."""
        with _lock:
            tasks = self.accumulator.value.pop(self.token, {})
            _active.discard(self.token)
        return merge_tallies(tasks.values())

    def close(self) -> None:
        """Drop the tallies (a load that fails before :meth:`summary`)."""
        with _lock:
            self.accumulator.value.pop(self.token, None)
            _active.discard(self.token)


def merge_tallies(tasks: Iterable[TaskTally]) -> SliceSummary:
    """The summary of a slice from its tasks' tallies (in any order)."""
    tables: dict[str, TableTally] = {}
    invalid = 0
    first_invalid: tuple[int, int, str] | None = None
    ordered = True
    edges: list[Edge] = []
    for task in tasks:
        for name, tally in task.tables.items():
            if name in tables:
                tables[name].merge(tally)
            else:
                tables[name] = tally
        invalid += task.invalid
        if task.first_invalid is not None and (first_invalid is None or task.first_invalid < first_invalid):
            first_invalid = task.first_invalid
        ordered = ordered and task.ordered
        edges += task.edges
    return SliceSummary(tables, invalid, first_invalid, ordered and positions_unique(edges))


def decode_batches(
    arrow_schema: Any, tally: tuple[Accumulator[Tallies], str] | None, batches: Iterator[Any]
) -> Iterator[Any]:
    """mapInArrow's function: one task's Kafka rows (key, value, partition, offset), in offset
    order -> EVENT_SCHEMA; with ``tally`` (accumulator, load token) the task's
    :class:`TaskTally` is added to the accumulator when its rows end."""
    import pyarrow as pa

    task = TaskTally()
    key: TaskKey | None = None
    previous: Position | None = None  # the task's last valid position so far
    # No cyclic garbage collection while the task decodes. What it makes (each record's tuple,
    # its lists and strings) holds no cycle and reference counting frees it; the collector only
    # walked a batch's thousands of live containers again and again: 55-60% of the decoding's
    # CPU (100,000 events of a 3-int-column table in one process: 1.1 s with it, 0.43 s without).
    collecting = gc.isenabled()
    gc.disable()
    try:
        for batch in batches:
            if key is None and batch.num_rows:
                key = (batch.column("partition")[0].as_py(), batch.column("offset")[0].as_py())
            columns, previous = _decode_batch(batch, previous, task)
            yield pa.RecordBatch.from_arrays(
                [c if isinstance(c, pa.Array) else pa.array(c, type=f.type) for c, f in zip(columns.values(), arrow_schema, strict=True)],
                schema=arrow_schema,
            )
    finally:
        if collecting:
            gc.enable()
    if tally is not None and key is not None:
        accumulator, token = tally
        accumulator.add({token: {key: task}})


def _decode_batch(
    batch: Any, previous: Position | None, task: TaskTally
) -> tuple[dict[str, Any], Position | None]:
    """One Arrow batch -> EVENT_SCHEMA's columns (the Kafka position's as the batch's arrays,
    the rest as lists) and the task's last valid position so far; what it holds is tallied
    into ``task``. Each record becomes one tuple, and the tuples are turned into columns at
    the end (a list per column appended to field by field cost ~3 times the decoding itself)."""
    keys = batch.column("key").to_pylist()
    values = batch.column("value").to_pylist()
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    tables = task.tables
    first: tuple[int, Position] | None = None  # this batch's first valid row: (index, position)
    last = -1  # its last valid row's index
    ordered = task.ordered
    last_t = last_columns = last_types = last_typmods = None  # the schema tallied last (see below)
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        try:
            event = decode_keyed_event_as(key, value, ChangeEvent)
        except ContractError as e:
            reason = str(e)
            found = (batch.column("partition")[i].as_py(), batch.column("offset")[i].as_py(), reason)
            if task.first_invalid is None or found < task.first_invalid:
                task.first_invalid = found
            task.invalid += 1
            append((reason, *_NO_FIELDS, key, value))
            continue
        commit_lsn = event.commit_lsn
        position = (commit_lsn, event.seq)
        new, identity, xid, operation, typmods = event.new, event.identity, event.xid, event.operation, event.typmods
        table = _table(event.table)
        append((
            None,
            # FIELD_ORDER's fields (checked against it below)
            CONTRACT_VERSION, event.lsn, commit_lsn, event.seq, xid if xid < _INT64_LIMIT else None,
            operation, table, event.timestamp, event.pk, event.not_null,
            list(typmods.items()),
            None if new is None else new.columns,
            None if new is None else new.types,
            None if new is None else _texts(new.values),
            _image(identity),
            event.unchanged,
            None, None,  # the record's key and value: kept only where it is invalid
        ))
        # the tally (kept inline: it runs for every event)
        if previous is not None and position <= previous:
            ordered = False
        if first is None:
            first = (i, position)
        previous, last = position, i
        t = tables.get(table)
        if t is None:
            t = tables[table] = TableTally(commit_lsn, commit_lsn)
        t.events += 1
        if event.pk:
            if t.keyed is None or position > t.keyed:
                t.keyed, t.pk = position, event.pk
            if position > t.key_last.get(event.pk, position):
                t.key_last[event.pk] = position
            else:
                t.key_last.setdefault(event.pk, position)
        if commit_lsn < t.lsn_lo:
            t.lsn_lo = commit_lsn
        elif commit_lsn > t.lsn_hi:
            t.lsn_hi = commit_lsn
        image = new if new is not None else identity
        if image is not None:
            columns_, types_ = image.columns, image.types
            if t.columns_at is None or position > t.columns_at:
                t.columns_at, t.columns, t.types = position, columns_, types_
                t.typmods = tuple((c, tuple(m)) for c, m in typmods.items()) if typmods else ()
            # the compiled decoder hands out one tuple per distinct name list: the same objects
            # as the event before are the same schema, already tallied
            if not (t is last_t and columns_ is last_columns and types_ is last_types and typmods is last_typmods):
                t.schemas.add((columns_, types_, tuple((c, tuple(m)) for c, m in typmods.items()) if typmods else ()))
                last_t, last_columns, last_types, last_typmods = t, columns_, types_, typmods
        if operation == "truncate" and (t.truncate is None or position > t.truncate):
            t.truncate = position
        if event.unchanged:
            t.unchanged.update(event.unchanged)
    task.ordered = ordered
    if first is not None and previous is not None:
        partitions, offsets = batch.column("partition"), batch.column("offset")
        if not task.edges:
            task.edges.append((partitions[first[0]].as_py(), offsets[first[0]].as_py(), first[1]))
        edge = (partitions[last].as_py(), offsets[last].as_py(), previous)
        if len(task.edges) == 2:
            task.edges[1] = edge
        elif edge != task.edges[0]:
            task.edges.append(edge)
    columns = list(zip(*rows, strict=True)) if rows else [()] * _ROW_WIDTH
    out: dict[str, Any] = {"kafka_partition": batch.column("partition"), "kafka_offset": batch.column("offset")}
    out.update(zip(_ROW_NAMES, columns, strict=True))
    return out, previous


# the tuple _decode_batch makes of a record: its columns of EVENT_SCHEMA after the position
_ROW_NAMES: Final = (INVALID, *_ROW_FIELDS, "kafka_key", "kafka_value")
_ROW_WIDTH: Final = len(_ROW_NAMES)
_NO_FIELDS: Final = (None,) * len(_ROW_FIELDS)
if tuple(FIELD_ORDER) != _ROW_FIELDS:  # a field added to the contract must be added to the row
    raise ImportError(f"warehouse.decode builds {_ROW_FIELDS}, the contract has {FIELD_ORDER}")


def decoded_records(raw: DataFrame, tally: SliceTally | None = None) -> DataFrame:
    """Kafka rows -> one row per record (:data:`EVENT_SCHEMA`): its partition and offset,
    :data:`INVALID` (the contract's reason, or null), the event's fields (null where invalid)
    and, where invalid, the record's key and value. With ``tally``, each task tallies what it
    decodes (:meth:`SliceTally.summary`)."""
    schema, arrow_schema = event_schemas()
    decode = functools.partial(decode_batches, arrow_schema, None if tally is None else tally.handle)
    return raw.select("key", "value", "partition", "offset").mapInArrow(decode, schema)


def event_schemas() -> tuple[Any, Any]:
    """:data:`EVENT_SCHEMA` as Spark's ``StructType`` and as the Arrow schema of the decoders'
    batches."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    schema = StructType.fromDDL(EVENT_SCHEMA)
    assert isinstance(schema, StructType)
    return schema, to_arrow_schema(schema)


def positions_unique(edges: Iterable[tuple[int, int, tuple[int, int]]]) -> bool:
    """Whether a slice whose tasks each hold rising positions (every valid event's ORDERED is
    true) holds each position once, from its tasks' first and last valid events:
    ``(kafka partition, offset, (commit_lsn, seq))``. Within a Kafka partition the positions
    must rise from task to task in offset order; the Kafka partitions' ranges must not overlap.
    A topic written once, in commit order, always passes; a re-sent transaction does not."""
    by_partition: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for partition, offset, position in edges:
        by_partition.setdefault(partition, []).append((offset, position))
    ranges: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for rows in by_partition.values():
        rows.sort()
        positions = [p for _, p in rows]
        if any(b <= a for a, b in itertools.pairwise(positions)):
            return False
        ranges.append((positions[0], positions[-1]))
    ranges.sort()
    return all(hi < lo for (_, hi), (lo, _) in itertools.pairwise(ranges))


def valid_events(records: DataFrame) -> DataFrame:
    """The events of :func:`decoded_records`' valid records (:data:`EVENT_COLUMNS`)."""
    return records.where(F.col(INVALID).isNull()).select(*[quote(c) for c in EVENT_COLUMNS])


def parse_events(raw: DataFrame) -> DataFrame:
    """Kafka rows -> one row per record, valid or not (:data:`EVENT_COLUMNS`)."""
    return decoded_records(raw).select(*[quote(c) for c in EVENT_COLUMNS])


def invalid_events() -> Column:
    """Rows that are not contract-v1 events."""
    return F.col(INVALID).isNotNull()


def describe_invalid(topic: str, row: Any) -> str:
    return f"record at {topic} partition {row['kafka_partition']} offset {row['kafka_offset']}: {row[INVALID]}"
