"""Properties of walbus.contract over random names, values and positions (no services)."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.support.prop import (
    MAX_LSN,
    MAX_SEQ,
    TS,
    columns,
    identifiers,
    json_values,
    strict,
    type_names,
)
from walbus.contract import (
    MAX_TOPIC_LENGTH,
    OPERATIONS,
    ContractError,
    check_key,
    database_topic,
    decode_event,
    encode_event,
    escape_topic_part,
    event_key,
    parse_event_key,
    qualify_table,
    split_table,
    table_topic,
    unescape_topic_part,
)

KAFKA_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
HASH_SUFFIX = re.compile(r"--[0-9a-f]{8}$")
positions = st.tuples(st.integers(0, MAX_LSN), st.integers(0, MAX_SEQ))


@st.composite
def events(draw: st.DrawFn) -> dict[str, Any]:
    """encode_event's keyword arguments for one random, valid event."""
    operation = draw(st.sampled_from(sorted(OPERATIONS)))
    cols = draw(columns())
    types = draw(st.lists(type_names, min_size=len(cols), max_size=len(cols)))
    values = draw(st.lists(json_values, min_size=len(cols), max_size=len(cols)))
    pk = draw(st.lists(st.sampled_from(cols), unique=True, max_size=len(cols)))
    has_row = operation in ("insert", "update", "read")
    new = {"columns": cols, "types": types, "values": values} if has_row else None
    identity = None
    if operation in ("update", "delete") and draw(st.booleans()):
        n = draw(st.integers(1, len(cols)))
        identity = {"columns": cols[:n], "types": types[:n], "values": draw(st.lists(json_values, min_size=n, max_size=n))}
    unchanged = draw(st.lists(identifiers, max_size=2)) if operation == "update" else None
    not_null = draw(st.lists(st.sampled_from(cols), unique=True, max_size=len(cols)))
    modifier = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=2)
    typmods = draw(st.dictionaries(st.sampled_from(cols), modifier, max_size=len(cols)))
    commit_lsn, seq = draw(positions)
    return dict(
        lsn=draw(st.integers(0, MAX_LSN)), commit_lsn=commit_lsn, seq=seq, xid=draw(st.integers(0, 2**32 - 1)),
        operation=operation, table=qualify_table(draw(identifiers), draw(identifiers)),
        timestamp=draw(st.sampled_from([TS, "2026-11-22T00:00:27.458750+00:00"])), pk=pk, new=new,
        identity=identity, unchanged=unchanged, not_null=not_null, typmods=typmods,
    )


@given(events())
def test_encode_decode_round_trips_exactly(kw: dict[str, Any]) -> None:
    raw = encode_event(**kw)
    ev = decode_event(raw)
    assert (ev.lsn, ev.commit_lsn, ev.seq, ev.xid) == (kw["lsn"], kw["commit_lsn"], kw["seq"], kw["xid"])
    assert (ev.operation, ev.table, ev.timestamp, list(ev.pk)) == (kw["operation"], kw["table"], kw["timestamp"], kw["pk"])
    for got, want in ((ev.new, kw["new"]), (ev.identity, kw["identity"])):
        if want is None:
            assert got is None
        else:
            assert got is not None
            assert (list(got.columns), list(got.types)) == (want["columns"], want["types"])
            assert strict(list(got.values)) == strict(want["values"])
    assert list(ev.unchanged) == (kw["unchanged"] or [])
    assert list(ev.not_null) == kw["not_null"]
    assert {name: list(mods) for name, mods in ev.typmods.items()} == kw["typmods"]
    assert ev.to_json() == raw  # and back to the very same bytes
    assert ev.key == event_key(kw["commit_lsn"], kw["seq"])
    check_key(ev.key, ev)


@given(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_float_specials_travel_as_strings(special: str) -> None:
    raw = encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                       pk=[], new={"columns": ["f"], "types": ["float8"], "values": [special]}, identity=None)
    assert orjson.loads(raw)["values"] == [special]
    new = decode_event(raw).new
    assert new is not None and new.values == (special,)


@given(identifiers, identifiers)
def test_qualify_split_round_trips(schema: str, table: str) -> None:
    qualified = qualify_table(schema, table)
    assert split_table(qualified) == (schema, table)
    if "." not in schema + table and '"' not in schema + table:
        assert qualified == f"{schema}.{table}"  # plain names keep their old form


@given(identifiers, identifiers, identifiers, identifiers)
def test_distinct_tables_qualify_distinctly(s1: str, t1: str, s2: str, t2: str) -> None:
    assume((s1, t1) != (s2, t2))
    assert qualify_table(s1, t1) != qualify_table(s2, t2)


