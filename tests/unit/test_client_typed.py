"""typed_row(): PostgreSQL text to Python values, and the array parser (property tests)."""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tests.support.prop  # noqa: F401  # the deterministic profile
from walbus.client.event import feed_event
from walbus.client.typed import TypedValueError, parse_array, typed_value
from walbus.contract import ChangeEvent, RowImage

# Every type docs/contract.md names, as the producer writes it.
CASES: list[tuple[str, Any, Any]] = [
    ("int2", 7, 7),
    ("int4", -2147483648, -2147483648),
    ("int8", 9223372036854775807, 9223372036854775807),
    ("oid", 4294967295, 4294967295),
    ("float4", 1.5, 1.5),
    ("float8", "Infinity", math.inf),
    ("float8", "-Infinity", -math.inf),
    ("bool", True, True),
    ("numeric", "123456789012345678901234567890.12", Decimal("123456789012345678901234567890.12")),
    ("numeric", "12.50", Decimal("12.50")),
    ("numeric(12,2)", "12.50", Decimal("12.50")),  # a type name with its modifier
    ("_numeric(5,1)", "{1.5}", [Decimal("1.5")]),
    ("numeric", "NaN", Decimal("NaN")),
    ("bytea", "\\x00ff", b"\x00\xff"),
    ("bytea", "a\\000\\\\b", b"a\x00\\b"),
    ("_int4", "{1,2,3}", [1, 2, 3]),
    ("timestamptz", "2024-01-02 01:04:05.678901+00", datetime(2024, 1, 2, 1, 4, 5, 678901, tzinfo=UTC)),
    ("timestamptz", "2024-01-02 01:04:05+05:30", datetime(2024, 1, 2, 1, 4, 5, tzinfo=timezone(timedelta(hours=5, minutes=30)))),
    ("timestamp", "2024-01-02 01:04:05", datetime(2024, 1, 2, 1, 4, 5)),
    ("date", "2024-01-02", date(2024, 1, 2)),
    ("time", "04:05:06.789", time(4, 5, 6, 789000)),
    ("timetz", "04:05:06+02", time(4, 5, 6, tzinfo=timezone(timedelta(hours=2)))),
    ("uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")),
    ("json", '{"a": [1, 2.5, null]}', {"a": [1, 2.5, None]}),
    ("jsonb", '"text"', "text"),
    ("text", "12.50", "12.50"),
    ("varchar", "{a,b}", "{a,b}"),
    ("mood", "happy", "happy"),  # an enum: its own name
    ("interval", "1 day 02:03:04", "1 day 02:03:04"),
    ("_text", '{a,"b c",NULL,"NULL"}', ["a", "b c", None, "NULL"]),
    ("_numeric", "{{1.10,NULL},{2,3}}", [[Decimal("1.10"), None], [Decimal("2"), Decimal("3")]]),
    ("_bool", "{t,f}", [True, False]),
    ("_jsonb", '{"{\\"a\\": 1}",NULL}', [{"a": 1}, None]),
    ("_bytea", '{"\\\\x00ff"}', [b"\x00\xff"]),
    ("_date", "{2024-01-02,infinity}", [date(2024, 1, 2), "infinity"]),
    ("_float8", "{NaN,1.5}", [math.nan, 1.5]),
    # Legal values Python's types cannot hold stay text; so does a masked value.
    ("timestamptz", "infinity", "infinity"),
    ("timestamp", "-infinity", "-infinity"),
    ("date", "0044-03-15 BC", "0044-03-15 BC"),
    ("timestamptz", "12345-01-01 00:00:00+00", "12345-01-01 00:00:00+00"),
    ("time", "24:00:00", "24:00:00"),
    ("numeric", "****", "****"),
    ("int4", None, None),
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, Decimal) and a.is_nan():
        return isinstance(b, Decimal) and b.is_nan()
    return type(a) is type(b) and a == b and str(a) == str(b)  # str: Decimal keeps its scale


@pytest.mark.parametrize(("type_name", "value", "expected"), CASES)
def test_typed_value(type_name: str, value: Any, expected: Any) -> None:
    assert _same(typed_value(type_name, value), expected)


def test_typed_row_on_a_delivered_event() -> None:
    new = RowImage(("id", "amount", "tags"), ("int4", "numeric", "_text"), (1, "12.50", "{a,b}"))
    ident = RowImage(("id",), ("int4",), (1,))
    event = feed_event(ChangeEvent(1, 2, 0, 3, "update", "public.t", "t", ("id",), new, ident), 1, None)
    assert event.row() == {"id": 1, "amount": "12.50", "tags": "{a,b}"}  # row() stays text-exact
    assert event.typed_row() == {"id": 1, "amount": Decimal("12.50"), "tags": ["a", "b"]}
    assert event.typed_identity() == {"id": 1}


@pytest.mark.parametrize(("type_name", "text"), [("int4", "{1,x}"), ("_int4", "{1,x}"), ("uuid", "nope"), ("_text", "{a"), ("_text", "{a}b"), ("_text", "{,}"), ("bool", "yes")])
def test_text_that_is_not_the_type_is_an_error(type_name: str, text: str) -> None:
    with pytest.raises(TypedValueError):
        typed_value(type_name, text)


