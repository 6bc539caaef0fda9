"""The fast decode_event against the straightforward one it replaced (the oracle, kept here).

On random valid events and on random damage to them (a field dropped, or set to another
JSON value of any type; raw bytes that are no JSON object), both must accept the same
inputs with equal events (values compared with their JSON types), and refuse the same
inputs with the same ContractError text. No services.
"""

from __future__ import annotations

import json
from typing import Any, cast

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.prop import json_values, strict
from tests.unit.test_prop_contract import events
from walbus.contract import (
    CONTRACT_VERSION,
    FIELD_BITS,
    FIELD_ORDER,
    OPERATIONS,
    ROW_OPERATIONS,
    ChangeEvent,
    ContractError,
    Operation,
    RowImage,
    check_key,
    decode_event,
    encode_event,
    event_key,
    split_table,
)

# -- the oracle: decode_event as it was before it was made fast ------------------------------


def _ref_image(obj: dict[str, Any], where: str) -> RowImage:
    try:
        columns, types, values = obj["columns"], obj["types"], obj["values"]
    except (KeyError, TypeError) as e:
        raise ContractError(f"{where}: needs columns, types and values") from e
    if not (isinstance(columns, list) and isinstance(types, list) and isinstance(values, list)):
        raise ContractError(f"{where}: columns, types and values must be lists")
    if not len(columns) == len(types) == len(values):
        raise ContractError(f"{where}: columns, types and values differ in length")
    _ref_check_names(columns, f"{where} columns")
    _ref_check_names(types, f"{where} types")
    return RowImage(tuple(columns), tuple(types), tuple(values))


def _ref_check_names(names: list[Any], where: str) -> None:
    if not all(isinstance(n, str) for n in names):
        raise ContractError(f"{where}: names must be strings")


def _ref_int_field(obj: dict[str, Any], name: str) -> int:
    v, bits = obj.get(name), FIELD_BITS[name]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ContractError(f"field {name!r} must be an integer, got {v!r}")
    if not 0 <= v < 1 << bits:
        raise ContractError(f"field {name!r} is out of range: {v}")
    return v


def reference_decode(value: bytes | str) -> ChangeEvent:
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise ContractError(f"value is not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ContractError("value is not a JSON object")
    version = obj.get("v")
    if type(version) is not int or version != CONTRACT_VERSION:  # true and 1.0 equal 1 in Python
        raise ContractError(f"unknown contract version {version!r} (this build reads v{CONTRACT_VERSION})")
    operation = obj.get("operation")
    if not isinstance(operation, str) or operation not in OPERATIONS:
        raise ContractError(f"unknown operation {operation!r}")
    table = obj.get("table")
    if not isinstance(table, str):
        raise ContractError(f"field 'table' must be 'schema.table', got {table!r}")
    split_table(table)
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, str):
        raise ContractError("field 'timestamp' must be a string")
    pk = obj.get("pk", [])
    if not isinstance(pk, list):
        raise ContractError("field 'pk' must be a list")
    _ref_check_names(pk, "pk")
    not_null = obj.get("not_null")
    if not_null is None:
        not_null = []
    if not isinstance(not_null, list):
        raise ContractError("field 'not_null' must be a list")
    _ref_check_names(not_null, "not_null")
    typmods = _ref_typmods(obj.get("typmods"))
    new = _ref_image(obj, "row") if "columns" in obj else None
    if new is None and operation in ROW_OPERATIONS:
        raise ContractError(f"{operation} event without columns/types/values")
    ident = obj.get("identity")
    identity = _ref_image(ident, "identity") if ident is not None else None
    unchanged = obj.get("unchanged", [])
    if not isinstance(unchanged, list):
        raise ContractError("field 'unchanged' must be a list")
    _ref_check_names(unchanged, "unchanged")
    return ChangeEvent(
        lsn=_ref_int_field(obj, "lsn"), commit_lsn=_ref_int_field(obj, "commit_lsn"), seq=_ref_int_field(obj, "seq"),
        xid=_ref_int_field(obj, "xid"), operation=cast(Operation, operation), table=table, timestamp=timestamp,
        pk=tuple(pk), new=new, identity=identity, unchanged=tuple(unchanged), not_null=tuple(not_null), typmods=typmods,
    )