@given(st.text(st.characters(exclude_categories=("Cs",))))
def test_split_table_accepts_or_refuses_never_crashes(text: str) -> None:
    try:
        schema, table = split_table(text)
    except ContractError:
        return
    assert schema and table
    assert split_table(qualify_table(schema, table)) == (schema, table)


@given(identifiers)
def test_topic_part_round_trips_and_is_kafka_legal(name: str) -> None:
    part = escape_topic_part(name)
    assert unescape_topic_part(part) == name
    assert re.fullmatch(r"[A-Za-z0-9_-]+", part)
    assert "--" not in part  # reserved for the hash suffix of cut or colliding names


@given(identifiers, identifiers)
def test_distinct_names_escape_distinctly(a: str, b: str) -> None:
    assume(a != b)
    assert escape_topic_part(a) != escape_topic_part(b)


@given(identifiers)
def test_database_topic_is_kafka_legal(database: str) -> None:
    topic = database_topic("walbus", database)
    assert KAFKA_TOPIC.match(topic)
    assert unescape_topic_part(topic.removeprefix("walbus.")) == database


def _table_topics(db: str, schema: str, table: str) -> tuple[str, str]:
    return table_topic("walbus", db, schema, table), table_topic("walbus", db, schema, table, hashed=True)


@given(identifiers, identifiers, identifiers)
def test_table_topic_is_kafka_legal_and_reversible_or_hashed(db: str, schema: str, table: str) -> None:
    plain, hashed = _table_topics(db, schema, table)
    for topic in (plain, hashed):
        assert KAFKA_TOPIC.match(topic) and len(topic) <= MAX_TOPIC_LENGTH
    assert HASH_SUFFIX.search(hashed)
    if HASH_SUFFIX.search(plain):
        assert plain == hashed  # too long for Kafka: the hashed form
        assert len(f"walbus.{escape_topic_part(db)}.{escape_topic_part(schema)}.{escape_topic_part(table)}") > MAX_TOPIC_LENGTH
    else:
        parts = plain.split(".")
        assert [unescape_topic_part(p) for p in parts[1:]] == [db, schema, table]


def _kafka_same(a: str, b: str) -> bool:
    """Kafka refuses a topic whose name equals an existing one's with '.' and '_' taken as one."""
    return a.replace(".", "_") == b.replace(".", "_")


@given(identifiers, st.tuples(identifiers, identifiers), st.tuples(identifiers, identifiers))
def test_distinct_tables_get_distinct_topics(db: str, a: tuple[str, str], b: tuple[str, str]) -> None:
    assume(a != b)
    plain_a, hashed_a = _table_topics(db, *a)
    plain_b, hashed_b = _table_topics(db, *b)
    assert plain_a != plain_b and hashed_a != hashed_b
    # Plain forms may collide for Kafka (public.a_b / public_a.b): the second table then takes
    # its hashed form, which must collide with neither form of the other.
    for x, y in ((hashed_a, plain_b), (hashed_a, hashed_b), (plain_a, hashed_b)):
        assert not _kafka_same(x, y), (x, y)


@pytest.mark.parametrize(("a", "b"), [(("public", "a_b"), ("public_a", "b")), (("a.b", "c"), ("a_b", "c"))])
def test_kafka_colliding_plain_topics_are_told_apart_by_the_hashed_form(a: tuple[str, str], b: tuple[str, str]) -> None:
    plain_a, _ = _table_topics("db", *a)
    plain_b, hashed_b = _table_topics("db", *b)
    assert plain_a != plain_b and not _kafka_same(plain_a, hashed_b)


@given(positions)
def test_event_key_round_trips(pos: tuple[int, int]) -> None:
    key = event_key(*pos)
    assert len(key) == 25 and parse_event_key(key) == pos


@given(positions, positions)
def test_event_key_byte_order_is_position_order(p: tuple[int, int], q: tuple[int, int]) -> None:
    assert (event_key(*p) < event_key(*q)) == (p < q)
    assert (event_key(*p) == event_key(*q)) == (p == q)


@given(st.binary(max_size=30))
def test_parse_event_key_accepts_or_refuses_never_crashes(key: bytes) -> None:
    try:
        pos = parse_event_key(key)
    except ContractError:
        return
    assert event_key(*pos) == key


@given(events(), positions)
def test_check_key_refuses_any_other_position(kw: dict[str, Any], other: tuple[int, int]) -> None:
    ev = decode_event(encode_event(**kw))
    assume(other != ev.position)
    with pytest.raises(ContractError):
        check_key(event_key(*other), ev)
    with pytest.raises(ContractError):
        check_key(None, ev)