# -- the array parser against a reference writer of PostgreSQL's array text ------------------

def _pg_element(value: str | None) -> str:
    """array_out's rule: quote when empty, NULL-like, or holding a special character or space."""
    if value is None:
        return "NULL"
    needs = value == "" or value.upper() == "NULL" or any(c in value for c in '{},"\\') or any(c.isspace() for c in value)
    if not needs:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pg_array(items: list[Any]) -> str:
    return "{" + ",".join(_pg_array(i) if isinstance(i, list) else _pg_element(i) for i in items) + "}"


ELEMENTS = st.one_of(st.none(), st.text(alphabet=st.sampled_from(list('ab ,{}"\\\tNULnul1é日')), max_size=6), st.sampled_from(["NULL", "null", ""]))


def _rectangular(depth: int, width: int) -> st.SearchStrategy[list[Any]]:
    if depth == 1:
        return st.lists(ELEMENTS, min_size=width, max_size=width)
    return st.lists(_rectangular(depth - 1, width), min_size=1, max_size=3)


ARRAYS = st.integers(1, 3).flatmap(lambda d: st.integers(1, 4).flatmap(lambda w: _rectangular(d, w)))


@given(ARRAYS)
def test_parse_array_inverts_array_out(items: list[Any]) -> None:
    assert parse_array(_pg_array(items)) == items


@given(st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=10))
def test_int_arrays(items: list[int | None]) -> None:
    text = "{" + ",".join("NULL" if i is None else str(i) for i in items) + "}"
    assert typed_value("_int8", text) == items


@given(st.lists(st.decimals(allow_nan=False, allow_infinity=False, places=3), min_size=1, max_size=5))
def test_numeric_arrays_stay_exact(items: list[Decimal]) -> None:
    text = "{" + ",".join(str(i) for i in items) + "}"
    got = typed_value("_numeric", text)
    assert [str(g) for g in got] == [str(i) for i in items]


def test_array_spaces_and_bounds() -> None:
    assert parse_array(' { 1 , 2 } ', int) == [1, 2]
    assert parse_array("[0:1]={7,8}", int) == [7, 8]
    assert parse_array("{{},{}}") == [[], []]


@pytest.mark.parametrize(
    ("type_name", "text", "modifiers", "expected"),
    [
        ("numeric", "12.50", (12, 2), "12.50"),
        ("numeric", "5", (12, 2), "5.00"),  # a producer that wrote fewer digits: zeros added
        ("numeric", "1.23456", (12, 2), "1.23456"),  # more digits than the scale: never cut
        ("numeric", "-0.5", (4, 3), "-0.500"),
        ("numeric", "NaN", (12, 2), "NaN"),
        ("numeric", "1200", (5, -2), "1200"),
        ("numeric", "5", (), "5"),
        ("_numeric", "{1.5,NULL,2}", (6, 2), ["1.50", None, "2.00"]),
    ],
)
def test_numeric_takes_the_columns_scale(type_name: str, text: str, modifiers: tuple[int, ...], expected: Any) -> None:
    got = typed_value(type_name, text, modifiers)
    if isinstance(expected, list):
        assert [None if g is None else str(g) for g in got] == expected
    else:
        assert isinstance(got, Decimal) and str(got) == expected


def test_typed_row_uses_the_events_typmods() -> None:
    event = ChangeEvent(
        1, 2, 0, 3, "insert", "public.t", "ts", ("id",),
        RowImage(("id", "amount", "name"), ("int4", "numeric", "varchar"), (1, "7", "x")),
        typmods={"amount": (12, 2), "name": (40,)},
    )
    row = feed_event(event, 1, None).typed_row()
    assert row == {"id": 1, "amount": Decimal("7.00"), "name": "x"} and str(row["amount"]) == "7.00"


def test_a_box_array_is_split_at_its_semicolons() -> None:
    # PostgreSQL separates box[] elements with ';' (a box's text holds commas): split at the
    # commas it came out as seven garbled elements (a types fuzz).
    from walbus.client.typed import typed_value

    assert typed_value("_box", "{(1,1),(0,0);(3,3),(2,2)}") == ["(1,1),(0,0)", "(3,3),(2,2)"]
    assert typed_value("_box", '{{"(1,1),(0,0)";NULL}}') == [["(1,1),(0,0)", None]]
    assert typed_value("_point", '{"(1,2)","(3,4)"}') == ["(1,2)", "(3,4)"]  # quoted: commas inside


def test_a_type_whose_own_name_starts_with_an_underscore_is_no_array() -> None:
    # PostgreSQL takes `CREATE TYPE _mood AS ENUM (...)` (its array type is then `__mood`): the
    # event's type `_mood` named a scalar, and typed_row() raised "not an array" on its value.
    assert typed_value("_mood", "happy") == "happy"
    with pytest.raises(TypedValueError):
        typed_value("_int4", "5")  # a built-in array type's text always starts with '{' or '['
    assert typed_value("__mood", "{happy,sad}") == ["happy", "sad"]  # its array
    assert typed_value("_int4", "{1,2}") == [1, 2]
    assert typed_value("_int4", "[0:1]={1,2}") == [1, 2]