def _ref_typmods(obj: Any) -> dict[str, tuple[int, ...]]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ContractError("field 'typmods' must be an object")
    for mods in obj.values():
        if not isinstance(mods, list) or not all(
            isinstance(m, int) and not isinstance(m, bool) and -(2**31) <= m < 2**31 for m in mods
        ):
            raise ContractError("field 'typmods' must map each column to a list of 32-bit integers")
    return {name: tuple(mods) for name, mods in obj.items()}


def reference_check_key(key: bytes | None, event: ChangeEvent) -> None:
    from walbus.contract import parse_event_key

    if key is None or parse_event_key(key) != (event.commit_lsn, event.seq):
        shown = key[:40] if key is not None else None
        raise ContractError(f"key {shown!r} is not the event's position {event_key(event.commit_lsn, event.seq)!r}")


# -- comparison ---------------------------------------------------------------------------


def _outcome(decode: Any, raw: bytes | str) -> tuple[str, Any]:
    try:
        ev = decode(raw)
    except ContractError as e:
        return ("refused", str(e))
    images = [None if im is None else (im.columns, im.types, strict(im.values)) for im in (ev.new, ev.identity)]
    return ("accepted", (strict([ev.lsn, ev.commit_lsn, ev.seq, ev.xid]), ev.operation, ev.table, ev.timestamp,
                         ev.pk, images, ev.unchanged, ev.not_null, ev.typmods))


def assert_same(raw: bytes | str) -> tuple[str, Any]:
    want = _outcome(reference_decode, raw)
    got = _outcome(decode_event, raw)
    assert got == want, raw
    return got


# Values a field may be damaged into: every JSON type, and the edges of the integer fields.
_EDGE_INTS = [-1, 0, 1, -(2**31), -(2**31) - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64]
_NAMES_DAMAGE = st.lists(st.one_of(st.text(max_size=3), json_values), max_size=3)
damage = st.one_of(
    json_values,
    st.sampled_from(_EDGE_INTS),
    st.sampled_from([1.0, True, False, "1", [], {}, [1], ["a"], "public.t", 'public."a.b"', '"a.b', "a.", ".b",
                     *sorted(OPERATIONS), "INSERT"]),
    _NAMES_DAMAGE,
    st.fixed_dictionaries({}, optional={"columns": _NAMES_DAMAGE, "types": _NAMES_DAMAGE, "values": _NAMES_DAMAGE}),
    st.dictionaries(st.text(max_size=3), st.one_of(st.lists(st.sampled_from([*_EDGE_INTS, 1.0, True]), max_size=2), json_values),
                    max_size=2),
)
_FIELDS = [*FIELD_ORDER, "extra"]


def dumps(obj: Any) -> bytes:
    """JSON text of a damaged event: the stdlib writes integers past 64 bits (2**64), orjson does not."""
    return json.dumps(obj, ensure_ascii=False).encode()


@given(events())
def test_valid_events_decode_alike(kw: dict[str, Any]) -> None:
    raw = encode_event(**kw)
    assert assert_same(raw)[0] == "accepted"
    assert assert_same(raw.decode())[0] == "accepted"
    ev = decode_event(raw)
    assert ev == reference_decode(raw)
    check_key(event_key(ev.commit_lsn, ev.seq), ev)


@given(events(), st.lists(st.tuples(st.sampled_from(_FIELDS), st.one_of(st.none(), damage)), min_size=1, max_size=3),
       st.booleans())
def test_damaged_events_decode_alike(kw: dict[str, Any], changes: list[tuple[str, Any]], drop_none: bool) -> None:
    obj = orjson.loads(encode_event(**kw))
    for name, value in changes:
        if value is None and drop_none:
            obj.pop(name, None)
        else:
            obj[name] = value
    assert_same(dumps(obj))


@given(st.one_of(st.binary(max_size=40), st.text(max_size=40), json_values.map(orjson.dumps),
                 st.lists(json_values, max_size=3).map(orjson.dumps)))
