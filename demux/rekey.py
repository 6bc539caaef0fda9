"""Pure re-keying, no I/O: one database-topic event -> the records of the per-table topics.

The caller passes a read-only view of the last-row store and applies the returned state
changes. The output's shape, case by case: docs/demux.md.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal, Protocol

import msgspec
import orjson
from msgspec import UNSET, UnsetType

from walbus.contract import (
    FIELD_BITS,
    KEY_FORMAT,
    OP_CODES,
    TABLE_META_FIELDS,
    ChangeEvent,
    ContractError,
    RowImage,
    check_key,
    decode_event,
    merged_key_values,
    set_table_meta,
    split_table,
    table_topic,
)

# In the last-row store only: the key's row is not known (its last change could not be
# written to its topic, demux.worker); an update that needs its unchanged values is refused.
UNKNOWN_ROW: Final = "__unknown"
META_FIELDS: Final = TABLE_META_FIELDS
_FAST_UPSERT: Final = {op: OP_CODES[op] for op in ("insert", "update", "read")}
_EVENT_KEY: Final = KEY_FORMAT.encode()  # contract.event_key, inlined in the fast path

# Fixed-width types: PostgreSQL never TOASTs them, so a table made only of these can
# never have an unchanged (unsent) value and needs no last-row store.
FIXED_WIDTH_TYPES: Final = frozenset({
    "int2", "int4", "int8", "oid", "float4", "float8", "bool", "date", "time", "timetz", "timestamp",
    "timestamptz", "interval", "uuid", "money", "macaddr", "macaddr8", "pg_lsn", "xid", "xid8", "cid", "tid",
    "point", "char",
})


# (table, topic, key, value or None for a tombstone, needs_state): see Rekeyer.fast.
FastRecord = tuple[str, str, bytes, "bytes | None", bool]

_dumps = orjson.dumps


# The contract's ranges (FIELD_BITS: unsigned). msgspec bounds stop at int64: larger
# values, valid up to 64 bits, simply take the full path.
_Lsn = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["lsn"], 63)) - 1)]
_Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["seq"], 63)) - 1)]
_Xid = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["xid"], 63)) - 1)]


class _FastImage(msgspec.Struct):
    columns: list[str]
    types: list[str]
    values: list[Any]


class _FastEvent(msgspec.Struct):
    """The fields of a common event, typed as decode_event requires them (or stricter).

    UNSET (not None) for absent row fields: decode_event refuses ``"columns": null``,
    and so does the fast path, so that it never accepts what the contract refuses.
    ``pk``, ``columns``, ``types`` and ``unchanged`` stay raw JSON: they repeat from
    event to event of a table, so they are checked once per distinct spelling (see
    _TableShape) rather than decoded into new strings every time. Unknown fields
    are ignored, as by decode_event; a repeated key keeps its last value, as orjson
    does.
    """

    v: Literal[1]
    lsn: _Lsn
    commit_lsn: _Lsn
    seq: _Seq
    xid: _Xid
    operation: str
    table: str
    timestamp: str
    pk: msgspec.Raw
    columns: msgspec.Raw | UnsetType = UNSET
    types: msgspec.Raw | UnsetType = UNSET
    values: list[Any] | UnsetType = UNSET
    identity: _FastImage | None = None
    unchanged: msgspec.Raw | UnsetType = UNSET


@dataclass(slots=True)
class _TableShape:
    """What the fast path checked once of a table's events: their pk/columns/types, byte for byte."""

    pk_raw: msgspec.Raw
    columns_raw: msgspec.Raw
    types_raw: msgspec.Raw
    pk: list[str]
    columns: list[str]
    key_at: tuple[tuple[str, int], ...]  # (primary-key column, its index in columns)
    needs_state: bool
    topic: str


_decode_names = msgspec.json.Decoder(list[str]).decode
_NO_NAMES: Final = msgspec.Raw(b"[]")
# Tables whose event shape is remembered; beyond it the memory starts again (schema churn, junk).
_MAX_SHAPES: Final = 4096

_decode_fast = msgspec.json.Decoder(_FastEvent).decode


class RekeyError(ValueError):
    """The event is valid JSON of contract v1 but cannot be re-keyed (goes to the DLQ)."""


class StateView(Protocol):
    """Read access to the last row per key (rows without metadata fields)."""

    def get(self, table: str, key: bytes) -> dict[str, Any] | None: ...

    def keys(self, table: str) -> Iterable[bytes]: ...

    def find(self, table: str, identity: dict[str, Any]) -> bytes | None:
        """The key of the row holding every value of ``identity`` (None: none known)."""


