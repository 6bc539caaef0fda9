"""decode_event's fast paths (the compiled decoder, when built, and msgspec) against its
reference path: the same event or the same error."""

from __future__ import annotations

import json
import shutil
from typing import Any

import msgspec
import orjson
from hypothesis import given
from hypothesis import strategies as st

from tests.support.prop import strict
from tests.unit.test_prop_contract import events
from walbus.contract import (
    ChangeEvent,
    ContractError,
    RowImage,
    _decode_checked,
    _decode_native,
    _decode_wire,
    _from_wire,
    check_key,
    decode_event,
    decode_keyed_event_as,
    encode_event,
    event_key,
    try_decode_keyed_event,
)
from walbus.native import switched_off


def _image(image: RowImage | None) -> Any:
    return None if image is None else (image.columns, image.types, strict(image.values))


def _outcome(decode: Any, raw: bytes) -> tuple[Any, ...]:
    try:
        ev = decode(raw)
    except ContractError as e:
        return ("error", str(e))
    assert type(ev) is ChangeEvent
    return ("event", ev.lsn, ev.commit_lsn, ev.seq, ev.xid, ev.operation, ev.table, ev.timestamp, ev.pk,
            _image(ev.new), _image(ev.identity), ev.unchanged, type(ev.pk), type(ev.unchanged),
            ev.not_null, type(ev.not_null), dict(ev.typmods), sorted({type(m) for m in ev.typmods.values()}, key=str))


def _msgspec_path(raw: bytes) -> ChangeEvent:
    try:
        event = _from_wire(_decode_wire(raw), ChangeEvent)
    except (msgspec.DecodeError, ValueError, RecursionError):
        event = None
    return _decode_checked(raw, ChangeEvent) if event is None else event


def _agree(raw: bytes) -> tuple[Any, ...]:
    reference = _outcome(lambda v: _decode_checked(v, ChangeEvent), raw)
    assert _outcome(decode_event, raw) == reference
    assert _outcome(_msgspec_path, raw) == reference
    if _decode_native is not None:
        native = _decode_native(raw, ChangeEvent)  # None: declined, the paths above decide
        if native is not None:
            assert _outcome(lambda _: native, raw) == reference
    return reference


def test_the_native_decoder_is_there_where_it_can_be_built() -> None:
    """CI builds the extension (scripts/setup.sh): a build without it would test one path less."""
    assert _decode_native is not None or shutil.which("cargo") is None or switched_off()


def test_the_native_decoder_takes_the_producers_usual_events() -> None:
    if _decode_native is None:
        return  # pure Python here (see the test above)
    for kw in USUAL:
        raw = encode_event(**kw)
        native = _decode_native(raw, ChangeEvent)
        assert native is not None, kw
        assert _outcome(lambda _, event=native: event, raw) == _outcome(lambda v: _decode_checked(v, ChangeEvent), raw)
        key = event_key(kw["commit_lsn"], kw["seq"])
        assert decode_keyed_event_as(key, raw, ChangeEvent) == native


USUAL: list[dict[str, Any]] = [
    {"lsn": 10, "commit_lsn": 20, "seq": 0, "xid": 7, "operation": "insert", "table": "public.orders",
     "timestamp": "2024-05-01T12:00:00.000001+00:00", "pk": ["id"], "not_null": ["id"], "typmods": {"amount": [12, 2]},
     "new": {"columns": ["id", "amount", "note", "ok", "ratio"], "types": ["int4", "numeric", "text", "bool", "float8"],
             "values": [1, "12.50", 'a "quoted"\n ünïcode \u0000 text', True, 0.25]}, "identity": None},
    {"lsn": 11, "commit_lsn": 20, "seq": 1, "xid": 7, "operation": "update", "table": "public.orders", "timestamp": "t",
     "pk": ["id"], "new": {"columns": ["id", "note"], "types": ["int4", "text"], "values": [1, None]},
     "identity": {"columns": ["id"], "types": ["int4"], "values": [2]}, "unchanged": ["note"]},
    {"lsn": 12, "commit_lsn": 20, "seq": 2, "xid": 7, "operation": "delete", "table": "s.t", "timestamp": "t",
     "pk": [], "new": None, "identity": {"columns": ["a"], "types": ["text"], "values": ["x"]}},
    {"lsn": 2**63 - 1, "commit_lsn": 2**63 - 1, "seq": 2**32 - 1, "xid": 2**63 - 1, "operation": "truncate",
     "table": "public.t", "timestamp": "t", "pk": [], "new": None, "identity": None},
]


