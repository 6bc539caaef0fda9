"""Column metadata (the contract's not_null and typmods) from both plugins' decoders, no services."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import pytest

from producer.catalog import TableInfo, modifiers_from_text, type_modifiers
from producer.codec import CaptureFilter, EncodedEvent, EventEncoder, Relation
from producer.decoders import flat
from producer.decoders.pgoutput import PgoutputDecoder
from producer.decoders.wal2json import Wal2jsonDecoder
from tests.support.catalog import StaticCatalog
from walbus.contract import decode_event

# (typname, atttypmod, format_type's text, the event's modifier): atttypmod as PostgreSQL 15 stores it.
CASES = [
    ("numeric", ((12 << 16) | 2) + 4, "numeric(12,2)", [12, 2]),
    ("numeric", ((12 << 16) | 0) + 4, "numeric(12,0)", [12, 0]),
    ("numeric", ((5 << 16) | (-2 & 0x7FF)) + 4, "numeric(5,-2)", [5, -2]),
    ("numeric", ((3 << 16) | 5) + 4, "numeric(3,5)", [3, 5]),
    ("numeric", -1, "numeric", None),
    ("_numeric", ((10 << 16) | 3) + 4, "numeric(10,3)[]", [10, 3]),
    ("varchar", 44, "character varying(40)", [40]),
    ("_varchar", 14, "character varying(10)[]", [10]),
    ("varchar", -1, "character varying", None),
    ("bpchar", 7, "character(3)", [3]),
    ("bit", 8, "bit(8)", [8]),
    ("varbit", 20, "bit varying(20)", [20]),
    ("timestamp", 3, "timestamp(3) without time zone", [3]),
    ("timestamptz", 0, "timestamp(0) with time zone", [0]),
    ("timestamptz", -1, "timestamp with time zone", None),
    ("time", 6, "time(6) without time zone", [6]),
    ("timetz", 2, "time(2) with time zone", [2]),
    ("interval", (0x7FFF << 16) | 3, "interval(3)", [3]),
    ("interval", (0x0C00 << 16) | 0xFFFF, "interval hour to minute", None),
    ("text", -1, "text", None),
    ("geometry", 1107460, "geometry(Point,4326)", None),  # an extension's modifier: not carried
]


@pytest.mark.parametrize(("typname", "typmod", "declared", "want"), CASES)
def test_modifiers_from_atttypmod_and_from_format_type_agree(typname: str, typmod: int, declared: str, want: Any) -> None:
    assert type_modifiers(typname, typmod) == want
    assert modifiers_from_text(typname, declared) == want


def _rel(capture: CaptureFilter) -> Relation:
    return Relation(
        1, "public", "t", ["id", "amount", "name", "secret"], ["int4", "numeric", "varchar", "varchar"],
        [True, False, False, False], ["id"], not_null=[True, True, False, True], modifiers=[None, [12, 2], [40], [8]],
    ).prepare(capture)


def test_every_event_of_a_relation_carries_its_kept_columns_metadata() -> None:
    enc = EventEncoder()
    enc.begin(100, 7, "t")
    r = _rel(CaptureFilter(exclude_columns=("secret",)))
    events = [
        enc.insert(r, 1, [1, "1.50", "x", "s"]),
        enc.encode(r, "update", 2, [1, "2.50", None, "s"], unchanged=[2]),
        enc.encode(r, "delete", 3, None, old=[1, None, None, None]),
        enc.truncate(r, 4),
    ]
    for ev in events:
        obj = orjson.loads(ev.value)
        assert obj["not_null"] == ["id", "amount"]  # secret is excluded: not named
        assert obj["typmods"] == {"amount": [12, 2], "name": [40]}
        decoded = decode_event(ev.value)
        assert decoded.not_null == ("id", "amount")
    types = decode_event(events[0].value).column_types()
    assert types["amount"].declared == "numeric(12,2)" and not types["amount"].nullable
    assert types["name"].length == 40 and types["name"].nullable


def test_a_relation_without_metadata_writes_none() -> None:
    enc = EventEncoder()
    r = Relation(1, "public", "t", ["id"], ["int4"], [True], []).prepare(CaptureFilter())
    obj = orjson.loads(enc.insert(r, 1, [1]).value)
    assert "not_null" not in obj and "typmods" not in obj


def current_catalog() -> StaticCatalog:
    """The catalog as it is now: amount numeric(12,2) NOT NULL, name varchar(40)."""
    return StaticCatalog.of(
        {23: "int4", 1700: "numeric", 1043: "varchar"},
        TableInfo(
            "public", "t", ("id", "amount", "name"), (23, 1700, 1043), ("id",), "d", ("id",),
            (-1, ((12 << 16) | 2) + 4, 44), ("id", "amount"),
        ),
    )


def _relation_message(amount_typmod: int) -> bytes:
    out = b"R" + struct.pack(">I", 99) + b"public\0t\0d" + struct.pack(">H", 3)
    for flag, name, oid, typmod in [(1, b"id", 23, -1), (0, b"amount", 1700, amount_typmod), (0, b"name", 1043, 44)]:
        out += bytes([flag]) + name + b"\0" + struct.pack(">Ii", oid, typmod)
    return out


def _pg_insert(*values: bytes) -> bytes:
    body = struct.pack(">H", len(values))
    for v in values:
        body += b"t" + struct.pack(">I", len(v)) + v
    return b"I" + struct.pack(">I", 99) + b"N" + body


def _typmods(items: list[Any]) -> list[Any]:
    return [orjson.loads(i.value).get("typmods") for i in items if isinstance(i, EncodedEvent)]


def test_pgoutput_takes_typmods_from_each_relation_message_and_not_null_from_the_catalog() -> None:
    dec = PgoutputDecoder(current_catalog(), CaptureFilter())
    begin = b"B" + struct.pack(">QqI", 0x200, 0, 42)
    out = list(flat(dec.decode([
        (1, begin), (2, _relation_message(((12 << 16) | 2) + 4)), (3, _pg_insert(b"1", b"1.50", b"a")),
        # ALTER TABLE … TYPE numeric(14,4) inside the transaction: a new Relation message
        (4, _relation_message(((14 << 16) | 4) + 4)), (5, _pg_insert(b"2", b"1.5000", b"b")),
    ])))
    assert _typmods(out) == [{"amount": [12, 2], "name": [40]}, {"amount": [14, 4], "name": [40]}]
    assert all(orjson.loads(i.value)["not_null"] == ["id", "amount"] for i in out if isinstance(i, EncodedEvent))


def _w2j_insert(amount_type: str, amount: str, *, optional: bool | None = False) -> bytes:
    amount_col: dict[str, Any] = {"name": "amount", "type": amount_type, "typeoid": 1700, "value": amount}
    if optional is not None:
        amount_col["optional"] = optional
    return orjson.dumps({"action": "I", "schema": "public", "table": "t", "lsn": "0/10", "columns": [
        {"name": "id", "type": "integer", "typeoid": 23, "value": 1, "optional": False},
        amount_col,
        {"name": "name", "type": "character varying(40)", "typeoid": 1043, "value": "a", "optional": True},
    ]})


def test_wal2json_follows_the_declared_type_of_each_change() -> None:
    dec = Wal2jsonDecoder(current_catalog(), CaptureFilter())
    begin = orjson.dumps({"action": "B", "xid": 5, "timestamp": "2026-01-01 00:00:00+00", "lsn": "0/20"})
    out = list(flat(dec.decode([
        (1, begin), (2, _w2j_insert("numeric(12,2)", "1.50")), (3, _w2j_insert("numeric(12,2)", "2.50")),
        (4, _w2j_insert("numeric(14,4)", "1.5000")),  # the same type oid, another modifier
        (5, _w2j_insert("numeric(14,4)", "1.5000", optional=True)),  # SET NOT NULL dropped
    ])))
    assert _typmods(out) == [{"amount": [12, 2], "name": [40]}] * 2 + [{"amount": [14, 4], "name": [40]}] * 2
    not_null = [orjson.loads(i.value).get("not_null") for i in out if isinstance(i, EncodedEvent)]
    assert not_null == [["id", "amount"]] * 3 + [["id"]]


def test_wal2json_relation_from_an_updates_own_columns_names_each_column_once() -> None:
    """An update whose columns do not match the catalog (amount retyped since) builds its
    relation from the change's own columns: the new row's and the identity's. The key column
    is in both; it used to appear twice in the event, the first time as an unchanged null."""
    dec = Wal2jsonDecoder(current_catalog(), CaptureFilter())
    begin = orjson.dumps({"action": "B", "xid": 5, "timestamp": "2026-01-01 00:00:00+00", "lsn": "0/20"})
    update = orjson.dumps({"action": "U", "schema": "public", "table": "t", "lsn": "0/30", "columns": [
        {"name": "id", "type": "integer", "typeoid": 23, "value": 1},
        {"name": "amount", "type": "integer", "typeoid": 23, "value": 7},  # int4 then, numeric in the catalog now
        {"name": "name", "type": "character varying(40)", "typeoid": 1043, "value": "a"},
    ], "identity": [{"name": "id", "type": "integer", "typeoid": 23, "value": 1}]})
    out = [orjson.loads(i.value) for i in dec.decode([(1, begin), (2, update)]) if isinstance(i, EncodedEvent)]
    assert len(out) == 1
    event = out[0]
    assert event["columns"] == ["id", "amount", "name"]
    assert event["values"] == [1, 7, "a"]
    assert event["types"] == ["int4", "int4", "varchar"]
    assert "unchanged" not in event or event["unchanged"] == []
    assert event["identity"]["columns"] == ["id"] and event["identity"]["values"] == [1]
