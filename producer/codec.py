"""Encode decoded row changes into contract-v1 records, fast.

Both plugin decoders hand over JSON-ready values (``int``, ``float``, ``str``,
``bool``, ``None``) and a :class:`Relation`; this module owns the wire bytes.
The per-relation parts of a value (table, pk, column and type lists) are
serialized once per relation and spliced in, so the hot path serializes only
the values list. Every fragment comes from the contract (:data:`walbus.contract.FIELD_HEADS`
and friends); the output is byte-identical to :func:`walbus.contract.encode_event` (tested),
which remains the reference.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

import orjson

from walbus.contract import (
    BOOL_TYPES,
    CONTRACT_VERSION,
    FIELD_HEADS,
    FLOAT_SPECIALS,
    FLOAT_TYPES,
    IMAGE_HEADS,
    INT_TYPES,
    KEY_FORMAT,
    MASK,
    OPERATION_PARTS,
    VALUE_END,
    NameMatcher,
    qualify_table,
)

log = logging.getLogger("walbus.producer.codec")

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
Key = tuple[Any, ...]  # primary-key values, in key order

# The envelope's head up to the lsn value, and the fragments between the integer fields.
_HEAD = FIELD_HEADS["v"] + str(CONTRACT_VERSION).encode() + FIELD_HEADS["lsn"]
_INTS = _HEAD + b"%d" + FIELD_HEADS["commit_lsn"] + b"%d" + FIELD_HEADS["seq"] + b"%d" + FIELD_HEADS["xid"] + b"%d"


def pg_timestamp_iso(us_since_2000: int) -> str:
    """A commit timestamp (µs since 2000-01-01 UTC) as ISO 8601 with offset and microseconds."""
    return (PG_EPOCH + timedelta(microseconds=us_since_2000)).isoformat(timespec="microseconds")


def iso_from_pg_text(text: str) -> str:
    """PostgreSQL's timestamptz text (``2024-01-02 03:04:05.97269+00``) as UTC ISO 8601."""
    dt = datetime.fromisoformat(text)
    return dt.astimezone(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class CaptureFilter:
    """Debezium-style include/exclude lists: walbus's table and column patterns
    (:class:`walbus.contract.NameMatcher`, docs/contract.md)."""

    tables: tuple[str, ...] = ()
    exclude_tables: tuple[str, ...] = ()
    exclude_columns: tuple[str, ...] = ()
    mask_columns: tuple[str, ...] = ()
    signal_table: str | None = None
    # --key-columns: (table pattern, key columns) in the order given; the first match wins.
    key_columns: tuple[tuple[str, tuple[str, ...]], ...] = ()
    included: NameMatcher = field(init=False, repr=False, compare=False)
    excluded: NameMatcher = field(init=False, repr=False, compare=False)
    excluded_columns: NameMatcher = field(init=False, repr=False, compare=False)
    masked_columns: NameMatcher = field(init=False, repr=False, compare=False)
    key_matchers: tuple[tuple[NameMatcher, tuple[str, ...]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_matchers", tuple((NameMatcher([p]), cols) for p, cols in self.key_columns))
        object.__setattr__(self, "included", NameMatcher(self.tables))
        object.__setattr__(self, "excluded", NameMatcher(self.exclude_tables))
        object.__setattr__(self, "excluded_columns", NameMatcher(self.exclude_columns, parts=3))
        object.__setattr__(self, "masked_columns", NameMatcher(self.mask_columns, parts=3))

    def captures(self, table: str) -> bool:
        """``table``: the event's ``table`` field."""
        if table == self.signal_table:
            return True
        if self.included and not self.included.matches_table(table):
            return False
        return not (self.excluded and self.excluded.matches_table(table))

    def key_for(self, schema: str, table: str) -> tuple[str, ...] | None:
        """The message key columns ``--key-columns`` gives the table (None: its primary key)."""
        for matcher, cols in self.key_matchers:
            if matcher.matches(schema, table):
                return cols
        return None


@dataclass
class Relation:
    """What the codec knows of one table: names, types, keys and its pre-serialized parts."""

    relid: int
    schema: str
    name: str
    columns: list[str]
    types: list[str]
    identity: list[bool]  # replica identity columns (the old key)
    pk: list[str]
    replident: str = "d"  # d(efault) f(ull) n(othing) i(ndex)
    captured: bool = True
    keep: list[int] = field(default_factory=list)
    masked: frozenset[int] = frozenset()
    # pre-serialized parts
    table_part: bytes = b""
    meta_part: bytes = b""  # pk, not_null and typmods: the same on every event of this version
    # The partition key: by table, so per-table order (and with it key changes and truncates,
    # which span keys) survives a multi-partition topic (walbus.kafka.partition_for).
    table_key: bytes = b""
    full_part: bytes = b""  # b'"columns":[…],"types":[…],"values":' for rows with every kept column
    pk_index: list[int] = field(default_factory=list)
    ident_idx: list[int] = field(default_factory=list)
    # b'"identity":{"columns":[…],"types":[…],"values":' of the old key, and of a full old row
    ident_head: bytes = b""
    full_ident_head: bytes = b""
    plain: bool = False  # every column kept, none masked
    converters: list[Any] = field(default_factory=list)  # text to value, per column (prepare)
    kinds: bytes = b""  # the converters' kinds (text_kind), a letter per column, for the native path (prepare)
    # Column metadata (the contract's not_null and typmods), per column; empty: not known.
    not_null: list[bool] = field(default_factory=list)
    modifiers: list[list[int] | None] = field(default_factory=list)
    txn_counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # insert update delete truncate

    @functools.cached_property
    def qualified(self) -> str:
        """The event's ``table`` field: a part with a dot or quote is double-quoted."""
        return qualify_table(self.schema, self.name)

    def prepare(self, capture: CaptureFilter) -> Relation:
        q = self.qualified
        self.captured = capture.captures(q)
        key = capture.key_for(self.schema, self.name)
        if key is not None:
            if all(c in self.columns for c in key):
                self.pk = list(key)
            else:  # checked at start for the tables that existed; a later table or column change lands here
                log.warning(
                    "--key-columns names columns the table lacks: its events keep the table's own primary key",
                    extra={"table": q, "key_columns": list(key), "primary_key": self.pk},
                )
        self.keep = [
            i for i, c in enumerate(self.columns) if not capture.excluded_columns.matches(self.schema, self.name, c)
        ]
        self.masked = frozenset(
            i for i, c in enumerate(self.columns) if capture.masked_columns.matches(self.schema, self.name, c)
        )
        self.table_part = FIELD_HEADS["table"] + orjson.dumps(q)
        self.meta_part = self._meta_part()
        self.table_key = q.encode()
        self.full_part = self._image_head(self.keep)
        self.kinds = b"".join(text_kind(t) for t in self.types)
        self.converters = [text_converter(t) for t in self.types]
        index = {c: i for i, c in enumerate(self.columns)}
        self.pk_index = [index[c] for c in self.pk if c in index]
        kept = set(self.keep)
        self.plain = len(self.keep) == len(self.columns) and not self.masked
        self.ident_idx = [i for i, flag in enumerate(self.identity) if flag and i in kept]
        self.ident_head = FIELD_HEADS["identity"] + self._image_head(self.ident_idx, IMAGE_HEADS)
        self.full_ident_head = FIELD_HEADS["identity"] + self._image_head(self.keep, IMAGE_HEADS)
        return self

    def _meta_part(self) -> bytes:
        """``"pk":[…]`` and, when there are any, the kept columns' ``not_null`` and ``typmods``."""
        part = FIELD_HEADS["pk"] + orjson.dumps(self.pk)
        not_null = [self.columns[i] for i in self.keep if i < len(self.not_null) and self.not_null[i]]
        if not_null:
            part += FIELD_HEADS["not_null"] + orjson.dumps(not_null)
        mods = self.modifiers
        typmods = {self.columns[i]: mods[i] for i in self.keep if i < len(mods) and mods[i] is not None}
        if typmods:
            part += FIELD_HEADS["typmods"] + orjson.dumps(typmods)
        return part

    def _image_head(self, idx: Sequence[int], heads: dict[str, bytes] = FIELD_HEADS) -> bytes:
        """``columns`` and ``types`` of the columns ``idx`` and the head of ``values``."""
        return (
            heads["columns"] + orjson.dumps([self.columns[i] for i in idx])
            + heads["types"] + orjson.dumps([self.types[i] for i in idx])
            + heads["values"]
        )

    def identity_indexes(self) -> list[int]:
        return self.ident_idx

    def run_key(self) -> list[int] | None:
        """The key columns a native change run takes updates and deletes by: the replica
        identity's, unless it is FULL (an old row is the slow path's) or there is none."""
        return self.ident_idx if self.replident != "f" and self.ident_idx else None


# Converters from PostgreSQL's text output to JSON values, by pg_type.typname. Builtins
# where one does the job: a Python wrapper costs a frame per column on the hot path.
def _to_float(raw: bytes) -> float | str:
    text = raw.decode()
    return text if text in FLOAT_SPECIALS else float(text)


def _to_bool(raw: bytes) -> bool:
    return raw == b"t"


def text_kind(typname: str) -> bytes:
    """How a type's text becomes a JSON value, as a letter (the native path takes these):
    i(nt) f(loat) b(ool) t(ext)."""
    if typname in INT_TYPES:
        return b"i"
    if typname in FLOAT_TYPES:
        return b"f"
    if typname in BOOL_TYPES:
        return b"b"
    return b"t"


_CONVERTERS: dict[bytes, Callable[[bytes], Any]] = {b"i": int, b"f": _to_float, b"b": _to_bool, b"t": bytes.decode}


def text_converter(typname: str) -> Callable[[bytes], Any]:
    """The pure-Python converter of :func:`text_kind`'s choice."""
    return _CONVERTERS[text_kind(typname)]


@dataclass(slots=True)
class EncodedEvent:
    """One event's record (``key``, ``value``) with what the producer knew when it wrote it, so
    nobody parses the value again: its relation, operation and row values per relation column."""

    key: bytes
    value: bytes
    partition_key: bytes  # what decides the partition when the topic has several
    relation: Relation
    operation: str
    new: list[Any] | None = None  # the new row, a value per relation column (None: not sent)
    old: list[Any] | None = None  # the old key or row, a value per relation column

    @property
    def table(self) -> str:
        return self.relation.qualified

    def row(self) -> dict[str, Any] | None:
        """The new row's captured columns (raw values: masking is the wire's business)."""
        new, rel = self.new, self.relation
        return None if new is None else {rel.columns[i]: new[i] for i in rel.keep}

    def primary_keys(self) -> list[Key]:
        """The primary keys the change touches: the new row's and the old one's (a key column
        never holds NULL, so a key with a missing value is not one)."""
        idx = self.relation.pk_index
        keys: list[Key] = []
        for image in (self.new, self.old):
            if idx and image is not None:
                key = tuple(image[i] for i in idx)
                if None not in key and key not in keys:
                    keys.append(key)
        return keys



class RunRecords(Protocol):
    """A native run's keys or values (walbus_native.Records): byte strings side by side in one
    buffer, a ``bytes`` made only when one is read; the record batch copies them directly."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> bytes: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def max_len(self) -> int: ...
    def tolist(self) -> list[bytes]: ...


# A native run's (keys, values, new rows, old key rows, operations): see ChangeRun.
ChangeRunParts = tuple[RunRecords, RunRecords, list[list[Any] | None], list[list[Any] | None], bytes]
_RUN_OPERATIONS: Final = {ord("I"): "insert", ord("U"): "update", ord("D"): "delete", ord("R"): "read"}


@dataclass(slots=True)
class ChangeRun:
    """Consecutive changes of one plain relation encoded in one native call: their records
    side by side, without an EncodedEvent each unless somebody needs one (:meth:`events`)."""

    relation: Relation
    partition_key: bytes
    keys: RunRecords
    values: RunRecords
    # Each event's new row, a value per relation column (None: a delete), and old key row as
    # sent (None: none was); both None when the run was encoded without them (``remake``).
    rows: list[list[Any] | None] | None
    olds: list[list[Any] | None] | None
    operations: bytes  # each event's: I(nsert), U(pdate), D(elete) or R(ead: a snapshot row)
    # The native call again, with rows: the records go to Kafka as they are, and the rows are
    # made only for somebody who looks at them (an incremental snapshot's watch, an error).
    remake: Callable[[], ChangeRunParts] | None = None

    def images(self) -> tuple[list[list[Any] | None], list[list[Any] | None]]:
        """The events' new and old rows, made now if the run was encoded without them."""
        if self.rows is None or self.olds is None:
            assert self.remake is not None, "a run without rows and no way to make them"
            made = self.remake()
            if made[0] != self.keys or made[4] != self.operations:
                raise RuntimeError("a change run made again differs from itself")  # never: the call is deterministic
            self.rows, self.olds = made[2], made[3]
        return self.rows, self.olds

    def events(self) -> Iterator[EncodedEvent]:
        """The run as the EncodedEvents :meth:`EventEncoder.encode` would have made."""
        rel, pkey, ops = self.relation, self.partition_key, self.operations
        rows, olds = self.images()
        for i, (key, value, new, old) in enumerate(zip(self.keys, self.values, rows, olds, strict=True)):
            yield EncodedEvent(key, value, pkey, rel, _RUN_OPERATIONS[ops[i]], new, old)

    def counts(self) -> dict[str, int]:
        """Events per operation, in the order the operations first come (as counting them one
        by one would: a transaction's counts keep that order)."""
        ops = self.operations
        return {_RUN_OPERATIONS[letter]: ops.count(letter) for letter in dict.fromkeys(ops)}


_KEY_SEQ = re.fullmatch(r"%0(\d+)X", KEY_FORMAT.partition("-")[2])
if _KEY_SEQ is None:  # the native path writes the seq part as %0<n>X does
    raise TypeError("producer.codec's native keys do not know KEY_FORMAT")
SEQ_HEX_DIGITS: Final = int(_KEY_SEQ[1])


def _literal(fixed: bytes) -> bytes:
    """Fixed bytes inside a %-template (names may hold '%')."""
    return fixed.replace(b"%", b"%%")


class EventEncoder:
    """Turns row changes of one transaction after another into (key, value) records."""

    def __init__(self, *, partitioned: bool = False) -> None:
        self.commit_lsn = 0
        self.xid = 0
        self.seq = 0
        self.partitioned = partitioned  # partition keys cost time: only computed when needed
        self._ts_part = b""
        self._key_template = b""
        self._key_head = b""
        self._row_templates: dict[int, bytes] = {}
        self._insert_parts: dict[int, tuple[bytes, bytes, bytes, bytes]] = {}
        self._change_parts: dict[int, tuple[bytes, bytes, bytes, bytes]] = {}
        self.begin(0, 0, "")

    def begin(self, commit_lsn: int, xid: int, timestamp_iso: str) -> None:
        self.commit_lsn = commit_lsn
        self.xid = xid
        self.seq = 0
        self._ts_part = FIELD_HEADS["timestamp"] + orjson.dumps(timestamp_iso)
        # The key's commit_lsn part is fixed for the transaction: one format argument left.
        head, dash, tail = KEY_FORMAT.partition("-")
        self._key_head = (head % commit_lsn + dash).encode()
        self._key_template = _literal(self._key_head) + tail.encode()
        self._row_templates = {}
        self._insert_parts = {}
        self._change_parts = {}

    def forget(self, relid: int) -> None:
        """A relation was defined anew (a schema change, even inside this transaction): its
        later rows must not reuse the parts cached for its earlier version."""
        self._row_templates.pop(relid, None)
        self._row_templates.pop(-1 - relid, None)
        self._insert_parts.pop(relid, None)
        self._insert_parts.pop(-1 - relid, None)
        self._change_parts.pop(relid, None)

    def insert_parts(self, rel: Relation) -> tuple[bytes, bytes, bytes, bytes]:
        """An insert of plain ``rel`` in this transaction as ``(head, mid, tail, end)``: its value
        is ``head + lsn + mid + seq + tail + values + end`` (numbers in decimal; the native path)."""
        parts = self._insert_parts.get(rel.relid)
        if parts is None:
            parts = self._insert_parts[rel.relid] = self._row_parts(rel, "insert")
        return parts

    def key_parts(self) -> tuple[bytes, int]:
        """The keys of this transaction as ``(head, width)``: a key is ``head`` and then its seq in
        upper-case hex, zero-padded to ``width`` digits (the native path; KEY_FORMAT's form)."""
        return self._key_head, SEQ_HEX_DIGITS

    def read_parts(self, rel: Relation) -> tuple[bytes, bytes, bytes, bytes]:
        """:meth:`insert_parts` of a snapshot row (``operation: "read"``)."""
        parts = self._insert_parts.get(-1 - rel.relid)
        if parts is None:
            parts = self._insert_parts[-1 - rel.relid] = self._row_parts(rel, "read")
        return parts

    def change_parts(self, rel: Relation) -> tuple[bytes, bytes, bytes, bytes]:
        """An update's and a delete's parts of plain ``rel`` (its key as the identity) beside
        :meth:`insert_parts`, as ``(update_tail, delete_tail, identity_head, identity_end)``: an
        update is ``head + lsn + mid + seq + update_tail + values + identity_head + key values
        + identity_end + end``, a delete the same without ``values`` (the native path)."""
        parts = self._change_parts.get(rel.relid)
        if parts is None:
            common = FIELD_HEADS["xid"] + b"%d" % self.xid
            meta = rel.table_part + self._ts_part + rel.meta_part
            parts = self._change_parts[rel.relid] = (
                common + OPERATION_PARTS["update"] + meta + rel.full_part,
                common + OPERATION_PARTS["delete"] + meta,
                rel.ident_head,
                VALUE_END,
            )
        return parts

    def changed_run(
        self, rel: Relation, run: ChangeRunParts, remake: Callable[[], ChangeRunParts] | None = None,
    ) -> ChangeRun:
        """The next ``len(keys)`` events: changes of plain ``rel`` as ``(keys, values, new rows,
        old key rows, operations)``, made from :meth:`key_parts`, :meth:`insert_parts` and
        :meth:`change_parts` with consecutive seqs from this one (the native path). With
        ``remake`` the run came without rows (empty lists) and ``remake`` makes them."""
        keys, values, rows, olds, operations = run
        self.seq += len(keys)
        pkey = rel.table_key if self.partitioned else b""
        if remake is not None:
            return ChangeRun(rel, pkey, keys, values, None, None, operations, remake)
        return ChangeRun(rel, pkey, keys, values, rows, olds, operations)

    def insert(self, rel: Relation, lsn: int, new: list[Any], rendered: bytes | None = None) -> EncodedEvent:
        """The hot path: an insert of a relation with no excluded or masked column.

        ``rendered``: ``orjson.dumps(new)`` made already (by the native path); used only when
        the relation is plain (every value goes out as it is)."""
        return self._whole_row(rel, "insert", lsn, new, rendered)

    def read(self, rel: Relation, lsn: int, new: list[Any]) -> EncodedEvent:
        """A snapshot row (``operation: "read"``): same layout and fast path as an insert."""
        return self._whole_row(rel, "read", lsn, new)

    def _whole_row(
        self, rel: Relation, operation: str, lsn: int, new: list[Any], rendered: bytes | None = None
    ) -> EncodedEvent:
        if not rel.plain:
            return self.encode(rel, operation, lsn, new)
        seq = self.seq
        self.seq = seq + 1
        cache_key = rel.relid if operation == "insert" else -1 - rel.relid
        template = self._row_templates.get(cache_key)
        if template is None:
            template = self._row_templates[cache_key] = self._row_template(rel, operation)
        value = template % (lsn, seq, orjson.dumps(new) if rendered is None else rendered)
        pkey = rel.table_key if self.partitioned else b""
        return EncodedEvent(self._key_template % seq, value, pkey, rel, operation, new)

    def _row_parts(self, rel: Relation, operation: str) -> tuple[bytes, bytes, bytes, bytes]:
        """A whole-row event of ``rel`` in this transaction around its lsn, seq and values."""
        return (
            _HEAD,
            FIELD_HEADS["commit_lsn"] + b"%d" % self.commit_lsn + FIELD_HEADS["seq"],
            FIELD_HEADS["xid"] + b"%d" % self.xid + OPERATION_PARTS[operation] + rel.table_part + self._ts_part
            + rel.meta_part + rel.full_part,
            VALUE_END,
        )

    def _row_template(self, rel: Relation, operation: str) -> bytes:
        """:meth:`_row_parts` as a %-template of (lsn, seq, values)."""
        head, mid, tail, end = self._row_parts(rel, operation)
        return b"".join([_literal(head), b"%d", _literal(mid), b"%d", _literal(tail), b"%b", _literal(end)])

    def encode(
        self,
        rel: Relation,
        operation: str,
        lsn: int,
        new: list[Any] | None,
        *,
        unchanged: Sequence[int] = (),
        absent: Sequence[int] = (),
        old: list[Any] | None = None,
        old_is_full: bool = False,
        old_lacks: Sequence[int] = (),
    ) -> EncodedEvent:
        """One event. ``new``/``old`` hold a value per relation column (old: key columns at least).

        ``unchanged`` are indexes of ``new`` whose value was not sent (TOAST); they are
        filled from a full old row when there is one, else left out and listed. ``old_lacks``:
        columns a full old row did not hold (not filled from it: its None there is no value).
        ``absent`` are columns the change did not have at all (added later): left out.
        """
        seq = self.seq
        self.seq = seq + 1
        parts = [
            _INTS % (lsn, self.commit_lsn, seq, self.xid),
            OPERATION_PARTS[operation],
            rel.table_part,
            self._ts_part,
            rel.meta_part,
        ]
        masked = rel.masked
        unchanged_names: list[str] = []
        if new is not None:
            if unchanged or absent:
                if unchanged and old is not None and old_is_full:
                    for i in unchanged:
                        new[i] = old[i]
                    unchanged = [i for i in unchanged if i in old_lacks] if old_lacks else ()
                missing = set(unchanged) | set(absent)
                idx = [i for i in rel.keep if i not in missing] if missing else rel.keep
                unchanged_names = [rel.columns[i] for i in rel.keep if i in set(unchanged)]
                head = rel.full_part if idx is rel.keep else rel._image_head(idx)
                values = [MASK if i in masked and new[i] is not None else new[i] for i in idx]
            else:
                head = rel.full_part
                if len(rel.keep) == len(new) and not masked:
                    values = new
                else:
                    values = [MASK if i in masked and new[i] is not None else new[i] for i in rel.keep]
            parts.append(head)
            parts.append(orjson.dumps(values))
        if operation in ("update", "delete"):
            ident = self._identity(rel, new, old, old_is_full)
            if ident is not None:
                parts.append(ident)
        if unchanged_names:
            parts.append(FIELD_HEADS["unchanged"] + orjson.dumps(unchanged_names))
        parts.append(VALUE_END)
        pkey = rel.table_key if self.partitioned else b""
        return EncodedEvent(self._key_template % seq, b"".join(parts), pkey, rel, operation, new, old)

    def _identity(self, rel: Relation, new: list[Any] | None, old: list[Any] | None, old_is_full: bool) -> bytes | None:
        src: list[Any] | None
        if old is not None and old_is_full:
            idx, src, head = rel.keep, old, rel.full_ident_head
        else:
            idx, head = rel.identity_indexes(), rel.ident_head
            src = old if old is not None else new
            if not idx or src is None:
                return None
        masked = rel.masked
        values = [MASK if i in masked and src[i] is not None else src[i] for i in idx] if masked else [src[i] for i in idx]
        return head + orjson.dumps(values) + VALUE_END

    def truncate(self, rel: Relation, lsn: int) -> EncodedEvent:
        seq = self.seq
        self.seq = seq + 1
        value = b"".join([
            _INTS % (lsn, self.commit_lsn, seq, self.xid),
            OPERATION_PARTS["truncate"], rel.table_part, self._ts_part, rel.meta_part, VALUE_END,
        ])
        return EncodedEvent(self._key_template % seq, value, rel.table_key, rel, "truncate")