_NOT_A_NAME = st.one_of(st.integers(-(2**63), 2**63 - 1), st.none(), st.booleans(), st.floats(allow_nan=False),
                        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=2),
                        st.dictionaries(st.text(max_size=2), st.integers(-(2**63), 2**63 - 1), max_size=1))


@given(events(), st.sampled_from(["pk", "columns", "types", "unchanged", "identity.columns", "identity.types"]),
       _NOT_A_NAME, st.integers(0, 5))
def test_names_that_are_not_strings_are_contract_errors(kw: dict[str, Any], where: str, junk: Any, at: int) -> None:
    """A number or null among pk/columns/types/unchanged is the record's fault, not a crash further on."""
    obj = orjson.loads(encode_event(**kw))
    holder = obj.get("identity") if where.startswith("identity.") else obj
    name = where.removeprefix("identity.")
    assume(isinstance(holder, dict) and isinstance(holder.get(name), list))
    names = holder[name]
    names.insert(min(at, len(names)), junk)
    if name in ("columns", "types"):  # keep the lists aligned: only the name is wrong
        holder["values" if name == "columns" else "columns"].insert(min(at, len(names) - 1), "x")
        other = "types" if name == "columns" else "values"
        holder[other].insert(min(at, len(names) - 1), "x")
    with pytest.raises(ContractError):
        decode_event(orjson.dumps(obj))


@given(events())
def test_a_decoder_of_the_first_v1_reads_events_with_column_metadata(kw: dict[str, Any]) -> None:
    """not_null and typmods are additive: the same event without them decodes to the same
    row, and a v1 decoder that knows only the first fields ignores them (unknown keys)."""
    raw = encode_event(**kw)
    bare = encode_event(**{**kw, "not_null": None, "typmods": None})
    with_meta, without = decode_event(raw), decode_event(bare)
    assert (with_meta.new, with_meta.identity, with_meta.pk) == (without.new, without.identity, without.pk)
    assert (without.not_null, dict(without.typmods)) == ((), {})
    obj = orjson.loads(raw)
    assert ("not_null" in obj) == bool(kw["not_null"]) and ("typmods" in obj) == bool(kw["typmods"])
    first_v1 = {name: obj[name] for name in obj if name not in ("not_null", "typmods")}
    assert orjson.loads(bare) == first_v1


def test_column_types_join_types_modifiers_nullability_and_key() -> None:
    raw = encode_event(
        lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS, pk=["id", "at"],
        new={"columns": ["id", "at", "amount", "name", "tags", "note"],
             "types": ["int4", "timestamp", "numeric", "varchar", "_numeric", "text"],
             "values": [1, "2026-01-02 03:04:05.123", "12.50", "x", "{1.5}", None]},
        identity=None, not_null=["amount"], typmods={"at": [3], "amount": [12, 2], "name": [40], "tags": [5, 1]},
    )
    types = decode_event(raw).column_types()
    assert list(types) == ["id", "at", "amount", "name", "tags", "note"]
    assert [(t.nullable, t.primary_key) for t in types.values()] == [
        (False, True), (False, True), (False, False), (True, False), (True, False), (True, False)
    ]
    amount, name, at, tags, note = types["amount"], types["name"], types["at"], types["tags"], types["note"]
    assert (amount.precision, amount.scale, amount.length, amount.declared) == (12, 2, None, "numeric(12,2)")
    assert (name.precision, name.scale, name.length, name.declared) == (None, None, 40, "varchar(40)")
    assert (at.precision, at.scale, at.declared) == (3, None, "timestamp(3)")
    assert (tags.precision, tags.scale, tags.declared) == (5, 1, "_numeric(5,1)")
    assert (note.modifiers, note.precision, note.declared) == ((), None, "text")


def test_metadata_fields_are_checked() -> None:
    base = orjson.loads(encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="truncate", table="public.t",
                                     timestamp=TS, pk=[], new=None, identity=None))
    for field, value, message in [
        ("not_null", "id", "field 'not_null' must be a list"),
        ("not_null", [1], "not_null: names must be strings"),
        ("typmods", [[12, 2]], "field 'typmods' must be an object"),
        ("typmods", {"a": [12.0]}, "must map each column to a list of 32-bit integers"),
        ("typmods", {"a": [2**31]}, "must map each column to a list of 32-bit integers"),
        ("typmods", {"a": 12}, "must map each column to a list of 32-bit integers"),
        ("typmods", {"a": [True]}, "must map each column to a list of 32-bit integers"),
    ]:
        with pytest.raises(ContractError, match=re.escape(message)):
            decode_event(orjson.dumps({**base, field: value}))
    for field in ("not_null", "typmods"):  # null is absent
        ev = decode_event(orjson.dumps({**base, field: None}))
        assert (ev.not_null, dict(ev.typmods)) == ((), {})
