"""The walbus message contract, version 1 (see docs/contract.md).

One Kafka record per row change on the database topic ``<prefix>.<database>``:

* key:   ``"%016X-%08X" % (commit_lsn, seq)``, ASCII; byte order == event order.
* value: one JSON object (orjson), fields in the order of :data:`FIELD_ORDER`.

This module is the only place that knows the wire form: :func:`encode_event` is the
reference encoder, :data:`FIELD_HEADS` and :data:`OPERATION_PARTS` are the fragments the
producer's fast writer splices (so it spells no field name itself), consumers parse values
with :func:`decode_event`.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from fnmatch import fnmatchcase
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
import orjson

from walbus.native import native_module

CONTRACT_VERSION: Final = 1

Operation = Literal["insert", "update", "delete", "truncate", "read"]
OPERATIONS: Final[frozenset[str]] = frozenset({"insert", "update", "delete", "truncate", "read"})
ROW_OPERATIONS: Final[frozenset[str]] = frozenset({"insert", "update", "read"})  # carry columns/types/values

FIELD_ORDER: Final = (
    "v",
    "lsn",
    "commit_lsn",
    "seq",
    "xid",
    "operation",
    "table",
    "timestamp",
    "pk",
    "not_null",
    "typmods",
    "columns",
    "types",
    "values",
    "identity",
    "unchanged",
)

# The image fields: ``columns``/``types``/``values`` at top level (the new row) and inside ``identity``.
IMAGE_FIELDS: Final = ("columns", "types", "values")
ABSENT_FIELDS: Final = frozenset({"not_null", "typmods", "columns", "types", "values", "identity", "unchanged"})  # left out when empty
# The table's column metadata (``not_null``, ``typmods``): of the relation, not of one image, so
# deletes and truncates carry it too. Optional: events of producers before 2026-11 lack it.
TYPMOD_LIMIT: Final = 1 << 31  # a modifier is an int32 in PostgreSQL (signed: numeric's scale may be < 0)

# How values are carried, by ``pg_type.typname``: JSON integers, JSON floats (the specials as
# strings), JSON booleans; every other type as PostgreSQL's text output (docs/contract.md).
INT_TYPES: Final = frozenset({"int2", "int4", "int8", "oid", "xid", "cid"})
FLOAT_TYPES: Final = frozenset({"float4", "float8"})
BOOL_TYPES: Final = frozenset({"bool"})
FLOAT_SPECIALS: Final = frozenset({"NaN", "Infinity", "-Infinity"})
MASK: Final = "****"  # the value of a masked column (its type unchanged)

# The integer fields and their widths: the key's fixed width holds 64-bit LSNs and 32-bit seqs.
FIELD_BITS: Final = {"lsn": 64, "commit_lsn": 64, "seq": 32, "xid": 64}
KEY_FORMAT: Final = "%016X-%08X"  # (commit_lsn, seq)
KEY_PATTERN: Final = "[0-9A-F]{16}-[0-9A-F]{8}"  # the whole key, no anchors ($ takes a final newline)


def _field_head(name: str) -> bytes:
    """The bytes that open ``name`` in a value: ``{"v":`` for the first field, ``,"lsn":`` after."""
    return (b"{" if name == FIELD_ORDER[0] else b",") + orjson.dumps(name) + b":"


# Fragments for writers that splice values by hand (the producer's): built from FIELD_ORDER,
# and checked byte for byte against encode_event by the codec's property tests.
FIELD_HEADS: Final[dict[str, bytes]] = {name: _field_head(name) for name in FIELD_ORDER}
IMAGE_HEADS: Final[dict[str, bytes]] = {
    name: (b"{" if name == IMAGE_FIELDS[0] else b",") + orjson.dumps(name) + b":" for name in IMAGE_FIELDS
}
OPERATION_PARTS: Final[dict[str, bytes]] = {op: FIELD_HEADS["operation"] + orjson.dumps(op) for op in sorted(OPERATIONS)}
VALUE_END: Final = b"}"

_LSN_TEXT = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_KEY_TEXT = re.compile(KEY_PATTERN.encode())
_KEY_BYTES_FORMAT: Final = KEY_FORMAT.encode()
_T = TypeVar("_T")


class ContractError(ValueError):
    """A record does not follow the walbus message contract."""


class Lsn(int):
    """A PostgreSQL WAL position (``pg_lsn``): a 64-bit integer shown as ``X/X``."""

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> Lsn:
        m = _LSN_TEXT.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"not an LSN: {text!r} (expected the form 16/B374D848)")
        return cls((int(m.group(1), 16) << 32) | int(m.group(2), 16))

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"


def event_key(commit_lsn: int, seq: int) -> bytes:
    """The database-topic key of an event: fixed width, sorts in event order."""
    return _KEY_BYTES_FORMAT % (commit_lsn, seq)


def parse_event_key(key: bytes) -> tuple[int, int]:
    """Inverse of :func:`event_key`."""
    if _KEY_TEXT.fullmatch(key) is None:
        raise ContractError(f"not a walbus event key: {key[:40]!r}")
    return int(key[:16], 16), int(key[17:], 16)


def key_metadata(prefix: str, key: bytes | None) -> str:
    """Offset-commit metadata naming the last event key a consumer group finished with (empty: none)."""
    return "" if key is None else prefix + key.decode("ascii")


def metadata_key(text: str | None, prefix: str) -> bytes | None:
    """The event key in metadata :func:`key_metadata` wrote with ``prefix``; None for another's or a malformed one."""
    if not text or not text.startswith(prefix):
        return None
    key = text[len(prefix) :].encode("ascii", "replace")
    return key if _KEY_TEXT.fullmatch(key) is not None else None


@dataclass(frozen=True, slots=True)
class RowImage:
    """Column names, ``pg_type.typname`` type names and JSON values of one row."""

    columns: tuple[str, ...]
    types: tuple[str, ...]
    values: tuple[Any, ...]

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self.columns, self.values, strict=True))

    def key_values(self, pk: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict[str, Any] | None:
        """The primary-key values in key order; None when a key column is missing (or in ``skip``)."""
        row = self.as_dict()
        if any(col not in row or col in skip for col in pk):
            return None
        return {col: row[col] for col in pk}

    def to_json_obj(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "types": list(self.types), "values": list(self.values)}


def merged_key_values(
    new: RowImage | None, identity: RowImage | None, pk: tuple[str, ...], unchanged: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """An event's primary-key values in key order, column by column from the new row, else
    from the identity; None when a column is in neither.

    Column by column: an update can leave a key column's TOASTed value out of the new row
    (unchanged) while it changes another key column, so neither image alone holds the key
    (taking the identity's whole key re-keyed such a row under its old key)."""
    if new is not None:
        values = new.key_values(pk, unchanged)
        if values is not None:
            return values  # the usual event: the new row holds its key
    new_row = new.as_dict() if new is not None else {}
    old_row = identity.as_dict() if identity is not None else {}
    merged: dict[str, Any] = {}
    for col in pk:
        if col in new_row and col not in unchanged:
            merged[col] = new_row[col]
        elif col in old_row:
            merged[col] = old_row[col]
        else:
            return None
    return merged


@dataclass(frozen=True, slots=True)
class ColumnType:
    """What an event says about one column's type (:meth:`ChangeEvent.column_types`).

    ``modifiers``: the type modifier as SQL writes it, ``(12, 2)`` for ``numeric(12,2)``,
    ``(40,)`` for ``varchar(40)``, ``(3,)`` for ``timestamp(3)``; an array carries its element's
    (docs/contract.md lists the types). Empty without one, or from a producer before 2026-11.
    """

    name: str
    type: str  # pg_type.typname
    modifiers: tuple[int, ...] = ()
    nullable: bool = True
    primary_key: bool = False

    @property
    def precision(self) -> int | None:
        """numeric's precision; for the time types, fractional-second digits."""
        return self.modifiers[0] if self.modifiers and self._base not in _LENGTH_TYPES else None

    @property
    def scale(self) -> int | None:
        """numeric's scale (0 for ``numeric(12)``)."""
        return self.modifiers[1] if self._base == "numeric" and len(self.modifiers) > 1 else None

    @property
    def length(self) -> int | None:
        """The declared length of ``varchar``, ``bpchar`` (``char``), ``bit`` and ``varbit``."""
        return self.modifiers[0] if self.modifiers and self._base in _LENGTH_TYPES else None

    @property
    def declared(self) -> str:
        """The type name with its modifier: ``numeric(12,2)``, ``_varchar(40)``, ``text``."""
        return f"{self.type}({','.join(map(str, self.modifiers))})" if self.modifiers else self.type

    @property
    def _base(self) -> str:
        return self.type[1:] if self.type.startswith("_") else self.type


_LENGTH_TYPES: Final = frozenset({"varchar", "bpchar", "bit", "varbit"})


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """One row change, as carried on the database topic (contract v1)."""

    lsn: int
    commit_lsn: int
    seq: int
    xid: int
    operation: Operation
    table: str
    timestamp: str
    pk: tuple[str, ...] = ()
    new: RowImage | None = None
    identity: RowImage | None = None
    unchanged: tuple[str, ...] = field(default=())
    not_null: tuple[str, ...] = ()  # the table's NOT NULL columns (key columns among them)
    typmods: Mapping[str, tuple[int, ...]] = field(default_factory=dict, hash=False)  # column -> modifier

    @property
    def key(self) -> bytes:
        return event_key(self.commit_lsn, self.seq)

    @property
    def position(self) -> tuple[int, int]:
        """``(commit_lsn, seq)``: unique, and ordered as the commits."""
        return (self.commit_lsn, self.seq)

    @property
    def schema_name(self) -> str:
        return split_table(self.table)[0]

    @property
    def table_name(self) -> str:
        return split_table(self.table)[1]

    def row(self) -> dict[str, Any] | None:
        """The new row as a dict (``None`` on delete and truncate)."""
        return self.new.as_dict() if self.new is not None else None

    def key_values(self) -> dict[str, Any] | None:
        """Primary-key values in key order: each from the new row, else from the identity (a
        key column whose TOASTed value an update left unchanged is not in the new row)."""
        if not self.pk:
            return None
        return merged_key_values(self.new, self.identity, self.pk, self.unchanged)

    def column_types(self) -> dict[str, ColumnType]:
        """Each column of the new row (else of the identity) with its type, modifier,
        nullability and whether it is a primary-key column; ``{}`` on truncate."""
        image = self.new if self.new is not None else self.identity
        if image is None:
            return {}
        keys, not_null, typmods = set(self.pk), set(self.not_null), self.typmods
        return {
            name: ColumnType(name, type_, typmods.get(name, ()), name not in not_null and name not in keys, name in keys)
            for name, type_ in zip(image.columns, image.types, strict=True)
        }

    def to_json(self) -> bytes:
        return encode_event(
            lsn=self.lsn,
            commit_lsn=self.commit_lsn,
            seq=self.seq,
            xid=self.xid,
            operation=self.operation,
            table=self.table,
            timestamp=self.timestamp,
            pk=list(self.pk),
            new=self.new.to_json_obj() if self.new is not None else None,
            identity=self.identity.to_json_obj() if self.identity is not None else None,
            unchanged=list(self.unchanged),
            not_null=list(self.not_null),
            typmods={name: list(mods) for name, mods in self.typmods.items()},
        )


def encode_event(
    *,
    lsn: int,
    commit_lsn: int,
    seq: int,
    xid: int,
    operation: str,
    table: str,
    timestamp: str,
    pk: list[str],
    new: dict[str, list[Any]] | None,
    identity: dict[str, list[Any]] | None,
    unchanged: list[str] | None = None,
    not_null: list[str] | None = None,
    typmods: dict[str, list[int]] | None = None,
) -> bytes:
    """Serialize one event. ``new``/``identity`` are ``{columns, types, values}`` dicts;
    ``not_null`` the table's NOT NULL columns, ``typmods`` its columns' type modifiers."""
    fields: dict[str, Any] = {
        "v": CONTRACT_VERSION, "lsn": lsn, "commit_lsn": commit_lsn, "seq": seq, "xid": xid,
        "operation": operation, "table": table, "timestamp": timestamp, "pk": pk,
        "not_null": not_null or None, "typmods": typmods or None,
        "identity": identity, "unchanged": unchanged or None,
    }
    if new is not None:
        fields.update((name, new[name]) for name in IMAGE_FIELDS)
    obj = {name: fields[name] for name in FIELD_ORDER if fields.get(name) is not None or name not in ABSENT_FIELDS}
    return orjson.dumps(obj)


# The decoder reads orjson's output, whose types are exact (never a subclass): ``type(x) is
# list`` is isinstance's answer there, and cheaper. Checks run in the order the messages
# promise (docs/contract.md), so each input gets the same ContractError as before.
_LSN_LIMIT: Final = 1 << FIELD_BITS["lsn"]
_COMMIT_LSN_LIMIT: Final = 1 << FIELD_BITS["commit_lsn"]
_SEQ_LIMIT: Final = 1 << FIELD_BITS["seq"]
_XID_LIMIT: Final = 1 << FIELD_BITS["xid"]
_NO_NAMES: Final[list[str]] = []
_NO_TYPMODS: Final[Mapping[str, tuple[int, ...]]] = {}


def _image(obj: Any, where: str) -> RowImage:
    try:
        columns, types, values = obj["columns"], obj["types"], obj["values"]
    except (KeyError, TypeError) as e:
        raise ContractError(f"{where}: needs columns, types and values") from e
    if type(columns) is not list or type(types) is not list or type(values) is not list:
        raise ContractError(f"{where}: columns, types and values must be lists")
    if not len(columns) == len(types) == len(values):
        raise ContractError(f"{where}: columns, types and values differ in length")
    _check_names(columns, f"{where} columns")
    _check_names(types, f"{where} types")
    return _build(RowImage, _IMAGE_SLOTS, (tuple(columns), tuple(types), tuple(values)))


def _typmods(obj: Any) -> Mapping[str, tuple[int, ...]]:
    """``typmods``: an object of column name -> list of int32s (null: none)."""
    if obj is None:
        return _NO_TYPMODS
    if type(obj) is not dict:
        raise ContractError("field 'typmods' must be an object")
    out: dict[str, tuple[int, ...]] = {}
    for name, mods in obj.items():  # plain loops: a generator's frame per column costs more here
        if type(mods) is not list:
            raise ContractError(_TYPMODS_ERROR)
        for m in mods:
            if type(m) is not int or not -TYPMOD_LIMIT <= m < TYPMOD_LIMIT:
                raise ContractError(_TYPMODS_ERROR)
        out[name] = tuple(mods)
    return out


_TYPMODS_ERROR: Final = "field 'typmods' must map each column to a list of 32-bit integers"


def _check_names(names: list[Any], where: str) -> None:
    # Names become dict keys and JSON object keys downstream: a number there is the record's fault.
    try:
        "".join(names)  # the C loop refuses any non-string; ~10x an all(isinstance) generator
    except TypeError:
        raise ContractError(f"{where}: names must be strings") from None


def _int_field(obj: dict[str, Any], name: str, limit: int) -> int:
    v = obj.get(name)
    if type(v) is not int:  # not bool either
        raise ContractError(f"field {name!r} must be an integer, got {v!r}")
    if not 0 <= v < limit:
        raise ContractError(f"field {name!r} is out of range: {v}")
    return v


def _check_table(table: str) -> None:
    # The common name ("public.orders": one dot, no quotes) needs no parsing.
    if '"' in table or table.count(".") != 1 or table[0] == "." or table[-1] == ".":
        split_table(table)  # raises ContractError unless a quoted name splits


def decode_event(value: bytes | str) -> ChangeEvent:
    """Parse and validate one database-topic value; raises :class:`ContractError`."""
    return decode_event_as(value, ChangeEvent)


_E = TypeVar("_E", bound="ChangeEvent")


def decode_event_as(value: bytes | str, cls: type[_E]) -> _E:
    """:func:`decode_event`, building an instance of ``cls``, a slotted subclass of ChangeEvent.

    The subclass's own fields are left unset, for the caller to fill (the client's FeedEvent
    is built so, without copying a ChangeEvent's fields over).
    """
    if _decode_native is not None and type(value) is bytes:
        native: _E | None = _decode_native(value, cls)
        if native is not None:
            return native
    return _decode_python(value, cls)


def _decode_python(value: bytes | str, cls: type[_E]) -> _E:
    """msgspec, then the reference checks for what it does not take."""
    try:
        wire = _decode_wire(value)
    except (msgspec.DecodeError, ValueError, RecursionError):  # ValueError: bad UTF-8; the full path says why
        return _decode_checked(value, cls)
    event = _from_wire(wire, cls)
    return _decode_checked(value, cls) if event is None else event


def decode_keyed_event_as(key: bytes | None, value: bytes | None, cls: type[_E]) -> _E:
    """The event of a database-topic record whose key is its own position (else
    :class:`ContractError`), as :func:`decode_event_as` builds it: the consumers' hot path.

    A caller that decodes many records calls :data:`try_decode_keyed_event` first, and this
    only when it returns None."""
    if try_decode_keyed_event is not None:
        native: _E | None = try_decode_keyed_event(key, value, cls)
        if native is not None:
            return native
    if value is None:
        raise ContractError("record without a value")
    event = _decode_python(value, cls)  # the compiled decoder declined the value or its key
    commit_lsn, seq = event.commit_lsn, event.seq
    if key != _KEY_BYTES_FORMAT % (commit_lsn, seq):
        check_key(key, event)  # raises unless the key is another text of the position, with its message
    return event


def _decode_checked(value: bytes | str, cls: type[_E]) -> _E:
    """The reference decoder: every check in the order the messages promise."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise ContractError(f"value is not JSON: {e}") from e
    if type(obj) is not dict:
        raise ContractError("value is not a JSON object")
    get = obj.get
    version = get("v")
    if type(version) is not int or version != CONTRACT_VERSION:  # true and 1.0 equal 1 in Python
        raise ContractError(f"unknown contract version {version!r} (this build reads v{CONTRACT_VERSION})")
    operation = get("operation")
    if type(operation) is not str or operation not in OPERATIONS:  # a list is not hashable
        raise ContractError(f"unknown operation {operation!r}")
    table = get("table")
    if type(table) is not str:
        raise ContractError(f"field 'table' must be 'schema.table', got {table!r}")
    _check_table(table)
    timestamp = get("timestamp")
    if type(timestamp) is not str:
        raise ContractError("field 'timestamp' must be a string")
    pk = get("pk", _NO_NAMES)
    if type(pk) is not list:
        raise ContractError("field 'pk' must be a list")
    _check_names(pk, "pk")
    not_null = get("not_null")
    if not_null is None:  # null and absent alike
        not_null = _NO_NAMES
    elif type(not_null) is not list:
        raise ContractError("field 'not_null' must be a list")
    _check_names(not_null, "not_null")
    typmods = _typmods(get("typmods"))
    new = _image(obj, "row") if "columns" in obj else None
    if new is None and operation in ROW_OPERATIONS:
        raise ContractError(f"{operation} event without columns/types/values")
    ident = get("identity")
    identity = _image(ident, "identity") if ident is not None else None
    unchanged = get("unchanged", _NO_NAMES)
    if type(unchanged) is not list:
        raise ContractError("field 'unchanged' must be a list")
    _check_names(unchanged, "unchanged")
    lsn, commit_lsn, seq, xid = get("lsn"), get("commit_lsn"), get("seq"), get("xid")
    if not (
        type(lsn) is int and 0 <= lsn < _LSN_LIMIT
        and type(commit_lsn) is int and 0 <= commit_lsn < _COMMIT_LSN_LIMIT
        and type(seq) is int and 0 <= seq < _SEQ_LIMIT
        and type(xid) is int and 0 <= xid < _XID_LIMIT
    ):  # one test for the common case; _int_field names the first bad one
        for name, limit in (("lsn", _LSN_LIMIT), ("commit_lsn", _COMMIT_LSN_LIMIT), ("seq", _SEQ_LIMIT), ("xid", _XID_LIMIT)):
            _int_field(obj, name, limit)
    fields_in_order = (
        lsn, commit_lsn, seq, xid, operation, table, timestamp, tuple(pk), new, identity, tuple(unchanged),
        tuple(not_null), typmods,
    )
    return _build(cls, _EVENT_SLOTS, fields_in_order)


# A frozen dataclass's __init__ sets each field through object.__setattr__, which made up a
# third of decode_event's time; the decoder sets the slots directly (the same object, ==).
Setter = Callable[[Any, Any], None]


def _slot_setters(cls: type, names: tuple[str, ...]) -> tuple[Setter, ...]:
    """The slot setters of ``cls`` for ``names``, which must be all its fields (checked at import)."""
    if {f.name for f in fields(cls)} != set(names) or len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}'s fields are not {names}: update walbus.contract's decoder")
    return tuple(cls.__dict__[name].__set__ for name in names)


_EVENT_SLOT_NAMES: Final = (
    "lsn", "commit_lsn", "seq", "xid", "operation", "table", "timestamp", "pk", "new", "identity", "unchanged",
    "not_null", "typmods",
)
_IMAGE_SLOT_NAMES: Final = ("columns", "types", "values")
_EVENT_SLOTS: Final = _slot_setters(ChangeEvent, _EVENT_SLOT_NAMES)
_IMAGE_SLOTS: Final = _slot_setters(RowImage, _IMAGE_SLOT_NAMES)


def _build(cls: type[_T], setters: tuple[Setter, ...], values: tuple[Any, ...]) -> _T:
    obj = object.__new__(cls)
    for put, value in zip(setters, values):  # noqa: B905 -- same length by construction
        put(obj, value)
    return obj


# -- the fast path of decode_event ---------------------------------------------------------
# msgspec decodes a value into typed structs, checking the field types and ranges in C, and
# the few checks it cannot express (equal lengths, a row for a row operation, the table's
# form) follow in Python. It accepts a subset of what the reference decoder accepts and
# builds the same event (tests/unit/test_prop_contract.py compares both); everything else
# takes the reference path, which also words the error. Refused here, so left to the
# reference path: unknown fields (msgspec skips them unchecked, where orjson refuses bad
# UTF-8 or 1e400 anywhere), integers beyond int64 (msgspec's bounds; orjson reads a value
# beyond 64 bits as a float), nested values (never written by the producer), quoted names.
_Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_Scalar = _Int | float | str | bool | None
_WireLsn = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["lsn"], 63)) - 1)]
_WireCommitLsn = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["commit_lsn"], 63)) - 1)]
_WireSeq = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["seq"], 63)) - 1)]
_WireXid = Annotated[int, msgspec.Meta(ge=0, le=(1 << min(FIELD_BITS["xid"], 63)) - 1)]
_WireTypmod = Annotated[int, msgspec.Meta(ge=-TYPMOD_LIMIT, le=TYPMOD_LIMIT - 1)]


class _WireImage(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    columns: tuple[str, ...]
    types: tuple[str, ...]
    values: tuple[_Scalar, ...]


class _WireEvent(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    # UNSET, not None, for an absent row: the reference path refuses "columns": null.
    v: Literal[1]
    lsn: _WireLsn
    commit_lsn: _WireCommitLsn
    seq: _WireSeq
    xid: _WireXid
    operation: Operation
    table: str
    timestamp: str
    pk: tuple[str, ...] = ()
    columns: tuple[str, ...] | msgspec.UnsetType = msgspec.UNSET
    types: tuple[str, ...] | msgspec.UnsetType = msgspec.UNSET
    values: tuple[_Scalar, ...] | msgspec.UnsetType = msgspec.UNSET
    identity: _WireImage | None = None
    unchanged: tuple[str, ...] = ()
    not_null: tuple[str, ...] | None = None
    typmods: dict[str, tuple[_WireTypmod, ...]] | None = None


if CONTRACT_VERSION != 1:
    raise TypeError("update _WireEvent.v to the contract version")
_decode_wire: Final = msgspec.json.Decoder(_WireEvent).decode
(
    _set_lsn, _set_commit_lsn, _set_seq, _set_xid, _set_operation, _set_table,
    _set_timestamp, _set_pk, _set_new, _set_identity, _set_unchanged, _set_not_null, _set_typmods,
) = _EVENT_SLOTS
_set_columns, _set_types, _set_values = _IMAGE_SLOTS
_new: Final = object.__new__


def _wire_image(columns: tuple[str, ...], types: tuple[str, ...], values: tuple[Any, ...]) -> RowImage | None:
    if not len(columns) == len(types) == len(values):
        return None
    image: RowImage = _new(RowImage)
    _set_columns(image, columns)
    _set_types(image, types)
    _set_values(image, values)
    return image


def _from_wire(w: _WireEvent, cls: type[_E]) -> _E | None:
    """The event of a decoded struct; None when the reference path must decide."""
    columns, types, values = w.columns, w.types, w.values
    new: RowImage | None = None
    if columns is not msgspec.UNSET:
        if types is msgspec.UNSET or values is msgspec.UNSET or not len(columns) == len(types) == len(values):
            return None
        new = _new(RowImage)
        _set_columns(new, columns)
        _set_types(new, types)
        _set_values(new, values)
    elif w.operation in ROW_OPERATIONS:
        return None
    ident = w.identity
    identity = None if ident is None else _wire_image(ident.columns, ident.types, ident.values)
    if identity is None and ident is not None:
        return None
    table = w.table
    if '"' in table or table.count(".") != 1 or table[0] == "." or table[-1] == ".":
        return None  # quoted or odd: _check_table's split, on the reference path
    event: _E = _new(cls)  # set slot by slot, unrolled: _build's loop costs ~1 µs here
    _set_lsn(event, w.lsn)
    _set_commit_lsn(event, w.commit_lsn)
    _set_seq(event, w.seq)
    _set_xid(event, w.xid)
    _set_operation(event, w.operation)
    _set_table(event, table)
    _set_timestamp(event, w.timestamp)
    _set_pk(event, w.pk)
    _set_new(event, new)
    _set_identity(event, identity)
    _set_unchanged(event, w.unchanged)
    not_null, typmods = w.not_null, w.typmods
    _set_not_null(event, () if not_null is None else not_null)
    _set_typmods(event, _NO_TYPMODS if typmods is None else typmods)
    return event


def _native_event_decoder() -> Any:
    """The compiled decoder (walbus_native.EventDecoder), told the wire form from here; None
    without the extension. It takes a strict subset of what _WireEvent takes and builds the same
    event; None from it means this module's decoders decide (tests/unit/test_prop_contract_decoders.py)."""
    module = native_module()
    if module is None or not hasattr(getattr(module, "EventDecoder", None), "decode_keyed"):
        return None  # no extension, or one built before the keyed decoder: the Python paths
    wire = ("v", "lsn", "commit_lsn", "seq", "xid", "operation", "table", "timestamp", "pk", *IMAGE_FIELDS,
            "identity", "unchanged", "not_null", "typmods")
    if set(wire) != set(FIELD_ORDER) or len(wire) != len(FIELD_ORDER):
        raise TypeError("walbus.contract's native decoder does not name every field of FIELD_ORDER")
    limits = [(1 << min(FIELD_BITS[name], 63)) - 1 for name in ("lsn", "commit_lsn", "seq", "xid")]
    key_format = re.fullmatch(r"%0(\d+)X(.*)%0(\d+)X", KEY_FORMAT)
    if key_format is None:
        raise TypeError("walbus.contract's native decoder does not know KEY_FORMAT")
    return module.EventDecoder(
        list(wire), list(IMAGE_FIELDS), limits, CONTRACT_VERSION, TYPMOD_LIMIT,
        [(sys.intern(op), op in ROW_OPERATIONS) for op in sorted(OPERATIONS)],
        [sys.intern(name) for name in _EVENT_SLOT_NAMES], [sys.intern(name) for name in _IMAGE_SLOT_NAMES],
        RowImage, _NO_TYPMODS,
        [int(key_format[1]), int(key_format[3])], key_format[2].encode(),
    )


_native_decoder: Final = _native_event_decoder()
_decode_native: Final[Callable[[bytes, type[Any]], Any] | None] = (
    None if _native_decoder is None else _native_decoder.decode
)
try_decode_keyed_event: Final[Callable[[bytes | None, bytes | None, type[Any]], Any] | None] = (
    None if _native_decoder is None else _native_decoder.decode_keyed
)
"""``(key, value, cls) -> event | None``: the compiled decoder of a keyed record, without
:func:`decode_keyed_event_as`'s Python call around it; None from it (a value it does not take,
a key other than the position's one text) means :func:`decode_keyed_event_as` decides. None
itself without the extension."""


def check_key(key: bytes | None, event: ChangeEvent) -> None:
    """Raise :class:`ContractError` unless ``key`` is the event's own position.

    Consumers move their positions only on events that pass this: a record whose key
    says one position and whose value another must not move anything.
    """
    commit_lsn, seq = event.commit_lsn, event.seq
    in_range = 0 <= commit_lsn < _COMMIT_LSN_LIMIT and 0 <= seq < _SEQ_LIMIT
    if in_range and key is not None and key == _KEY_BYTES_FORMAT % (commit_lsn, seq):
        return  # the one text of a position (fixed width, upper case): no parse needed
    if key is None or parse_event_key(key) != (commit_lsn, seq):
        shown = key[:40] if key is not None else None
        raise ContractError(f"key {shown!r} is not the event's position {event_key(event.commit_lsn, event.seq)!r}")


# -- side topics -------------------------------------------------------------------------
# Beside a database topic, ``<database topic>.<suffix>``: the demux's dead letters, the
# producer's progress, transaction metadata and heartbeats. None holds a table's rows.
SIDE_TOPIC_SUFFIXES: Final = ("dlq", "progress", "transaction", "heartbeat")


def side_topic(source_topic: str, suffix: str) -> str:
    if suffix not in SIDE_TOPIC_SUFFIXES:
        raise ValueError(f"not a side topic of walbus: {suffix!r}")
    return f"{source_topic}.{suffix}"


# -- per-table topics ---------------------------------------------------------------------
# A row there is the row's columns plus these fields (they win over a column of the same
# name); ``__op`` is the operation's code (docs/demux.md).
TABLE_META_FIELDS: Final = ("__op", "__lsn", "__commit_lsn", "__seq", "__xid", "__ts")
OP_CODES: Final = {"insert": "c", "update": "u", "delete": "d", "read": "r", "truncate": "t"}
ROW_OP_CODES: Final = frozenset({"c", "u", "r", "d"})  # a row's codes ("t" marks a truncate)
_INT_TABLE_META: Final = ("__lsn", "__commit_lsn", "__seq", "__xid")


def set_table_meta(row: dict[str, Any], op_code: str, lsn: int, commit_lsn: int, seq: int, xid: int, ts: str) -> dict[str, Any]:
    """``row`` (changed in place) as a per-table record's value: its columns and the ``__``
    fields. Positional and in place: the demux calls it once per event."""
    row["__op"] = op_code
    row["__lsn"] = lsn
    row["__commit_lsn"] = commit_lsn
    row["__seq"] = seq
    row["__xid"] = xid
    row["__ts"] = ts
    return row


def pop_table_meta(row: dict[str, Any]) -> dict[str, Any]:
    """Take the ``__`` fields out of a per-table record's value (``row`` keeps the columns);
    raises ContractError when ``__op`` is not a row's code or a position field is not an integer."""
    meta: dict[str, Any] = {k: row.pop(k) for k in TABLE_META_FIELDS if k in row}
    op = meta.get("__op")
    if op not in ROW_OP_CODES:
        raise ContractError(f"unknown or missing __op {op!r}")
    bad = [k for k in _INT_TABLE_META if k in meta and (type(meta[k]) is not int)]
    if bad:
        raise ContractError(f"metadata {bad} must be integers")
    return meta


# -- table names --------------------------------------------------------------------------
# The event's ``table`` is ``schema.table``; a part that holds a dot or a double quote is
# written in double quotes with inner quotes doubled (SQL style), so every name PostgreSQL
# accepts splits back exactly, and every other name reads as before.


def _quote_part(part: str) -> str:
    if "." in part or '"' in part:
        return '"' + part.replace('"', '""') + '"'
    return part


def array_delimiter(element_type: str) -> str:
    """The delimiter in an array value's text of ``element_type`` elements (``pg_type.typdelim``):
    ``;`` for ``box`` (whose own text holds commas), ``,`` for every other built-in type. (A
    ``box[]`` split at its commas came out as seven garbled elements; a types fuzz.)"""
    return ";" if element_type == "box" else ","


def qualify_table(schema: str, table: str) -> str:
    """The event's ``table`` field for (schema, table); inverse of :func:`split_table`."""
    return f"{_quote_part(schema)}.{_quote_part(table)}"


def _take_part(text: str, start: int) -> tuple[str, int]:
    """One part of a qualified name from ``start``; returns it and the index after it."""
    if text.startswith('"', start):
        out: list[str] = []
        i = start + 1
        while True:
            j = text.find('"', i)
            if j < 0:
                raise ContractError(f"unterminated quote in table name {text!r}")
            out.append(text[i:j])
            if text.startswith('"', j + 1):  # a doubled quote
                out.append('"')
                i = j + 2
                continue
            return "".join(out), j + 1
    j = text.find(".", start)
    end = len(text) if j < 0 else j
    part = text[start:end]
    if '"' in part:
        raise ContractError(f"stray quote in table name {text!r}")
    return part, end


def split_table(qualified: str) -> tuple[str, str]:
    """``(schema, table)`` of an event's ``table`` field; raises :class:`ContractError`."""
    schema, i = _take_part(qualified, 0)
    if not qualified.startswith(".", i):
        raise ContractError(f"table name {qualified!r} is not 'schema.table'")
    table, j = _take_part(qualified, i + 1)
    if j != len(qualified) or not schema or not table:
        raise ContractError(f"table name {qualified!r} is not 'schema.table'")
    return schema, table


# -- name patterns ------------------------------------------------------------------------
# One syntax wherever walbus selects tables or columns (docs/contract.md, "Table patterns"):
# a pattern names the trailing parts of ``schema.table[.column]``, split and quoted as
# :func:`split_table` splits; each part is an fnmatch pattern over one exact name, and the
# leading parts a pattern leaves out match anything.


def split_pattern(pattern: str, most: int) -> tuple[str, ...]:
    """The parts of a name pattern (1 to ``most``); raises :class:`ContractError`."""
    parts: list[str] = []
    i = 0
    while True:
        part, i = _take_part(pattern, i)
        if not part:
            break
        parts.append(part)
        if i == len(pattern):
            if len(parts) <= most:
                return tuple(parts)
            break
        if not pattern.startswith(".", i):
            break
        i += 1
    shape = ".".join(("schema", "table", "column")[:most])
    raise ContractError(f"pattern {pattern!r} is not {shape} or its last parts (double-quote a name that holds a dot)")


class NameMatcher:
    """Whether a name (``schema, table`` or ``schema, table, column``) matches any of ``patterns``."""

    def __init__(self, patterns: Iterable[str], *, parts: int = 2) -> None:
        self.patterns: tuple[str, ...] = tuple(patterns)
        self._parsed = [split_pattern(p, parts) for p in self.patterns]
        self._cache: dict[tuple[str, ...], bool] = {}  # the same few names again and again

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def matches(self, *name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            hit = self._cache[name] = any(
                all(fnmatchcase(n, p) for n, p in zip(reversed(name), reversed(parts), strict=False))
                for parts in self._parsed
            )
        return hit

    def matches_table(self, qualified: str) -> bool:
        """For an event's ``table`` field (:func:`qualify_table`)."""
        return self.matches(*split_table(qualified))


# -- topic names --------------------------------------------------------------------------
# Kafka allows [A-Za-z0-9._-] and 249 characters. Each name part is escaped reversibly:
# letters, digits and '_' stay; every other character's UTF-8 bytes become '-HH' (upper-case
# hex); a '-' stays itself when it ends the name or comes before a character that stays
# itself, unless that starts two upper-case hex digits, so common names ('order_items',
# 'my-db') are unchanged and '--' never appears in an escaped part. A name too long for Kafka, or one that Kafka finds colliding ('.' and '_'
# are one character to its metric names), is cut and given the suffix '--' + 8 hex digits
# of a hash of its exact parts (docs/contract.md).

MAX_TOPIC_LENGTH: Final = 249
# A database topic leaves room for its side topics' suffixes ('.transaction' is the longest).
MAX_DATABASE_TOPIC_LENGTH: Final = MAX_TOPIC_LENGTH - 1 - max(len(s) for s in SIDE_TOPIC_SUFFIXES)
# fullmatch, never match with "$": "$" also matches before a final newline
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")
_SAFE_TOPIC_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_HEX_UPPER: Final = frozenset("0123456789ABCDEF")
_ESCAPED = re.compile(r"-([0-9A-F]{2})")
_TOPIC_PART_SAFE = re.compile(r"[A-Za-z0-9_]+")


def _plain_dash_before(name: str, i: int) -> bool:
    """Whether a '-' may stay itself before ``name[i:]``: not before an escape (that would
    make '--') nor before two upper-case hex digits (that would read as an escape)."""
    if name[i] not in _SAFE_TOPIC_CHARS:
        return False
    return not (i + 1 < len(name) and name[i] in _HEX_UPPER and name[i + 1] in _HEX_UPPER)


def escape_topic_part(name: str) -> str:
    """One topic-name part for a database, schema or table name (reversible)."""
    if _TOPIC_PART_SAFE.fullmatch(name):
        return name
    out: list[str] = []
    n = len(name)
    for i, ch in enumerate(name):
        if ch in _SAFE_TOPIC_CHARS:
            out.append(ch)
        elif ch == "-" and (i + 1 == n or _plain_dash_before(name, i + 1)):
            out.append("-")
        else:
            out.extend(f"-{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def unescape_topic_part(part: str) -> str:
    """Inverse of :func:`escape_topic_part`."""
    if "-" not in part:
        return part
    out = bytearray()
    i = 0
    while i < len(part):
        m = _ESCAPED.match(part, i)
        if m is not None:
            out.append(int(m.group(1), 16))
            i = m.end()
        else:
            out.extend(part[i].encode("utf-8"))
            i += 1
    return out.decode("utf-8", "surrogatepass")


def topic_name_error(name: str, *, limit: int = MAX_TOPIC_LENGTH) -> str | None:
    """Why Kafka would refuse ``name`` as a topic (``None``: it would not)."""
    if not _TOPIC_NAME.fullmatch(name) or len(name) > limit or name in (".", ".."):
        return f"must be a Kafka topic name ([A-Za-z0-9._-], at most {limit} characters), got {name!r}"
    return None


def _hashed_topic(head: str, parts: tuple[str, ...], escaped: list[str], limit: int = MAX_TOPIC_LENGTH) -> str:
    digest = hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:8]
    suffix = f"--{digest}"
    room = limit - len(head) - len(suffix) - (len(escaped) - 1)
    if room < 2 * len(escaped):
        raise ValueError(f"topic prefix {head!r} leaves no room for the table's name")
    # Share the room between the parts, the shorter ones keeping all they need.
    budget = [0] * len(escaped)
    left, pending = room, sorted(range(len(escaped)), key=lambda k: len(escaped[k]))
    while pending:
        k = pending.pop(0)
        budget[k] = min(len(escaped[k]), left // (len(pending) + 1))
        left -= budget[k]
    cut = [_cut_escaped(e, b) for e, b in zip(escaped, budget, strict=True)]
    return head + ".".join(cut) + suffix


def _cut_escaped(escaped: str, limit: int) -> str:
    """``escaped`` cut to ``limit`` characters, never inside an escape, never ending in '-'."""
    if len(escaped) <= limit:
        return escaped
    cut = escaped[:limit]
    j = cut.rfind("-", max(0, limit - 2))
    if j >= 0:
        cut = cut[:j]
    return cut.rstrip("-") or "_"


def database_topic(prefix: str, database: str) -> str:
    """The database topic's default name: ``<prefix>.<database>`` (database escaped), short
    enough for its side topics too."""
    head = f"{prefix}."
    escaped = escape_topic_part(database)
    if len(head) + len(escaped) <= MAX_DATABASE_TOPIC_LENGTH:
        return head + escaped
    return _hashed_topic(head, (database,), [escaped], MAX_DATABASE_TOPIC_LENGTH)


def demux_group(source_topic: str) -> str:
    """The demux's default consumer group for a database topic (also what ``Table`` follows)."""
    return f"walbus-demux.{source_topic}"


def table_topic(prefix: str, database: str, schema: str, table: str, *, hashed: bool = False) -> str:
    """The compacted per-table topic ``<prefix>.<database>.<schema>.<table>``, each part escaped.

    ``hashed``: the cut, hash-suffixed form, for a name Kafka finds colliding; a name
    longer than Kafka allows always takes it.
    """
    head = f"{prefix}.{escape_topic_part(database)}."
    escaped = [escape_topic_part(schema), escape_topic_part(table)]
    plain = head + ".".join(escaped)
    if not hashed and len(plain) <= MAX_TOPIC_LENGTH:
        return plain
    return _hashed_topic(head, (database, schema, table), escaped)


# -- heartbeats ----------------------------------------------------------------------------
# The producer's sign of life beside the database topic (docs/contract.md, heartbeats): one
# small JSON record per --heartbeat-interval, keyed by the slot so the topic can be compacted.

HEARTBEAT_SUFFIX: Final = "heartbeat"


def heartbeat_topic(source_topic: str) -> str:
    """``<database topic>.heartbeat``."""
    return side_topic(source_topic, HEARTBEAT_SUFFIX)


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat: which slot, how far Kafka has acknowledged (``confirmed_lsn``, what the
    slot is confirmed to), how far the producer has read (``received_lsn``), and when."""

    slot: str
    confirmed_lsn: int
    received_lsn: int
    ts_ms: int

    def key(self) -> bytes:
        return self.slot.encode()

    def to_json(self) -> bytes:
        return orjson.dumps({
            "v": CONTRACT_VERSION, "slot": self.slot, "confirmed_lsn": self.confirmed_lsn,
            "received_lsn": self.received_lsn, "ts_ms": self.ts_ms,
        })


def decode_heartbeat(value: bytes | str) -> Heartbeat:
    """A heartbeat record's value; :class:`ContractError` when it is not one."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise ContractError(f"heartbeat is not JSON: {e}") from None
    if type(obj) is not dict or obj.get("v") != CONTRACT_VERSION or type(obj.get("slot")) is not str:
        raise ContractError("heartbeat must be an object with v = 1 and a string slot")
    ints: list[int] = []
    for name in ("confirmed_lsn", "received_lsn", "ts_ms"):
        n = obj.get(name)
        if type(n) is not int or n < 0:
            raise ContractError(f"heartbeat field {name} must be a non-negative integer")
        ints.append(n)
    return Heartbeat(obj["slot"], *ints)


def heartbeats(
    values: Iterable[bytes | None], on_invalid: Callable[[bytes, ContractError], None] | None = None
) -> Iterator[Heartbeat]:
    """The heartbeats among a heartbeat topic's record values, in their order. A tombstone (a
    slot's heartbeats deleted) and a value that is no heartbeat tell nothing about how far the
    producers confirmed and are passed over: every reader of the topic (the client's
    ``HeartbeatWatch``, the warehouse load's cut) takes the same records as heartbeats.
    ``on_invalid(value, error)`` is told of each value that is no heartbeat (a tombstone is
    legal), so that a reader can log and count it rather than pass it over in silence."""
    for value in values:
        if value is None:
            continue
        try:
            yield decode_heartbeat(value)
        except ContractError as e:
            if on_invalid is not None:
                on_invalid(value, e)