@given(events())
def test_valid_events_decode_alike(kw: dict[str, Any]) -> None:
    _agree(encode_event(**kw))


# What a broken or hostile writer might put anywhere in a value.
JUNK = st.one_of(
    st.sampled_from([None, True, False, 0, 1, -1, 1.0, -0.0, 1e300, 2**31, 2**32, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1,
                     2**64, -(2**63), -(2**63) - 1, "", "x", "insert", "a.b", '"a.b".c', ".a", "a.", [], [1], ["a"],
                     [[1]], {}, {"columns": [], "types": [], "values": []}, {"a": 1}]),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
FIELDS = ["v", "lsn", "commit_lsn", "seq", "xid", "operation", "table", "timestamp", "pk", "columns", "types",
          "values", "identity", "unchanged", "not_null", "typmods", "extra"]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    obj: dict[str, Any] = orjson.loads(encode_event(**draw(events())))
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(FIELDS))
        how = draw(st.sampled_from(["set", "drop", "move", "element", "identity"]))
        if how == "drop":
            obj.pop(name, None)
        elif how == "move":  # the field last: out of the producer's order (the decoder's guess)
            if name in obj:
                obj[name] = obj.pop(name)
        elif how == "element" and isinstance(obj.get(name), list) and obj[name]:
            obj[name][draw(st.integers(0, len(obj[name]) - 1))] = draw(JUNK)
        elif how == "identity":
            part = draw(st.sampled_from(["columns", "types", "values", "extra"]))
            ident = obj.get("identity") if isinstance(obj.get("identity"), dict) else {"columns": ["a"], "types": ["int4"], "values": [1]}
            obj["identity"] = {**ident, part: draw(JUNK)}
        else:
            obj[name] = draw(JUNK)
    return json.dumps(obj, ensure_ascii=draw(st.booleans())).encode()  # orjson refuses integers beyond 64 bits


@given(mutated())
def test_mutated_events_decode_alike(raw: bytes) -> None:
    _agree(raw)


@given(events(), st.lists(st.tuples(st.integers(0, 400), st.binary(max_size=3)), min_size=1, max_size=3))
def test_byte_edits_decode_alike(kw: dict[str, Any], edits: list[tuple[int, bytes]]) -> None:
    raw = bytearray(encode_event(**kw))
    for at, insert in edits:
        at %= len(raw)
        raw[at : at + (1 if insert else 0)] = insert or raw[at : at + 1] * 2
    _agree(bytes(raw))


def test_edge_values_decode_alike() -> None:
    head = b'{"v":1,"lsn":1,"commit_lsn":2,"seq":0,"xid":3,"operation":"insert","table":"public.t","timestamp":"t",'
    for values in [b"18446744073709551615", b"18446744073709551616", b"-9223372036854775809", b"9223372036854775807",
                   b"1e2", b"-0", b"-0.0", b"1e-400", b"1e400", b'"\\ud800"', b'"\xed\xa0\x80"', b'"\xff"', b"[1]",
                   b'{"a":1}', b"true", b"null", b'"\\u0000"']:
        _agree(head + b'"pk":[],"columns":["a"],"types":["x"],"values":[' + values + b"]}")
    for extra in [b'"x":"\xff"', b'"x":1e400', b'"\xff":1', b'"\\u0076":2', b'"v":true', b'"x":' + b"[" * 1100 + b"]" * 1100,
                  b'"columns":null', b'"identity":null', b'"pk":null', b'"unchanged":null', b'"table":"\\"a.b\\".c"',
                  b'"table":"a.b.c"', b'"lsn":18446744073709551615', b'"seq":4294967296', b'"operation":"upsert"']:
        _agree(head + b'"columns":["a"],"types":["x"],"values":[1],' + extra + b"}")
    assert _agree(head + b'"columns":["a"],"types":["x"],"values":[1]}')[0] == "event"
    assert _agree(head + b'"pk":[]}')[0] == "error"  # an insert without a row
    assert _agree(head.replace(b"insert", b"delete") + b'"types":null}')[0] == "event"  # no columns: no row