def test_junk_decodes_alike(raw: bytes | str) -> None:
    assert assert_same(raw)[0] == "refused"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"v":true}', b'{"v":1.0,"operation":"delete"}', b"[1]", b"\xff", b'{"v":1,"operation":["insert"]}',
        b'{"v":1,"operation":"delete","table":"a.b","timestamp":"t","pk":null}',
        b'{"v":1,"operation":"delete","table":"a.b","timestamp":"t","lsn":18446744073709551616}',
        b'{"v":1,"operation":"delete","table":"a.b","timestamp":"t","lsn":1,"commit_lsn":1,"seq":1,"xid":true}',
        b'{"v":1,"operation":"delete","table":"a.b","timestamp":"t","identity":[]}',
        b'{"v":1,"operation":"delete","table":"\\"a.b\\".c","timestamp":"t","lsn":1,"commit_lsn":1,"seq":1,"xid":1}',
        b'{"v":1,"operation":"delete","table":"\\"a.b\\"c","timestamp":"t"}',
        b'{"v":1,"operation":"delete","table":"a.b.c","timestamp":"t"}',
        b'{"v":1,"operation":"delete","table":".b","timestamp":"t"}',
        b'{"v":1,"operation":"delete","table":"a.","timestamp":"t"}',
        b'{"v":1,"operation":"insert","table":"a.b","timestamp":"t","columns":["a"],"types":[1],"values":[1]}',
    ],
)
def test_edge_cases_decode_alike(raw: bytes) -> None:
    assert_same(raw)


@pytest.mark.parametrize("name", sorted(FIELD_BITS))
@pytest.mark.parametrize("shift", [-1, 0])  # limit - 1 and 0 are in range, limit and -1 not
@pytest.mark.parametrize("kind", ["limit", "zero", "bool", "float", "absent"])
def test_integer_field_edges_decode_alike(name: str, shift: int, kind: str) -> None:
    obj = orjson.loads(encode_event(
        lsn=1, commit_lsn=2, seq=3, xid=4, operation="delete", table="public.t", timestamp="t", pk=[], new=None,
        identity=None,
    ))
    limit = 1 << FIELD_BITS[name]
    obj[name] = {"limit": limit + shift, "zero": shift, "bool": True, "float": 1.0, "absent": None}[kind]
    if kind == "absent":
        del obj[name]
    outcome = assert_same(json.dumps(obj))  # orjson writes no integer of 65 bits
    assert (outcome[0] == "accepted") == (kind in ("limit", "zero") and shift == 0 - (kind == "limit"))


@given(events(), st.one_of(st.none(), st.binary(max_size=26), st.sampled_from([
    b"0000000000000000-00000000", b"000000000000000a-00000000", b"0000000000000000-0000000\n",
    b" 000000000000000-00000000", b"+000000000000000-00000000",
])), st.booleans())
def test_check_key_agrees_with_the_reference(kw: dict[str, Any], key: bytes | None, own: bool) -> None:
    ev = decode_event(encode_event(**kw))
    if own:
        key = event_key(ev.commit_lsn, ev.seq)
    outcomes = []
    for check in (reference_check_key, check_key):
        try:
            check(key, ev)
            outcomes.append("ok")
        except ContractError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("commit_lsn, seq", [(2**64, 0), (0, 2**32), (-1, 0), (0, -1)])
def test_check_key_refuses_a_key_for_an_event_out_of_range(commit_lsn: int, seq: int) -> None:
    # A ChangeEvent built by hand can hold what no valid key says: its formatted "key" is no key.
    ev = ChangeEvent(lsn=0, commit_lsn=commit_lsn, seq=seq, xid=0, operation="delete", table="a.b", timestamp="t")
    with pytest.raises(ContractError):
        check_key(b"%016X-%08X" % (commit_lsn, seq), ev)


def test_the_fast_constructor_refuses_a_changed_dataclass() -> None:
    # decode_event sets ChangeEvent's slots by name: a field added to the class must stop the import.
    from walbus.contract import _slot_setters

    with pytest.raises(TypeError, match="fields"):
        _slot_setters(RowImage, ("columns", "types"))
    with pytest.raises(TypeError, match="fields"):
        _slot_setters(RowImage, ("columns", "types", "values", "values"))


@pytest.mark.parametrize("version", [b"true", b"1.0"])
def test_a_version_that_only_equals_1_in_python_is_refused(version: bytes) -> None:
    # JSON true and 1.0 compare equal to 1 in Python; the contract's version is the integer 1.
    raw = encode_event(lsn=1, commit_lsn=1, seq=0, xid=1, operation="delete", table="public.t",
                       timestamp="2024-01-01T00:00:00+00:00", pk=["id"], new=None, identity=None)
    assert raw.startswith(b'{"v":1,')
    decode_event(raw)
    with pytest.raises(ContractError, match="unknown contract version"):
        decode_event(raw.replace(b'"v":1,', b'"v":' + version + b",", 1))