@dataclass(slots=True)  # not frozen: a frozen dataclass' __init__ costs ~1 µs more per record
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes | None  # None: tombstone
    table: str
    compact: bool = True  # False: the topic of a table without primary key


@dataclass(slots=True)
class Rekeyed:
    table: str = ""
    records: list[OutRecord] = field(default_factory=list)
    # (table, key, value bytes or None for "forget"): the store's new content.
    changes: list[tuple[str, bytes, bytes | None]] = field(default_factory=list)
    # Unchanged TOAST columns whose value was not known: left out of the row.
    unfilled: list[str] = field(default_factory=list)
    no_pk: bool = False
    # The result depends on the table's last rows (TOAST-able columns, truncate):
    # the caller must make sure the store holds the table before trusting it.
    needs_state: bool = False
    truncate: bool = False


def unknown_row(reason: str, value: bytes | None = None) -> bytes:
    """The store's value for a key whose row is unknown (see UNKNOWN_ROW): in its topic, that is.

    ``value``: the row the key holds in the table, which its topic could not take. Its columns
    are kept beside the mark, so that the row stays findable by them (StateStore.find, REPLICA
    IDENTITY USING INDEX): marked with no columns, its delete found no key and tombstoned
    nothing, and the topic kept the row before the one it could not take, for good. The mark
    keeps its values from being used as the row's (``_fill`` refuses them)."""
    row = orjson.loads(value) if value is not None else None
    return orjson.dumps({**row, UNKNOWN_ROW: reason} if isinstance(row, dict) else {UNKNOWN_ROW: reason})


def strip_meta(value: dict[str, Any]) -> dict[str, Any]:
    """A stored output value back to the bare row."""
    for name in META_FIELDS:
        value.pop(name, None)
    return value


def encode_key(values: dict[str, Any]) -> bytes:
    return orjson.dumps(values)


def _key_of(image: RowImage | None, pk: tuple[str, ...], skip: tuple[str, ...] = ()) -> bytes | None:
    """Key bytes from one image, or None when a key column is missing from it."""
    values = image.key_values(pk, skip) if image is not None else None
    return None if values is None else encode_key(values)


def _refuse_lost_key_values(event: ChangeEvent, image: dict[str, Any]) -> None:
    """A key column declared NOT NULL (``not_null``) but null in the event: a value the source
    plugin could not write (wal2json writes float and numeric NaN/±Infinity as null). Keyed
    so, distinct rows would become one key: the event goes to the dead-letter topic."""
    lost = [c for c in event.pk if c in image and image[c] is None and c in event.not_null]
    if lost:
        raise RekeyError(
            f"primary-key column(s) {lost} of {event.table} are NOT NULL but null in the event: a value the source "
            "plugin could not write (wal2json writes NaN and ±Infinity as null); use pgoutput for such keys"
        )


def _merged_key(new: RowImage, identity: RowImage | None, pk: tuple[str, ...], unchanged: tuple[str, ...]) -> bytes | None:
    """Key bytes column by column from the new row, else the identity (a key column's
    unchanged TOAST value is only in the identity)."""
    values = merged_key_values(new, identity, pk, unchanged)
    return None if values is None else encode_key(values)


MOVES_TRACKED: Final = 100_000  # key changes of one transaction remembered (a bound on memory)
MOVE_LEDGERS: Final = 64  # transactions' ledgers kept at once (one per table being re-keyed)