def test_what_the_native_decoder_caches_is_checked_as_each_field_needs() -> None:
    """The compiled decoder keeps the objects of repeated names and strings. A string one field
    accepts (an empty timestamp, a null not_null) must not pass where another field refuses it
    (an empty table name, a null pk): found by the property test above, in one process."""
    head = b'{"v":1,"lsn":1,"commit_lsn":2,"seq":0,"xid":3,"operation":"delete",'
    for first, second in [
        (b'"table":"public.t","timestamp":"","pk":[]}', b'"table":"","timestamp":"t","pk":[]}'),
        (b'"table":"public.t","timestamp":"t","not_null":null}', b'"table":"public.t","timestamp":"t","pk":null}'),
        (b'"table":"public.t","timestamp":"t","pk":["a"],"not_null":["a"]}', b'"table":"public.t","timestamp":"t","pk":["a"]}'),
    ]:
        assert _agree(head + first)[0] == "event"
        _agree(head + second)


def _keyed_outcome(decode: Any, key: Any, raw: bytes) -> tuple[Any, ...]:
    def event(_: bytes) -> ChangeEvent:
        return decode(key, raw)  # type: ignore[no-any-return]

    return _outcome(event, raw)


def _reference_keyed(key: Any, raw: bytes) -> ChangeEvent:
    event = _decode_checked(raw, ChangeEvent)
    check_key(key, event)
    return event


def _keys(commit_lsn: int, seq: int) -> dict[str, Any]:
    key = event_key(commit_lsn, seq)
    return {"canonical": key, "lower": key.lower(), "short": key[1:], "long": b"0" + key, "next": event_key(commit_lsn, (seq + 1) % 2**32),
            "separator": key.replace(b"-", b":"), "none": None}


@given(events(), st.sampled_from(sorted(_keys(0, 0))))
def test_keyed_records_decode_alike(kw: dict[str, Any], which: str) -> None:
    """The compiled keyed decoder takes the position's one key text and declines every other
    key; decode_keyed_event_as then decides as the reference does (key first parsed, then checked)."""
    raw = encode_event(**kw)
    key = _keys(kw["commit_lsn"], kw["seq"])[which]
    reference = _keyed_outcome(lambda k, v: _reference_keyed(k, v), key, raw)
    assert _keyed_outcome(lambda k, v: decode_keyed_event_as(k, v, ChangeEvent), key, raw) == reference
    if try_decode_keyed_event is None:
        return
    native = try_decode_keyed_event(key, raw, ChangeEvent)
    if key != event_key(kw["commit_lsn"], kw["seq"]):
        assert native is None  # the Python path decides every other key
    elif _decode_native is not None and _decode_native(raw, ChangeEvent) is not None:
        assert native is not None and _keyed_outcome(lambda _k, _v: native, key, raw) == reference


def test_the_keyed_decoder_declines_what_is_not_bytes() -> None:
    if try_decode_keyed_event is None:
        return
    raw = encode_event(**USUAL[0])
    key = event_key(USUAL[0]["commit_lsn"], USUAL[0]["seq"])
    assert try_decode_keyed_event(key, raw, ChangeEvent) is not None
    for k, v in ((key, None), (None, raw), (key, raw.decode()), (bytearray(key), raw), (key, memoryview(raw))):
        assert try_decode_keyed_event(k, v, ChangeEvent) is None
    # Wider than the key's width: Python's %X would print more digits; the Python path decides.
    big = {**USUAL[0], "seq": 0}
    assert try_decode_keyed_event(event_key(big["commit_lsn"], 0), encode_event(**big), ChangeEvent) is not None


def test_the_native_decoder_stores_slots_directly_and_falls_back_where_it_cannot() -> None:
    """Slotted event classes (ChangeEvent, the client's FeedEvent, their slotted subclasses)
    get plain slot stores; a class whose attribute is not a slot goes through its descriptors,
    and every class decodes to equal events."""
    from dataclasses import dataclass, fields

    from walbus.client.event import FeedEvent
    from walbus.contract import _native_decoder

    if _native_decoder is None:
        return

    @dataclass(frozen=True, slots=True)
    class Tagged(ChangeEvent):
        tag: str = ""

    class WithDict(ChangeEvent):
        pass

    class Computed(ChangeEvent):
        __slots__ = ()
        xid = property(lambda self: 0)  # type: ignore[assignment]

    for cls in (ChangeEvent, FeedEvent, Tagged, WithDict):
        assert _native_decoder.stores_directly(cls), cls
    assert not _native_decoder.stores_directly(Computed)
    raw = encode_event(**USUAL[0])
    expected = decode_event(raw)
    for cls in (ChangeEvent, FeedEvent, Tagged, WithDict):
        event = _native_decoder.decode(raw, cls)
        assert type(event) is cls
        assert all(getattr(event, f.name) == getattr(expected, f.name) for f in fields(ChangeEvent))
