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
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Final

import orjson
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
# Whether the event's position follows the one before it in its task (the first valid one of a
# task: true), and EDGE_FIRST/EDGE_LAST on a task's first and last valid one (see
# positions_unique): a slice whose positions rise through every task, and from task to task,
# holds each position once, and its history append needs no de-duplication.
ORDERED: Final = "_walbus_ordered"
EDGE: Final = "_walbus_edge"
EDGE_FIRST: Final = 1
EDGE_LAST: Final = 2
_POSITION: Final = ("kafka_partition int", "kafka_offset bigint", f"{INVALID} string")
# the record itself, kept only where it is invalid (the quarantine holds its bytes)
_RECORD: Final = ("kafka_key binary", "kafka_value binary")
_MARKS: Final = (f"{ORDERED} boolean", f"{EDGE} tinyint")
EVENT_SCHEMA: Final = ", ".join(
    [*_POSITION, *(f"{quote(name)} {_FIELD_TYPES[name]}" for name in FIELD_ORDER), *_RECORD, *_MARKS]
)
# one event's columns (EVENT_SCHEMA without the record's bytes)
EVENT_COLUMNS: Final = tuple(c.split(" ")[0] for c in (*_POSITION, *FIELD_ORDER, *_MARKS))
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


def _decode_batches(arrow_schema: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow's function: one task's Kafka rows (key, value, partition, offset), in offset
    order -> EVENT_SCHEMA. The batch that holds the latest valid event (and any batches of
    invalid records only after it) goes out when a later batch holds one (or the task's rows
    end), so that the task's last valid event can be marked."""
    import pyarrow as pa

    previous: tuple[int, int] | None = None  # the task's last valid position so far
    held: list[tuple[dict[str, Any], int | None]] = []  # decoded batches, each with its last valid row
    for batch in batches:
        columns, last, previous = _decode_batch(batch, previous)
        if last is not None:
            for done in held:
                yield _arrow_batch(pa, arrow_schema, *done, mark_last=False)
            held = []
        held.append((columns, last))
    for i, done in enumerate(held):
        yield _arrow_batch(pa, arrow_schema, *done, mark_last=i == 0)


def _decode_batch(
    batch: Any, previous: tuple[int, int] | None
) -> tuple[dict[str, Any], int | None, tuple[int, int] | None]:
    """One Arrow batch -> EVENT_SCHEMA's columns (the Kafka position's as the batch's arrays,
    the rest as lists), the index of its last valid row, and the last valid position so far.
    Each record becomes one tuple, and the tuples are turned into columns at the end (a list
    per column appended to field by field cost ~3 times the decoding itself)."""
    keys = batch.column("key").to_pylist()
    values = batch.column("value").to_pylist()
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    last: int | None = None
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        try:
            event = decode_keyed_event_as(key, value, ChangeEvent)
        except ContractError as e:
            append((str(e), *_NO_FIELDS, key, value, None, None))
            continue
        position = (event.commit_lsn, event.seq)
        new, identity, xid = event.new, event.identity, event.xid
        append((
            None,
            # FIELD_ORDER's fields (checked against it below)
            CONTRACT_VERSION, event.lsn, event.commit_lsn, event.seq, xid if xid < _INT64_LIMIT else None,
            event.operation, _table(event.table), event.timestamp, event.pk, event.not_null,
            list(event.typmods.items()),
            None if new is None else new.columns,
            None if new is None else new.types,
            None if new is None else _texts(new.values),
            _image(identity),
            event.unchanged,
            None, None,  # the record's key and value: kept only where it is invalid
            previous is None or position > previous,
            EDGE_FIRST if previous is None else None,
        ))
        previous, last = position, i
    columns = list(zip(*rows, strict=True)) if rows else [()] * _ROW_WIDTH
    out: dict[str, Any] = {"kafka_partition": batch.column("partition"), "kafka_offset": batch.column("offset")}
    out.update(zip(_ROW_NAMES, columns, strict=True))
    return out, last, previous


# the tuple _decode_batch makes of a record: its columns of EVENT_SCHEMA after the position
_ROW_NAMES: Final = (INVALID, *_ROW_FIELDS, "kafka_key", "kafka_value", ORDERED, EDGE)
_ROW_WIDTH: Final = len(_ROW_NAMES)
_NO_FIELDS: Final = (None,) * len(_ROW_FIELDS)
if tuple(FIELD_ORDER) != _ROW_FIELDS:  # a field added to the contract must be added to the row
    raise ImportError(f"warehouse.decode builds {_ROW_FIELDS}, the contract has {FIELD_ORDER}")


def _arrow_batch(pa: Any, arrow_schema: Any, columns: dict[str, Any], last: int | None, *, mark_last: bool) -> Any:
    if mark_last and last is not None:
        edges = list(columns[EDGE])
        edges[last] = (edges[last] or 0) | EDGE_LAST
        columns[EDGE] = edges
    return pa.RecordBatch.from_arrays(
        [c if isinstance(c, pa.Array) else pa.array(c, type=f.type) for c, f in zip(columns.values(), arrow_schema, strict=True)],
        schema=arrow_schema,
    )


def decoded_records(raw: DataFrame) -> DataFrame:
    """Kafka rows -> one row per record (:data:`EVENT_SCHEMA`): its partition and offset,
    :data:`INVALID` (the contract's reason, or null), the event's fields (null where invalid)
    and, where invalid, the record's key and value."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    schema = StructType.fromDDL(EVENT_SCHEMA)
    assert isinstance(schema, StructType)
    decode = functools.partial(_decode_batches, to_arrow_schema(schema))
    return raw.select("key", "value", "partition", "offset").mapInArrow(decode, schema)


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