def _same_row(identity: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether ``row`` has every value of the identity (the old row, or its key columns)."""
    return all(c in row and row[c] == v for c, v in identity.items())


class _TxnMoves:
    """The key changes of one table's transaction being re-keyed: which rows moved into which
    keys, and which left them, by the event's seq.

    Under a DEFERRABLE primary key a transaction may move a row onto a key another row still
    holds (UPDATE … SET pos = pos + 1; a swap): the key is unique again only at commit. So a
    row leaving a key must not tombstone it when a row that moved in earlier in the
    transaction is still there (it lost every row but the last of such a shift, found by a
    fuzz). Which row leaves is told by the event's identity (the whole old row under REPLICA
    IDENTITY FULL, which PostgreSQL needs to publish such a table's updates). Recorded once
    per seq: an event re-keyed twice (once more with the store) records nothing new."""

    __slots__ = ("commit_lsn", "into", "last_seq", "out", "partial", "size")

    def __init__(self, commit_lsn: int, *, partial: bool = False) -> None:
        self.commit_lsn = commit_lsn
        # Begun inside the transaction (a partition reopened there): moves made before are
        # not here, their output is in the table's topic (see Rekeyer.resumed_inside).
        self.partial = partial
        self.into: dict[bytes, list[tuple[int, dict[str, Any], bytes]]] = {}
        self.out: dict[bytes, list[tuple[int, dict[str, Any]]]] = {}
        self.last_seq = -1
        self.size = 0

    def occupants(self, key: bytes, before: int) -> list[tuple[dict[str, Any], bytes]]:
        """The rows moved into ``key`` by events before seq ``before`` and still there."""
        rows = [(row, value) for seq, row, value in self.into.get(key, ()) if seq < before]
        for seq, identity in self.out.get(key, ()):
            if seq < before:
                for i, (row, _) in enumerate(rows):
                    if _same_row(identity, row):
                        del rows[i]
                        break
        return rows

    def record(self, seq: int, old_key: bytes, identity: dict[str, Any], new_key: bytes, row: dict[str, Any], value: bytes) -> None:
        if seq <= self.last_seq or self.size >= MOVES_TRACKED:
            return
        self.last_seq = seq
        self.size += 1
        self.out.setdefault(old_key, []).append((seq, identity))
        self.into.setdefault(new_key, []).append((seq, row, value))


class Rekeyer:
    """Turns events into per-table records for one source database."""

    def __init__(self, *, prefix: str, database: str, emit_delete_records: bool = False) -> None:
        self.prefix = prefix
        self.database = database
        self.emit_delete_records = emit_delete_records
        self._topics: dict[str, str] = {}
        self._shapes: dict[str, _TableShape] = {}
        self._moves: dict[str, _TxnMoves] = {}  # per table: its current transaction's key changes
        self._resumed: list[int] = []  # commit LSNs a partition was reopened inside (the last few)

    def resumed_inside(self, commit_lsn: int) -> None:
        """A partition reopened after an event of the transaction committed at ``commit_lsn``:
        its key moves before that are not in any ledger (a restart, a reopen after an aborted
        Kafka transaction). A row leaving a key then asks the store whether a row that moved
        in before is still there (without it, a restart inside a DEFERRABLE shift lost a key;
        found by a fuzz)."""
        if commit_lsn not in self._resumed:
            self._resumed = [*self._resumed[-(MOVE_LEDGERS - 1):], commit_lsn]
        for moves in self._moves.values():
            if moves.commit_lsn == commit_lsn:
                moves.partial = True

    def _moves_of(self, event: ChangeEvent) -> _TxnMoves:
        moves = self._moves.get(event.table)
        if moves is None or moves.commit_lsn != event.commit_lsn:
            self._moves.pop(event.table, None)
            if len(self._moves) >= MOVE_LEDGERS:
                del self._moves[next(iter(self._moves))]  # the oldest: its transaction is long done
            moves = self._moves[event.table] = _TxnMoves(event.commit_lsn, partial=event.commit_lsn in self._resumed)
        return moves

    def topic_for(self, table: str) -> str:
        """The table's topic; ContractError for a malformed name, RekeyError when none can be made."""
        t = self._topics.get(table)
        if t is None:
            try:
                t = table_topic(self.prefix, self.database, *split_table(table))
            except ValueError as e:  # ContractError is one: the name itself is malformed
                if isinstance(e, ContractError):
                    raise
                raise RekeyError(f"no topic name for {table!r}: {e}") from e
            self._topics[table] = t
        return t

    def use_hashed_topic(self, table: str) -> str:
        """From now on the table goes to its hash-suffixed topic (Kafka found its name colliding)."""
        t = self._topics[table] = table_topic(self.prefix, self.database, *split_table(table), hashed=True)
        self._shapes.pop(table, None)  # the shape remembers the topic
        return t

    @staticmethod
    def with_meta(row: dict[str, Any], event: ChangeEvent, op: str) -> dict[str, Any]:
        return set_table_meta(row, op, event.lsn, event.commit_lsn, event.seq, event.xid, event.timestamp)

    def rekey(self, event: ChangeEvent, state: StateView) -> Rekeyed:
        if event.operation == "truncate":
            out = self._truncate(event, state)
        elif event.operation == "delete":
            out = self._delete(event, state)
        else:
            out = self._upsert(event, state)
        out.table = event.table
        return out

    def rekey_value(self, raw: bytes, state: StateView) -> Rekeyed:
        """Re-key one database-topic value; raises ContractError or RekeyError for bad input.

        The common events take :meth:`fast`; everything else, valid or not, goes
        through decode_event and :meth:`rekey`, so errors and rare cases have one
        implementation.
        """
        hit = self.fast(raw)
        if hit is None:
            return self.rekey(decode_event(raw), state)
        return single(hit)

    @staticmethod
    def decode_record(key: bytes | None, raw: bytes | None) -> ChangeEvent:
        """A source record's event; ContractError unless it is one, at the position its key says."""
        if raw is None:
            raise ContractError("record has no value")
        event = decode_event(raw)
        check_key(key, event)
        return event

    def rekey_record(self, key: bytes | None, raw: bytes, state: StateView) -> Rekeyed:
        """:meth:`rekey_value` of a source record: also ContractError unless its key is the event's position."""
        hit = self.fast(raw, key) if key is not None else None
        if hit is None:
            return self.rekey(self.decode_record(key, raw), state)
        return single(hit)

    def fast(self, raw: bytes, key: bytes | None = None) -> FastRecord | None:
        """The one output record of a common event, or None: take :meth:`rekey_value`.

        Common events: insert/read/update of a table with a primary key whose row
        is complete and whose key did not change, and delete by key (without
        ``emit_delete_records``). They are ~all of a database's traffic, so this
        path decodes into a typed struct (msgspec checks the field types in C),
        checks a table's pk/columns/types once per spelling (_TableShape) and
        returns a plain tuple (no ChangeEvent, no Rekeyed). It accepts only what
        decode_event accepts and builds the same bytes as :meth:`rekey`; tests
        compare both on random workloads. A value of None is a tombstone.

        ``key``: the source record's key; None (a record whose key is not the event's
        position in the contract's form, contract.event_key) when it differs.
        """
        try:
            ev = _decode_fast(raw)
        except msgspec.DecodeError:  # not JSON, or not of the struct: the full path says why
            return None
        if key is not None and key != _EVENT_KEY % (ev.commit_lsn, ev.seq):
            return None
        unchanged = ev.unchanged
        if unchanged is not UNSET and unchanged != _NO_NAMES:
            return None
        op = ev.operation
        code = _FAST_UPSERT.get(op)
        if code is None:
            return self._fast_delete(ev) if op == "delete" else None
        values = ev.values
        shape = self._shapes.get(ev.table)
        if shape is None or ev.columns != shape.columns_raw or ev.types != shape.types_raw or ev.pk != shape.pk_raw:
            shape = self._learn_shape(ev)
            if shape is None:
                return None
        if values is UNSET or len(values) != len(shape.columns):
            return None
        identity = ev.identity
        key_at = shape.key_at
        try:
            if len(key_at) == 1:
                col, at = key_at[0]
                value = values[at]
                if value is None:
                    return None  # a null key value: the full path decides
                key = _dumps({col: value})
            else:
                if any(values[at] is None for _, at in key_at):
                    return None
                key = _dumps({col: values[at] for col, at in key_at})
            if identity is not None:
                # Updates carry the old key (or the old row): same key or the full path.
                # (Identity on insert: REPLICA IDENTITY FULL by hand, the full path too.)
                if code != "u" or not len(identity.columns) == len(identity.types) == len(identity.values):
                    return None
                old = dict(zip(identity.columns, identity.values))  # noqa: B905 -- checked above
                if key != _dumps({col: old[col] for col in shape.pk}):
                    return None
            row = dict(zip(shape.columns, values))  # noqa: B905 -- lengths checked above; strict= costs ~0.2 µs
            set_table_meta(row, code, ev.lsn, ev.commit_lsn, ev.seq, ev.xid, ev.timestamp)
            # orjson refuses integers beyond 64 bits (msgspec keeps them, orjson.loads
            # makes floats of them): such rows take the full path, as orjson reads them.
            return ev.table, shape.topic, key, _dumps(row), shape.needs_state
        except (KeyError, TypeError):
            return None

    def _learn_shape(self, ev: _FastEvent) -> _TableShape | None:
        """Check an upsert's pk/columns/types as decode_event would, and remember them (None: full path)."""
        if ev.columns is UNSET or ev.types is UNSET:
            return None
        try:
            pk, columns, types = _decode_names(ev.pk), _decode_names(ev.columns), _decode_names(ev.types)
        except msgspec.DecodeError:
            return None
        table = ev.table
        if "." not in table or not pk or len(columns) != len(types):
            return None
        # A duplicated column name: the row keeps the last value, so the key must too.
        at = {col: i for i, col in enumerate(columns)}
        if any(col not in at for col in pk):
            return None  # the key is not in the row: the full path explains
        try:
            topic = self.topic_for(table)
        except (ContractError, RekeyError):
            return None  # the full path explains
        shape = _TableShape(
            pk_raw=ev.pk.copy(), columns_raw=ev.columns.copy(), types_raw=ev.types.copy(),
            pk=pk, columns=columns, key_at=tuple((col, at[col]) for col in pk),
            needs_state=not FIXED_WIDTH_TYPES.issuperset(types), topic=topic,
        )
        if len(self._shapes) >= _MAX_SHAPES:
            self._shapes.clear()
        self._shapes[table] = shape
        return shape

    def _fast_delete(self, ev: _FastEvent) -> FastRecord | None:
        """A delete by key: its tombstone (None when the full path must take it)."""
        image = ev.identity
        if image is None or ev.columns is not UNSET or self.emit_delete_records:
            return None
        shape = self._shapes.get(ev.table)
        if shape is not None and ev.pk == shape.pk_raw:
            pk, topic = shape.pk, shape.topic
        else:
            try:
                pk = _decode_names(ev.pk)
            except msgspec.DecodeError:
                return None
            try:
                topic = self.topic_for(ev.table)
            except (ContractError, RekeyError):
                return None
        if not pk or not len(image.columns) == len(image.types) == len(image.values):
            return None
        old = dict(zip(image.columns, image.values))  # noqa: B905 -- lengths checked above
        try:
            values = {col: old[col] for col in pk}
        except KeyError:
            return None
        if None in values.values():
            return None  # a null key value: the full path decides
        try:
            key = _dumps(values)
        except TypeError:
            return None
        return ev.table, topic, key, None, False

    def _upsert(self, event: ChangeEvent, state: StateView) -> Rekeyed:
        new = event.new
        if new is None:  # decode_event already refuses this; kept for direct callers
            raise RekeyError(f"{event.operation} event without a row")
        out = Rekeyed()
        topic = self.topic_for(event.table)
        unchanged = event.unchanged
        row = dict(zip(new.columns, new.values, strict=True))
        if not event.pk:
            out.no_pk = True
            if unchanged:
                self._fill(row, unchanged, event.identity, None, out)
            self.with_meta(row, event, OP_CODES[event.operation])
            out.records.append(OutRecord(topic, None, orjson.dumps(row), event.table, compact=False))
            return out
        out.needs_state = bool(unchanged) or not FIXED_WIDTH_TYPES.issuperset(new.types)
        new_key = _key_of(new, event.pk, unchanged) or _merged_key(new, event.identity, event.pk, unchanged)
        if new_key is None:
            raise RekeyError(f"primary-key column(s) {list(event.pk)} missing from the row of {event.table}")
        _refuse_lost_key_values(event, new.as_dict())
        old_key = _key_of(event.identity, event.pk)
        if old_key is None and event.identity is not None:
            old_key = self._key_by_identity(event, state, out)
        key_changed = old_key is not None and old_key != new_key
        if unchanged:
            prior = state.get(event.table, old_key if key_changed and old_key is not None else new_key)
            self._fill(row, unchanged, event.identity, prior, out)
        moves: _TxnMoves | None = None
        if key_changed:
            assert old_key is not None and event.identity is not None
            moves = self._moves_of(event)
            leaving = event.identity.as_dict()
            there = moves.occupants(old_key, event.seq)
            held = False
            if not there and moves.partial:
                # Moves before the reopen are not in the ledger: the store (what our output
                # says the key holds now) tells whether another row moved in and is still there.
                out.needs_state = True
                now = state.get(event.table, old_key)
                held = now is not None and UNKNOWN_ROW not in now and not _same_row(leaving, now)
            # What the key holds once this row left: nothing (a tombstone), or the row written
            # there last that is still there. A row that moved in earlier in this transaction
            # and is still there keeps the key (and the topic's value, when it was written last).
            if held:
                pass
            elif not there or _same_row(leaving, there[-1][0]):
                stays = there[-2][1] if len(there) > 1 else None
                out.records.append(OutRecord(topic, old_key, stays, event.table))
                out.changes.append((event.table, old_key, stays))
        self.with_meta(row, event, OP_CODES[event.operation])
        value = orjson.dumps(row)
        out.records.append(OutRecord(topic, new_key, value, event.table))
        out.changes.append((event.table, new_key, value))
        if moves is not None:
            assert old_key is not None and event.identity is not None
            moves.record(event.seq, old_key, event.identity.as_dict(), new_key, row, value)
        return out

    @staticmethod
    def _fill(
        row: dict[str, Any],
        unchanged: tuple[str, ...],
        identity: RowImage | None,
        prior: dict[str, Any] | None,
        out: Rekeyed,
    ) -> None:
        """Put back unchanged TOAST values: the old row (identity) first, then the store.

        A value that cannot be found is left out rather than emitted as null: null
        would be a lie about a value that exists.
        """
        old = identity.as_dict() if identity is not None else {}
        if prior is not None and UNKNOWN_ROW in prior and any(col not in old for col in unchanged):
            # Filling from an older row would publish a stale value as current.
            raise RekeyError(f"unchanged column(s) {list(unchanged)} of a row whose last value is unknown: "
                             f"{prior[UNKNOWN_ROW]}")
        for col in unchanged:
            if col in old:
                row[col] = old[col]
            elif prior is not None and col in prior:
                row[col] = prior[col]
            else:
                row.pop(col, None)
                out.unfilled.append(col)

    def _delete(self, event: ChangeEvent, state: StateView) -> Rekeyed:
        out = Rekeyed()
        topic = self.topic_for(event.table)
        old = event.identity or event.new
        if not event.pk:
            out.no_pk = True
            row = old.as_dict() if old is not None else {}
            self.with_meta(row, event, "d")
            out.records.append(OutRecord(topic, None, orjson.dumps(row), event.table, compact=False))
            return out
        key = _key_of(old, event.pk)
        if key is None and event.identity is not None:
            key = self._key_by_identity(event, state, out)
            if key is None:
                return out  # no row of the table has it: nothing to tombstone
        if key is None:
            raise RekeyError(f"delete on {event.table} without the primary-key column(s) {list(event.pk)}")
        if old is not None:
            _refuse_lost_key_values(event, old.as_dict())
        if self.emit_delete_records:
            last = state.get(event.table, key)
            row = dict(last) if last is not None and UNKNOWN_ROW not in last else {}
            if old is not None:
                # The identity is the newest truth for the columns it carries.
                row.update(zip(old.columns, old.values, strict=True))
            self.with_meta(row, event, "d")
            out.records.append(OutRecord(topic, key, orjson.dumps(row), event.table))
        out.records.append(OutRecord(topic, key, None, event.table))
        out.changes.append((event.table, key, None))
        return out

    @staticmethod
    def _key_by_identity(event: ChangeEvent, state: StateView, out: Rekeyed) -> bytes | None:
        """The old row's key when the event's identity lacks a key column: under REPLICA IDENTITY
        USING INDEX on a unique index that is not the primary key, the identity is the index's
        columns. The store finds the row by them (so the table must be in it): a delete went to
        the DLQ and left the row in its topic, an update moving the key left the old key's row."""
        assert event.identity is not None
        out.needs_state = True
        return state.find(event.table, event.identity.as_dict())

    def _truncate(self, event: ChangeEvent, state: StateView) -> Rekeyed:
        out = Rekeyed()
        topic = self.topic_for(event.table)
        if not event.pk:
            out.no_pk = True
            marker = orjson.dumps(self.with_meta({}, event, "t"))
            out.records.append(OutRecord(topic, None, marker, event.table, compact=False))
            return out
        out.needs_state = out.truncate = True
        # Sorted: deterministic output, whatever order the store returns.
        for key in _sorted_in_pieces(state.keys(event.table)):
            out.records.append(OutRecord(topic, key, None, event.table))
            out.changes.append((event.table, key, None))
        return out


SORT_PIECE: Final = 50_000


def _sorted_in_pieces(keys: Iterable[bytes]) -> Iterator[bytes]:
    """``sorted(keys)``, sorted in pieces and merged: one sort of a large table's keys is one C
    call that holds the GIL for seconds (2.6 s for 1M keys), when the demux runs it in a thread
    so that the event loop goes on (a truncate: demux.worker.OFF_LOOP_ITEMS)."""
    items = list(keys)
    if len(items) <= SORT_PIECE:
        return iter(sorted(items))
    return heapq.merge(*(sorted(items[i:i + SORT_PIECE]) for i in range(0, len(items), SORT_PIECE)))


def single(hit: FastRecord) -> Rekeyed:
    """A fast result as the general path's result."""
    table, topic, key, value, needs_state = hit
    return Rekeyed(table, [OutRecord(topic, key, value, table)], [(table, key, value)], needs_state=needs_state)
