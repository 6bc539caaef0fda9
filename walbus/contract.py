"""The walbus message contract, version 1 (see docs/contract.md).

One Kafka record per row change on the database topic ``<prefix>.<database>``:

* key:   ``"%016X-%08X" % (commit_lsn, seq)``, ASCII; byte order == event order.
* value: one JSON object (orjson), fields in the order of :data:`FIELD_ORDER`.

This module is the only place that knows the wire form: producers build values
with :func:`encode_event`, consumers parse them with :func:`decode_event`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

CONTRACT_VERSION: Final = 1

Operation = Literal["insert", "update", "delete", "truncate", "read"]
OPERATIONS: Final[frozenset[str]] = frozenset({"insert", "update", "delete", "truncate", "read"})

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
    "columns",
    "types",
    "values",
    "identity",
    "unchanged",
)

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_KEY_TEXT = re.compile(rb"^[0-9A-F]{16}-[0-9A-F]{8}$")


class ContractError(ValueError):
    """A record does not follow the walbus message contract."""


class Lsn(int):
    """A PostgreSQL WAL position (``pg_lsn``): a 64-bit integer shown as ``X/X``."""

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> Lsn:
        m = _LSN_TEXT.match(text.strip())
        if m is None:
            raise ValueError(f"not an LSN: {text!r} (expected the form 16/B374D848)")
        return cls((int(m.group(1), 16) << 32) | int(m.group(2), 16))

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"


def event_key(commit_lsn: int, seq: int) -> bytes:
    """The database-topic key of an event: fixed width, sorts in event order."""
    return b"%016X-%08X" % (commit_lsn, seq)


def parse_event_key(key: bytes) -> tuple[int, int]:
    """Inverse of :func:`event_key`."""
    if _KEY_TEXT.match(key) is None:
        raise ContractError(f"not a walbus event key: {key[:40]!r}")
    return int(key[:16], 16), int(key[17:], 16)


@dataclass(frozen=True, slots=True)
class RowImage:
    """Column names, ``pg_type.typname`` type names and JSON values of one row."""

    columns: tuple[str, ...]
    types: tuple[str, ...]
    values: tuple[Any, ...]

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self.columns, self.values, strict=True))

    def to_json_obj(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "types": list(self.types), "values": list(self.values)}


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

    @property
    def key(self) -> bytes:
        return event_key(self.commit_lsn, self.seq)

    @property
    def position(self) -> tuple[int, int]:
        """``(commit_lsn, seq)``: unique, and ordered as the commits."""
        return (self.commit_lsn, self.seq)

    @property
    def schema_name(self) -> str:
        return self.table.split(".", 1)[0]

    @property
    def table_name(self) -> str:
        return self.table.split(".", 1)[1]

    def row(self) -> dict[str, Any] | None:
        """The new row as a dict (``None`` on delete and truncate)."""
        return self.new.as_dict() if self.new is not None else None

    def key_values(self) -> dict[str, Any] | None:
        """Primary-key values in key order, from the new row or else the identity."""
        if not self.pk:
            return None
        for image in (self.new, self.identity):
            if image is not None:
                d = image.as_dict()
                if all(c in d for c in self.pk):
                    return {c: d[c] for c in self.pk}
        return None

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
) -> bytes:
    """Serialize one event. ``new``/``identity`` are ``{columns, types, values}`` dicts."""
    obj: dict[str, Any] = {
        "v": CONTRACT_VERSION,
        "lsn": lsn,
        "commit_lsn": commit_lsn,
        "seq": seq,
        "xid": xid,
        "operation": operation,
        "table": table,
        "timestamp": timestamp,
        "pk": pk,
    }
    if new is not None:
        obj["columns"] = new["columns"]
        obj["types"] = new["types"]
        obj["values"] = new["values"]
    if identity is not None:
        obj["identity"] = identity
    if unchanged:
        obj["unchanged"] = unchanged
    return orjson.dumps(obj)


def _image(obj: dict[str, Any], where: str) -> RowImage:
    try:
        columns, types, values = obj["columns"], obj["types"], obj["values"]
    except (KeyError, TypeError) as e:
        raise ContractError(f"{where}: needs columns, types and values") from e
    if not (isinstance(columns, list) and isinstance(types, list) and isinstance(values, list)):
        raise ContractError(f"{where}: columns, types and values must be lists")
    if not len(columns) == len(types) == len(values):
        raise ContractError(f"{where}: columns, types and values differ in length")
    return RowImage(tuple(columns), tuple(types), tuple(values))


def _int_field(obj: dict[str, Any], name: str) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ContractError(f"field {name!r} must be an integer, got {v!r}")
    return v


def decode_event(value: bytes | str) -> ChangeEvent:
    """Parse and validate one database-topic value; raises :class:`ContractError`."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise ContractError(f"value is not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ContractError("value is not a JSON object")
    version = obj.get("v")
    if version != CONTRACT_VERSION:
        raise ContractError(f"unknown contract version {version!r} (this build reads v{CONTRACT_VERSION})")
    operation = obj.get("operation")
    if operation not in OPERATIONS:
        raise ContractError(f"unknown operation {operation!r}")
    table = obj.get("table")
    if not isinstance(table, str) or "." not in table:
        raise ContractError(f"field 'table' must be 'schema.table', got {table!r}")
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, str):
        raise ContractError("field 'timestamp' must be a string")
    pk = obj.get("pk", [])
    if not isinstance(pk, list):
        raise ContractError("field 'pk' must be a list")
    new = _image(obj, "row") if "columns" in obj else None
    if new is None and operation in ("insert", "update", "read"):
        raise ContractError(f"{operation} event without columns/types/values")
    ident = obj.get("identity")
    identity = _image(ident, "identity") if ident is not None else None
    unchanged = obj.get("unchanged", [])
    if not isinstance(unchanged, list):
        raise ContractError("field 'unchanged' must be a list")
    return ChangeEvent(
        lsn=_int_field(obj, "lsn"),
        commit_lsn=_int_field(obj, "commit_lsn"),
        seq=_int_field(obj, "seq"),
        xid=_int_field(obj, "xid"),
        operation=operation,
        table=table,
        timestamp=timestamp,
        pk=tuple(pk),
        new=new,
        identity=identity,
        unchanged=tuple(unchanged),
    )


def default_topic(database: str, prefix: str = "walbus") -> str:
    """The database topic's default name."""
    return f"{prefix}.{database}"


def table_topic(prefix: str, database: str, table: str) -> str:
    """The compacted per-table topic: ``<prefix>.<database>.<schema>.<table>``."""
    return f"{prefix}.{database}.{table}"
